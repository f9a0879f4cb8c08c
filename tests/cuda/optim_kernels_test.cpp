// The CUDA optimizer kernels (SGD and AdamW, one tensor and multi-tensor,
// with addends, device scalars and a gradient scale) against the CPU kernel
// set on random twins (cuda/twins.h), as elementwise_test.cpp does for the
// other kernels.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/tensor.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/ops/factory.h"
#include "cuda/twins.h"

namespace chorus {
namespace {

using namespace cuda_twins;

// ---- optimizers ---------------------------------------------------------------------------------

TEST(CudaKernels, SgdUpdateMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  struct Case {
    double lr, momentum, dampening, weight_decay;
    bool nesterov, first_step;
  };
  const Case cases[] = {{0.1, 0.0, 0.0, 0.01, false, true},
                        {0.05, 0.9, 0.1, 1e-4, false, true},
                        {0.05, 0.9, 0.1, 1e-4, false, false},
                        {0.05, 0.9, 0.0, 0.0, true, false}};
  uint32_t seed = 200;
  const int64_t n = 1003;
  for (const Case& c : cases) {
    const Twin param = random_twin({n}, kFloat32, ++seed);
    const Twin grad = random_twin({n}, kFloat32, ++seed);
    const Twin buf = random_twin({n}, kFloat32, ++seed);
    cpu::sgd_update(param.cpu, grad.cpu, buf.cpu, c.lr, c.momentum, c.dampening, c.weight_decay,
                    c.nesterov, c.first_step);
    cuda::sgd_update(param.gpu, grad.gpu, buf.gpu, c.lr, c.momentum, c.dampening, c.weight_decay,
                     c.nesterov, c.first_step);
    const std::string what = "sgd momentum " + std::to_string(c.momentum) +
                             (c.nesterov ? " nesterov" : "") + (c.first_step ? " first step" : "");
    expect_near(param.gpu, param.cpu, 1e-6, 1e-7, what + " param");
    expect_near(buf.gpu, buf.cpu, 1e-6, 1e-7, what + " momentum buffer");
  }
}

// A twin of n random values that is a view at `offset` floats into a larger
// tensor: offsets 1-3 are not 16-byte aligned, so the multi-tensor updates
// must take such a tensor one float at a time (Note [Optimizer packs]).
Twin offset_twin(int64_t n, int64_t offset, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  const Twin whole = random_twin({n + offset}, kFloat32, seed, lo, hi);
  return Twin{whole.cpu.narrow(0, offset, n), whole.gpu.narrow(0, offset, n)};
}

// The multi-tensor SGD: more tensors than one launch's table holds (64), one
// tensor of many blocks, an empty tensor, sizes that are not multiples of
// anything, and state that is not 16-byte aligned (one of param, gradient, buffer at a time, so packed and
// unpacked tensors share launches).
TEST(CudaKernels, SgdUpdateMultiMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  std::vector<int64_t> sizes;
  for (int i = 0; i < 70; ++i) sizes.push_back(1 + 97 * i);
  sizes.push_back(0);
  sizes.push_back(320 * 32768 + 12345);
  sizes.push_back(5);
  for (bool first : {true, false}) {
    std::vector<Twin> params, grads, bufs;
    uint32_t seed = first ? 300 : 700;
    TensorList gp, gg, gb;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i];
      const int64_t skew = static_cast<int64_t>(i % 4);  // 0: aligned
      params.push_back(i % 3 == 0 ? offset_twin(n, skew, ++seed) : random_twin({n}, kFloat32, ++seed));
      grads.push_back(i % 3 == 1 ? offset_twin(n, skew, ++seed) : random_twin({n}, kFloat32, ++seed));
      bufs.push_back(i % 3 == 2 ? offset_twin(n, skew, ++seed) : random_twin({n}, kFloat32, ++seed));
      gp.push_back(params.back().gpu);
      gg.push_back(grads.back().gpu);
      gb.push_back(bufs.back().gpu);
    }
    // 16-bit copies (Note [Autocast weight copies]) for some tensors: bf16 and
    // f16, one at an odd offset (not 8-byte aligned: one float at a time).
    TensorList copies(sizes.size());
    for (size_t i = 0; i < sizes.size(); i += 5) {
      const DType dt = i % 2 ? kFloat16 : kBFloat16;
      copies[i] = i % 3 == 2 ? zeros({sizes[i] + 1}, {dt, cuda_device(0)}).narrow(0, 1, sizes[i])
                             : zeros({sizes[i]}, {dt, cuda_device(0)});
    }
    // Not the first step: the learning rate comes from the device scalars
    // (the argument is a decoy that would fail the comparison).
    // Addends (Note [Gradient sums in the update]) for every other tensor, some
    // not 16-byte aligned: the gradient used is grad + addend.
    std::vector<Twin> addends;
    TensorList ga(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (i % 2) continue;
      addends.push_back(i % 6 == 4 ? offset_twin(sizes[i], 1, ++seed) : random_twin({sizes[i]}, kFloat32, ++seed));
      ga[i] = addends.back().gpu;
    }
    if (first) cuda::sgd_update_multi(gp, gg, gb, 0.05, 0.9, 0.0, 5e-4, true, first, Tensor(), copies, ga);
    else cuda::sgd_update_multi(gp, gg, gb, 7.5, 0.9, 0.0, 5e-4, true, first, gpu_scalars(0.05, 3), copies, ga);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const Tensor g = i % 2 ? grads[i].cpu : (grads[i].cpu + addends[i / 2].cpu).contiguous();
      cpu::sgd_update(params[i].cpu, g, bufs[i].cpu, 0.05, 0.9, 0.0, 5e-4, true, first);
      const std::string what = "sgd_update_multi tensor " + std::to_string(i) + " of " +
                               std::to_string(sizes[i]) + (first ? " first step" : "");
      expect_near(params[i].gpu, params[i].cpu, 1e-6, 1e-7, what + " param");
      expect_near(bufs[i].gpu, bufs[i].cpu, 1e-6, 1e-7, what + " momentum buffer");
      // The copy is the updated parameter rounded once: equal to casting it.
      if (copies[i].defined())
        EXPECT_EQ(copies[i].to(kFloat32).to(cpu_device(0)).to_vector<float>(),
                  params[i].gpu.to(copies[i].dtype()).to(kFloat32).to(cpu_device(0)).to_vector<float>())
            << what << " copy";
    }
  }
}

TEST(CudaKernels, AdamWUpdateMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 220;
  const int64_t n = 1003;
  for (int64_t step : {1, 7}) {
    const Twin param = random_twin({n}, kFloat32, ++seed);
    const Twin grad = random_twin({n}, kFloat32, ++seed);
    const Twin m = random_twin({n}, kFloat32, ++seed, -0.1, 0.1);
    const Twin v = random_twin({n}, kFloat32, ++seed, 0.0, 0.01);
    cpu::adamw_update(param.cpu, grad.cpu, m.cpu, v.cpu, 1e-3, 0.9, 0.999, 1e-8, 0.01, step);
    cuda::adamw_update(param.gpu, grad.gpu, m.gpu, v.gpu, 1e-3, 0.9, 0.999, 1e-8, 0.01, step);
    const std::string what = "adamw step " + std::to_string(step);
    expect_near(param.gpu, param.cpu, 1e-6, 1e-7, what + " param");
    expect_near(m.gpu, m.cpu, 1e-6, 1e-7, what + " exp_avg");
    expect_near(v.gpu, v.cpu, 1e-6, 1e-7, what + " exp_avg_sq");
  }
}

// The multi-tensor AdamW's cases, as the SGD one's: more tensors than a
// launch's table holds (56), a tensor of many blocks, an empty tensor, state
// not 16-byte aligned, and addends for every third tensor, some not 16-byte
// aligned.
struct AdamWCase {
  std::vector<int64_t> sizes;
  std::vector<Twin> params, grads, ms, vs;
  std::vector<Twin> addends;  // of tensors 0, 3, 6, ...
  TensorList gp, gg, gm, gv, ga, cp, cg, cm, cv, ca;
};

AdamWCase adamw_case(uint32_t seed) {
  AdamWCase c;
  for (int i = 0; i < 64; ++i) c.sizes.push_back(1 + 89 * i);
  c.sizes.push_back(0);
  c.sizes.push_back(320 * 32768 + 777);
  c.sizes.push_back(3);
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    const int64_t n = c.sizes[i];
    const int64_t skew = 1 + static_cast<int64_t>(i / 4 % 3);  // one state tensor not 16-byte aligned
    c.params.push_back(i % 4 == 0 ? offset_twin(n, skew, ++seed) : random_twin({n}, kFloat32, ++seed));
    c.grads.push_back(i % 4 == 1 ? offset_twin(n, skew, ++seed) : random_twin({n}, kFloat32, ++seed));
    c.ms.push_back(i % 4 == 2 ? offset_twin(n, skew, ++seed, -0.1, 0.1) : random_twin({n}, kFloat32, ++seed, -0.1, 0.1));
    c.vs.push_back(i % 4 == 3 ? offset_twin(n, skew, ++seed, 0.0, 0.01) : random_twin({n}, kFloat32, ++seed, 0.0, 0.01));
  }
  c.ga.resize(c.sizes.size());
  c.ca.resize(c.sizes.size());
  for (size_t i = 0; i < c.sizes.size(); i += 3) {
    c.addends.push_back(i % 6 == 3 ? offset_twin(c.sizes[i], 2, ++seed) : random_twin({c.sizes[i]}, kFloat32, ++seed));
    c.ga[i] = c.addends.back().gpu;
    c.ca[i] = c.addends.back().cpu;
  }
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    c.gp.push_back(c.params[i].gpu), c.gg.push_back(c.grads[i].gpu), c.gm.push_back(c.ms[i].gpu);
    c.gv.push_back(c.vs[i].gpu);
    c.cp.push_back(c.params[i].cpu), c.cg.push_back(c.grads[i].cpu), c.cm.push_back(c.ms[i].cpu);
    c.cv.push_back(c.vs[i].cpu);
  }
  return c;
}

TEST(CudaKernels, AdamWUpdateMultiMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (int64_t step : {1, 9}) {
    AdamWCase c = adamw_case(static_cast<uint32_t>(900 + 10 * step));
    // 16-bit copies (Note [Autocast weight copies]) for some tensors, bf16 and
    // f16, one at an odd offset (no packs).
    TensorList copies(c.sizes.size());
    for (size_t i = 0; i < c.sizes.size(); ++i) {
      const DType dt = i % 2 ? kFloat16 : kBFloat16;
      if (i % 3 == 1) copies[i] = zeros({c.sizes[i]}, {dt, cuda_device(0)});
      if (i == 2) copies[i] = zeros({c.sizes[i] + 1}, {dt, cuda_device(0)}).narrow(0, 1, c.sizes[i]);
    }
    // Step 9 reads lr and step from the device scalars (decoy arguments).
    if (step == 1)
      cuda::adamw_update_multi(c.gp, c.gg, c.gm, c.gv, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, Tensor(), c.ga, Tensor(),
                               copies);
    else
      cuda::adamw_update_multi(c.gp, c.gg, c.gm, c.gv, 0.5, 0.9, 0.999, 1e-8, 0.01, 2, gpu_scalars(1e-3, double(step)),
                               c.ga, Tensor(), copies);
    for (size_t i = 0; i < c.sizes.size(); ++i) {
      // The device scalars hold lr as float32.
      const double lr = step == 1 ? 1e-3 : double(float(1e-3));
      const Tensor g = i % 3 ? c.cg[i] : (c.cg[i] + c.ca[i]).contiguous();
      cpu::adamw_update(c.cp[i], g, c.cm[i], c.cv[i], lr, 0.9, 0.999, 1e-8, 0.01, step);
      const std::string what = "adamw_update_multi tensor " + std::to_string(i) + " of " + std::to_string(c.sizes[i]) +
                               " step " + std::to_string(step);
      expect_near(c.gp[i], c.cp[i], 1e-6, 1e-7, what + " param");
      expect_near(c.gm[i], c.cm[i], 1e-6, 1e-7, what + " exp_avg");
      expect_near(c.gv[i], c.cv[i], 1e-6, 1e-7, what + " exp_avg_sq");
      // The copy is the updated parameter rounded once: equal to casting it.
      if (copies[i].defined())
        EXPECT_EQ(copies[i].to(kFloat32).to(cpu_device(0)).to_vector<float>(),
                  c.gp[i].to(copies[i].dtype()).to(kFloat32).to(cpu_device(0)).to_vector<float>())
            << what << " copy";
    }
  }
}

// A fresh contiguous GPU copy of a GPU tensor's elements.
Tensor gpu_copy(const Tensor& t) {
  Tensor d = detail::empty_tensor(t.sizes(), t.dtype(), kGpu);
  if (t.numel() > 0) backend(kGpu).copy(d.raw_data(), kGpu, t.raw_data(), kGpu, t.nbytes());
  return d;
}

// Note [Clipping in the update] (optim/clip_grad.h): the multi-tensor AdamW
// with a gradient scale read from the device, against the CPU's with the same
// scale (adamw_case's tensors, addends and alignments), and against the GPU's
// own update of gradients scaled in place first by scale_multi (to float32
// rounding: see below).
TEST(CudaKernels, AdamWUpdateMultiGradScaleMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (int64_t step : {1, 9}) {
    const float scale = step == 1 ? 0.3712f : 1.0f;  // the clipped case, then a norm below the limit
    Tensor cpu_scale = full({}, scale, {kFloat32});
    Tensor gpu_scale = cpu_scale.to(cuda_device(0));
    AdamWCase c = adamw_case(static_cast<uint32_t>(1900 + 10 * step));
    const std::vector<int64_t>& sizes = c.sizes;
    TensorList &gp = c.gp, &gg = c.gg, &gm = c.gm, &gv = c.gv, &ga = c.ga, &cp = c.cp, &cg = c.cg, &cm = c.cm,
               &cv = c.cv, &ca = c.ca;
    // The in-place way on copies: grad + addend, scaled by scale_multi, then no scale.
    TensorList ip, ig, im, iv;
    for (size_t i = 0; i < sizes.size(); ++i) {
      ip.push_back(gpu_copy(gp[i]));
      ig.push_back(ga[i].defined() ? (gg[i] + ga[i]).contiguous() : gpu_copy(gg[i]));
      im.push_back(gpu_copy(gm[i]));
      iv.push_back(gpu_copy(gv[i]));
    }
    cuda::scale_multi(ig, gpu_scale);
    const double lr = step == 1 ? 1e-3 : double(float(1e-3));  // the device scalars hold lr as float32
    if (step == 1) {
      cuda::adamw_update_multi(gp, gg, gm, gv, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, Tensor(), ga, gpu_scale);
      cuda::adamw_update_multi(ip, ig, im, iv, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, Tensor(), {}, Tensor());
    } else {
      cuda::adamw_update_multi(gp, gg, gm, gv, 0.5, 0.9, 0.95, 1e-8, 0.1, 2, gpu_scalars(1e-3, double(step)), ga,
                               gpu_scale);
      cuda::adamw_update_multi(ip, ig, im, iv, 0.5, 0.9, 0.95, 1e-8, 0.1, 2, gpu_scalars(1e-3, double(step)), {},
                               Tensor());
    }
    cpu::adamw_update_multi(cp, cg, cm, cv, lr, 0.9, 0.95, 1e-8, 0.1, step, Tensor(), ca, cpu_scale);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string what = "scaled adamw_update_multi tensor " + std::to_string(i) + " of " +
                               std::to_string(sizes[i]) + " step " + std::to_string(step);
      expect_near(gp[i], cp[i], 1e-6, 1e-7, what + " param");
      expect_near(gm[i], cm[i], 1e-6, 1e-7, what + " exp_avg");
      expect_near(gv[i], cv[i], 1e-6, 1e-7, what + " exp_avg_sq");
      // Not bit for bit on the GPU: the folded product meets the update's
      // fused multiply-adds in registers, the in-place one through memory
      // (session 37, an H200: up to one float32 ulp apart in a few elements).
      expect_near(gp[i], ip[i], 1e-6, 1e-7, what + " param, against the in-place scale");
      expect_near(gm[i], im[i], 1e-6, 1e-7, what + " exp_avg, against the in-place scale");
      expect_near(gv[i], iv[i], 1e-6, 1e-7, what + " exp_avg_sq, against the in-place scale");
    }
  }
  // A scale that is not one float32 on the parameters' device: one line.
  Twin p = random_twin({8}, kFloat32, 5), g = random_twin({8}, kFloat32, 6), m = random_twin({8}, kFloat32, 7),
       v = random_twin({8}, kFloat32, 8);
  EXPECT_THROW(cuda::adamw_update_multi({p.gpu}, {g.gpu}, {m.gpu}, {v.gpu}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, Tensor(),
                                        {}, full({}, 0.5, {kFloat32})),
               ValueError);
}

// Note [Squares in chunks] (cuda/kernels/multi_tensor.cu): the clipping
// norm's sum of squares over 70 float32 and 70 bf16 tensors interleaved
// (more of each dtype than a launch's table holds: the dtypes' runs split and
// resume), an empty tensor, a float32 tensor of several chunks and a part of
// one, and one at an odd offset (element loads), into a float32 and a float64
// sum, against the CPU's float64 accumulation.
TEST(CudaKernels, SumSquaresMultiOverMixedDtypesMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  std::vector<Twin> keep;
  TensorList cpu_xs, gpu_xs;
  uint32_t seed = 1300;
  auto add = [&](const Twin& t) {
    keep.push_back(t);
    cpu_xs.push_back(t.cpu);
    gpu_xs.push_back(t.gpu);
  };
  for (int i = 0; i < 70; ++i) {
    add(random_twin({1 + 53 * i}, kFloat32, ++seed));
    add(random_twin({7 + 31 * i}, kBFloat16, ++seed));
    if (i == 20) add(random_twin({0}, kFloat32, ++seed));
    if (i == 30) add(random_twin({3 * 16384 + 1234}, kFloat32, ++seed));
    if (i == 40) add(view(random_twin({4001}, kFloat32, ++seed), {4000}, {1}, 1));
  }
  for (DType out_dtype : {kFloat32, kFloat64}) {
    Tensor cpu_out = zeros({1}, {out_dtype});
    cpu::sum_squares_multi(cpu_xs, cpu_out);
    Tensor gpu_out = detail::empty_tensor({1}, out_dtype, cuda_device(0));  // written whole
    cuda::sum_squares_multi(gpu_xs, gpu_out);
    // To the host first (the twins' reader has no float64).
    const double want = cpu_out.to(kFloat64).item(), got = gpu_out.to(cpu_device(0)).to(kFloat64).item();
    EXPECT_NEAR(got, want, (out_dtype == kFloat32 ? 1e-5 : 1e-6) * want) << dtype_name(out_dtype);
  }
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
