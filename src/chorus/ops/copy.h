// Moving data: between devices, between dtypes, into contiguous layout.
//
// Note [Cross-device operands]: an op runs on the device of its first tensor
// argument (in-place ops: of self). Other operands are brought there with
// ops::to_device, which enqueues an asynchronous copy ordered after the work
// already issued on the source device (events, never a host wait) and tells
// the source's allocator that the destination stream reads the memory, so it
// is not reused before the copy is done.
//
// Note [Parameters on another device]: a trainable parameter (a leaf that
// requires grad) brought to another device as an operand is copied there on
// every use, and its gradient copied back: almost always a module whose
// input arrived from elsewhere while its weights stayed put. Layers move their
// input to their parameters' device instead (nn::Module::on_own_device), so
// this happens only in hand-written ops; it warns once per parameter, naming
// it and both devices, or throws under the Error policy
// (CHORUS_STRICT_PLACEMENT=1 in the environment, or set_parameter_copy_policy).
#pragma once

#include <initializer_list>

#include "chorus/core/tensor.h"

namespace chorus::ops {

enum class ParameterCopy { Warn, Error, Allow };
// The policy for Note [Parameters on another device]; the default is Warn, or
// Error when CHORUS_STRICT_PLACEMENT=1.
void set_parameter_copy_policy(ParameterCopy policy);
ParameterCopy parameter_copy_policy();
// to_device for an op's operand: applies that policy to trainable parameters.
Tensor operand_to_device(const Tensor& t, const Device& d);

// The tensor itself when already on `d`, else a copy on `d`: channels-last
// when `t` is dense channels-last, contiguous otherwise.
Tensor to_device(const Tensor& t, const Device& d);
Tensor to_dtype(const Tensor& t, DType dt);
Tensor contiguous(const Tensor& t);
Tensor clone(const Tensor& t);
// dst[...] = src broadcast to dst's shape; any devices and dtypes.
void copy_(const Tensor& dst, const Tensor& src);
// Note [Multi-tensor copy] (cuda/kernels/copy_multi.cu): dsts[i] = srcs[i] for every
// i, with one kernel-set call per device for the pairs that allow it (on a GPU
// one launch per few dozen pairs instead of one each). Every pair has one
// shape and one dtype. A pair whose two tensors are on one device, dense and
// with the same strides (Note [Dense tensors are flat]) is copied through the
// tensors' flat views, together with the others; any other pair (a strided or
// broadcast view, different layouts, different devices) takes copy_. The
// copies are not ordered among each other: no destination may overlap another
// pair's source or destination, nor partly its own source (checked for the
// pairs copied together; a pair whose source is its destination is skipped).
// ValueError, naming the pair, for lists of different lengths, an undefined
// tensor, or a pair of different shapes or dtypes. Bumps every destination's
// version; not recorded by autograd.
void copy_multi(const TensorList& srcs, const TensorList& dsts);
void fill_(const Tensor& dst, double v);
// Reads a one-element tensor on the host (waits for its device).
double item(const Tensor& t);
// Channels-last (NHWC memory) copy of a 4-d tensor, and back.
Tensor to_channels_last(const Tensor& t);
bool is_channels_last(const Tensor& t);
// An uninitialised tensor of `sizes` and `dt` on t's device, channels-last when
// t is (so elementwise ops and casts keep a network's NHWC layout, as PyTorch's
// memory-format propagation does).
Tensor empty_like_layout(const Tensor& t, const Shape& sizes, DType dt);
// An uninitialised tensor of `sizes`, channels-last when asked and 4-d.
Tensor empty_with_layout(const Shape& sizes, DType dt, Device dev, bool channels_last);

// Note [Dense tensors are flat]: when every operand of an elementwise kernel
// has the same sizes and strides and those cover memory densely (contiguous,
// channels-last, or any permutation of a contiguous tensor), the kernel may
// treat them as 1-d arrays. This keeps NHWC activations on the kernels'
// vectorised contiguous paths.
bool same_dense_layout(std::initializer_list<const Tensor*> ts);
Tensor flat_view(const Tensor& t);

}  // namespace chorus::ops
