// Direct convolutions of very few input channels (a network's stem). Include
// only from src/chorus/cuda.
#pragma once

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"

namespace chorus::cuda {

// Note [Direct convolutions of a few input channels]
// A network's first convolution reads the image: 3 channels (Wide ResNet's
// stem: 3 -> 16 channels, 3x3, at 32x32). Its work is tiny (WRN-28-10 at batch
// 128: 57 M multiply-adds, 0.8 MB in, 4 MB out) but cuDNN's engines for it
// are built for wide channels: on an H100 its best forward and weight
// gradient (plus padding and conversion kernels around them) took several
// times what memory alone allows (benchmarks journal, session 28); the forward opens
// the step and the weight gradient closes the backward, both with nothing
// beside them. Here the forward runs a thread per output pixel, its taps
// loaded straight into registers (every load in flight at once, so a thread
// waits for memory once) against the filter in shared memory, 8 or 16 output
// channels at a time; the weight gradient sums per-block partials over pixel
// tiles staged in shared memory (dy with 16-byte loads, the taps a thread a
// pixel as in the forward), added in a fixed order by a second kernel
// (deterministic) that writes the gradient in the filter's own dtype and
// strides (a float32 parameter's gradient directly, no conversion
// after). The data gradient stays with cuDNN (an image needs none). Each
// geometry and direction is timed once against cuDNN (conv.cpp) and runs the
// faster from then on, this only when 3% ahead; CHORUS_CONV_DIRECT=0 turns it
// off. On WRN-28-10's stem both directions beat cuDNN's; a first version that
// staged each tile's taps in shared memory, a global load's latency per few
// taps, lost the weight gradient to it (benchmarks journal, session 28).

// Whether the direct kernels can compute this convolution: channels-last
// 16-bit data, one group, at most 4 input channels, at most 64 taps
// (kh * kw * C_in), output channels a multiple of 8 and at most 64.
bool conv_direct_applies(const Conv2dGeometry& g, Layout layout, DType dtype);

// y = conv(x, w): x, y dense channels-last of one 16-bit dtype, w the filter
// in the channels-last layout ([K][R][S][C], dense) of that dtype.
void conv_direct_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y);

// dweight = the filter gradient from dy and x (dense channels-last, 16-bit),
// written in dweight's dtype (that dtype or float32) and strides.
void conv_direct_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x, const Tensor& dweight);

// Whether CHORUS_CONV_DIRECT (default on) allows the path; tests turn it on
// and off.
bool conv_direct_enabled();
void set_conv_direct_enabled(bool on);

// Calls of the two functions above since the process began (timed runs
// included): tests see that the ops reached the path.
int64_t conv_direct_runs();

}  // namespace chorus::cuda
