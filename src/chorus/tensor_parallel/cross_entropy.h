// Vocabulary-parallel cross entropy (Megatron-LM's
// vocab_parallel_cross_entropy): each tensor-parallel rank holds the logits
// of its own slice of the vocabulary, [..., V/tp] for columns
// [rank * V/tp, (rank + 1) * V/tp), and the loss is computed without ever
// gathering the full [..., V] logits. Three numbers per row cross the group,
// in two all-reduces: the row's maximum (max), then its sum of exponentials
// and its target's logit (sum, packed in one buffer). The backward
// (softmax - one-hot on the local columns) needs no communication.
#pragma once

#include <optional>

#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"

namespace chorus::tp {

// Mean over rows (targets equal to ignore_index left out) of
// -log softmax(logits)[target], the softmax over the first `vocab` columns of
// the whole vocabulary (the padding columns past it excluded, as
// nn::functional::cross_entropy_fused). local_logits [..., V/tp] with
// targets [...] (int64 or int32, global token ids, the same on every rank).
// Computed, and returned, in float64 for float64 logits, float32 otherwise.
Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, int64_t vocab,
                                    const dist::ProcessGroupPtr& group,
                                    std::optional<int64_t> ignore_index = std::nullopt);

}  // namespace chorus::tp
