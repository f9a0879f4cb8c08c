// Placing a Sequential over devices (model parallelism). With placement that
// holds (Note [Placement that holds] in nn/module.h) a placed Sequential runs
// as it is: each layer runs where its parameters are and the activations move
// between devices by themselves.
//
//   parallel::place(*net, {3, 5}, parse_devices("cuda:0,cuda:1"));      // layers 0-2, then 3-7
//   auto balance = parallel::balance_by_time(*net, sample, 2);           // torchgpipe's balance_by_time
//   parallel::place(*net, balance, devices);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/nn/layers.h"

namespace chorus::parallel {

// Moves layers [0, balance[0]) to devices[0], the next balance[1] to
// devices[1], and so on. ValueError (one line naming what is wrong) when the
// balance and the device list differ in length, a part is empty or negative,
// the parts do not add up to the number of layers, or a device does not exist.
// "3,5": a balance as the command line writes it, for error messages.
std::string balance_str(const std::vector<int64_t>& balance);

void place(nn::Sequential& seq, const std::vector<int64_t>& balance, const std::vector<Device>& devices);

// How many consecutive layers each of `partitions` parts should take so that
// the parts' forward + backward times are as even as possible: each layer is
// timed on `sample` (a batch as training will see it; on the layer's current
// device) over `repeats` runs after one warm-up, then the layers are split
// into contiguous parts minimising the slowest part (exact, by dynamic
// programming). ValueError when there are fewer layers than partitions.
std::vector<int64_t> balance_by_time(nn::Sequential& seq, const Tensor& sample, int64_t partitions, int repeats = 3);

// torchgpipe's balance_by_size: the split that evens out memory. Each
// layer's cost is the bytes its forward on `sample` leaves allocated on its
// device for the backward (measured: the device's peak during the forward
// minus what was in use before it) plus `param_scale` times its parameters'
// bytes (2: the weights and their gradients; more for an optimizer's state,
// 4 for Adam). Batch-norm statistics are restored afterwards.
std::vector<int64_t> balance_by_memory(nn::Sequential& seq, const Tensor& sample, int64_t partitions,
                                       double param_scale = 2.0);

// The same split from given per-layer costs (seconds, bytes, ...): the exact
// minimum of the largest part's total over contiguous splits.
std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int64_t partitions);

// Stages over ranks from per-layer costs (Note [Pipeline stages by cost] in
// models/gpt_pipeline.h): ranks x virtual_stages counts of consecutive
// layers adding up to costs.size(), stage s on rank s % ranks. One stage a
// rank: the least slowest stage (balance_by_cost), and among the splits
// under it the most even (the least sum of squared stage costs), a tie going
// to the split whose later stages are lighter. Several (interleaved): each
// cut at the layer boundary nearest its share of the total, the even split
// by count kept where that leaves the slowest rank no lighter. ValueError
// when there are more stages than layers.
std::vector<int64_t> balance_ranks(const std::vector<double>& costs, int64_t ranks, int64_t virtual_stages = 1);

}  // namespace chorus::parallel
