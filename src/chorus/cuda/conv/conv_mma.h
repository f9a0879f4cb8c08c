// Tensor-core forward convolutions where one side has few channels. Include
// only from src/chorus/cuda.
#pragma once

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"

namespace chorus::cuda {

// Note [Tensor-core convolutions of few channels]
// Wide ResNet's first block turns 16 channels into 160 (3x3 and the 1x1
// shortcut, at 32x32): as a GEMM its reduction is only 144 (or 16) long, and
// cuDNN's kernels, tiled for wide reductions, ran its forward far below the
// tensor cores' rate, several times what writing its 42 MB output takes, and
// torch.compile's max-autotune has a faster Triton kernel for it (benchmarks
// journal, sessions 24 and 28).
// Here it is an implicit GEMM on mma.sync (m16n8k16, float accumulators): a
// block takes a tile of whole output rows (64 or 128 pixels) and every output
// channel; the filter, the whole of it, sits in shared memory; the tile's
// input halo (its rows and the filter's reach around them, 16 channels at a
// time) is staged by cp.async a few steps ahead, zeros where the window leaves
// the image, so each input pixel comes from memory about once and every tap
// reads its operands from shared memory. The reduction index is permuted
// inside each 16-wide slice so that a thread's A and B registers are 4
// consecutive channels (one 8-byte load each), and the output channels inside
// each 16 so that a thread's 4 results per pixel are consecutive (8-byte
// stores, 32 bytes per pixel row). It beats cuDNN on the 16 -> 160 forwards
// (benchmarks journal, session 28). The data gradient as the forward of dy
// with the filter flipped (160 channels in, 16 out) was tried and lost to
// cuDNN (10 steps of 16 channels a tile, 4 products a warp between barriers),
// and is not offered. Each geometry is timed once against
// cuDNN (conv.cpp) and runs the faster from then on, this only when 3% ahead;
// CHORUS_CONV_MMA=0 turns it off.

// Whether the kernel can compute this convolution's forward: channels-last
// 16-bit data, one group, stride and dilation 1, input channels a multiple of
// 16, output channels 16, 32, 64, 96, 128 or 160, one of the two at most 32,
// the filter within 100 KB of shared memory, and output rows a multiple of 16
// pixels wide that tile 64 pixels (128 for 16 or 32 output channels) in whole
// rows.
bool conv_mma_applies(const Conv2dGeometry& g, Layout layout, DType dtype);

// Whether the data are aligned as the kernel loads them: the input and the
// output at 8 bytes, the filter at 16.
bool conv_mma_aligned(const Tensor& in, const Tensor& w, const Tensor& out);

// y = conv(x, w): x, y dense channels-last of one 16-bit dtype; w the filter
// in the channels-last layout ([K][R][S][C], dense); conv_mma_aligned.
void conv_mma_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y);

// Whether CHORUS_CONV_MMA (default on) allows the path; tests turn it on and
// off.
bool conv_mma_enabled();
void set_conv_mma_enabled(bool on);

// Calls of conv_mma_forward since the process began (timed runs
// included): tests see that the ops reached the path.
int64_t conv_mma_runs();

}  // namespace chorus::cuda
