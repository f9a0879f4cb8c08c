#include "chorus/nn/layers.h"

#include <cmath>
#include <typeinfo>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/nn/init.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"

namespace chorus::nn {

namespace {
std::string cat_repr(std::initializer_list<std::pair<const char*, double>> kv) {
  std::string s;
  for (auto& [k, v] : kv) {
    if (!s.empty()) s += ", ";
    s += std::string(k) + "=" + (v == std::floor(v) ? std::to_string(static_cast<int64_t>(v)) : std::to_string(v));
  }
  return s;
}
}  // namespace

Linear::Linear(LinearOptions o) : Module("Linear"), opts_(o) {
  CHORUS_CHECK(o.in > 0 && o.out > 0, "Linear: in and out features must be positive, got ", o.in, " and ", o.out);
  // PyTorch's default: kaiming_uniform_(a=sqrt(5)) for the weight, U(-1/sqrt(in), 1/sqrt(in)) for the bias.
  Tensor w = empty({o.out, o.in});
  init::kaiming_uniform_(w, std::sqrt(5.0));
  register_parameter("weight", w);
  if (o.bias) {
    Tensor b = empty({o.out});
    double bound = 1.0 / std::sqrt(static_cast<double>(o.in));
    init::uniform_(b, -bound, bound);
    register_parameter("bias", b);
  }
}
Tensor Linear::forward(const Tensor& x) { return functional::linear(on_own_device(x), weight(), bias()); }
std::string Linear::extra_repr() const {
  return cat_repr({{"in", double(opts_.in)}, {"out", double(opts_.out)}}) + (opts_.bias ? "" : ", bias=false");
}

Conv2d::Conv2d(Conv2dOptions o) : Module("Conv2d"), opts_(o) {
  CHORUS_CHECK(o.in > 0 && o.out > 0 && o.kernel > 0 && o.groups > 0 && o.in % o.groups == 0 && o.out % o.groups == 0,
               "Conv2d: bad options (in=", o.in, ", out=", o.out, ", kernel=", o.kernel, ", groups=", o.groups, ")");
  Tensor w = empty({o.out, o.in / o.groups, o.kernel, o.kernel});
  init::kaiming_uniform_(w, std::sqrt(5.0));
  register_parameter("weight", w);
  if (o.bias) {
    Tensor b = empty({o.out});
    double bound = 1.0 / std::sqrt(static_cast<double>(o.in / o.groups * o.kernel * o.kernel));
    init::uniform_(b, -bound, bound);
    register_parameter("bias", b);
  }
}
Tensor Conv2d::forward(const Tensor& x) {
  functional::Conv2dParams p{opts_.stride, opts_.stride, opts_.padding, opts_.padding,
                             opts_.dilation, opts_.dilation, opts_.groups};
  return functional::conv2d(on_own_device(x), weight(), bias(), p);
}
Tensor Conv2d::forward_add(const Tensor& x, const Tensor& residual) {
  functional::Conv2dParams p{opts_.stride, opts_.stride, opts_.padding, opts_.padding,
                             opts_.dilation, opts_.dilation, opts_.groups};
  return functional::conv2d_add(on_own_device(x), weight(), bias(), on_own_device(residual), p);
}
std::pair<Tensor, Tensor> Conv2d::forward_add_unsummed(const Tensor& x, const Tensor& residual) {
  CHORUS_CHECK(!opts_.bias, "Conv2d::forward_add_unsummed: the convolution has a bias");
  functional::Conv2dParams p{opts_.stride, opts_.stride, opts_.padding, opts_.padding,
                             opts_.dilation, opts_.dilation, opts_.groups};
  return functional::conv2d_add_unsummed(on_own_device(x), weight(), on_own_device(residual), p);
}
std::string Conv2d::extra_repr() const {
  return cat_repr({{"in", double(opts_.in)}, {"out", double(opts_.out)}, {"kernel", double(opts_.kernel)},
                   {"stride", double(opts_.stride)}, {"padding", double(opts_.padding)}}) +
         (opts_.bias ? "" : ", bias=false");
}

BatchNorm2d::BatchNorm2d(BatchNorm2dOptions o) : BatchNorm2d(o, "BatchNorm2d") {}
BatchNorm2d::BatchNorm2d(BatchNorm2dOptions o, std::string type_name) : Module(std::move(type_name)), opts_(o) {
  CHORUS_CHECK(o.features > 0, this->type_name(), ": features must be positive, got ", o.features);
  if (o.affine) {
    register_parameter("weight", ones({o.features}));
    register_parameter("bias", zeros({o.features}));
  }
  register_buffer("running_mean", zeros({o.features}));
  register_buffer("running_var", ones({o.features}));
  register_buffer("num_batches_tracked", zeros({}, kInt64));
}
Tensor BatchNorm2d::forward(const Tensor& x) { return run(x, false); }
Tensor BatchNorm2d::forward_relu(const Tensor& x) { return run(x, true); }
struct BatchNorm2d::Step {
  Tensor x, weight, bias, running_mean, running_var, counter;
  double momentum;
};
BatchNorm2d::Step BatchNorm2d::step_for(const Tensor& input) {
  const Tensor x = on_own_device(input);
  CHORUS_CHECK(x.dim() == 4 || x.dim() == 2, "BatchNorm2d: expected [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(x.size(1) == opts_.features, "BatchNorm2d: input has ", x.size(1), " channels, expected ",
               opts_.features);
  auto& bufs = own_buffers();
  // A recomputed forward (activation checkpointing) sees a batch already
  // counted: momentum 0 leaves the running statistics as they are.
  const bool count = is_training() && !recomputing();
  // Counted on the device (reading it on the host would stall an asynchronous
  // step), by the kernel that updates the running statistics.
  return {x,
          opts_.affine ? own_parameters()[0].second : Tensor(),
          opts_.affine ? own_parameters()[1].second : Tensor(),
          bufs[0].second,
          bufs[1].second,
          count ? bufs[2].second : Tensor(),
          count ? opts_.momentum : 0.0};
}
std::pair<Tensor, Tensor> BatchNorm2d::forward_relu_sum(const Tensor& a, const Tensor& b) {
  if (!b.defined()) return {a, forward_relu(a)};
  if (typeid(*this) != typeid(BatchNorm2d)) {  // a subclass's own forward (SyncBatchNorm's)
    const Tensor s = chorus::add(a, b);
    return {s, forward_relu(s)};
  }
  const Step st = step_for(a);
  return functional::batch_norm_relu_sum(st.x, on_own_device(b), st.running_mean, st.running_var, st.weight, st.bias,
                                         is_training(), st.momentum, opts_.eps, st.counter);
}
Tensor BatchNorm2d::run(const Tensor& input, bool relu) {
  const Step st = step_for(input);
  auto f = relu ? functional::batch_norm_relu : functional::batch_norm;
  return f(st.x, st.running_mean, st.running_var, st.weight, st.bias, is_training(), st.momentum, opts_.eps,
           st.counter);
}
std::string BatchNorm2d::extra_repr() const {
  return std::to_string(opts_.features) + ", eps=" + std::to_string(opts_.eps) +
         ", momentum=" + std::to_string(opts_.momentum);
}

Tensor ReLU::forward(const Tensor& x) { return chorus::relu(x); }
Tensor Flatten::forward(const Tensor& x) { return x.flatten(1); }
Tensor Identity::forward(const Tensor& x) { return x; }

Dropout::Dropout(double p) : Module("Dropout"), p_(p) {
  CHORUS_CHECK(p >= 0 && p < 1, "Dropout: probability must be in [0, 1), got ", p);
}
Tensor Dropout::forward(const Tensor& x) { return functional::dropout(x, p_, is_training()); }
std::string Dropout::extra_repr() const { return "p=" + std::to_string(p_); }

namespace {
functional::Pool2dParams pool_params(const Pool2dOptions& o) {
  int64_t s = o.stride > 0 ? o.stride : o.kernel;
  return {o.kernel, o.kernel, s, s, o.padding, o.padding};
}
}  // namespace

MaxPool2d::MaxPool2d(Pool2dOptions o) : Module("MaxPool2d"), opts_(o) {
  CHORUS_CHECK(o.kernel > 0, "MaxPool2d: kernel size must be positive, got ", o.kernel);
}
Tensor MaxPool2d::forward(const Tensor& x) { return functional::max_pool2d(x, pool_params(opts_)); }
std::string MaxPool2d::extra_repr() const {
  return cat_repr({{"kernel", double(opts_.kernel)}, {"stride", double(pool_params(opts_).stride_h)}});
}

AvgPool2d::AvgPool2d(Pool2dOptions o) : Module("AvgPool2d"), opts_(o) {
  CHORUS_CHECK(o.kernel > 0, "AvgPool2d: kernel size must be positive, got ", o.kernel);
}
Tensor AvgPool2d::forward(const Tensor& x) { return functional::avg_pool2d(x, pool_params(opts_)); }
std::string AvgPool2d::extra_repr() const {
  return cat_repr({{"kernel", double(opts_.kernel)}, {"stride", double(pool_params(opts_).stride_h)}});
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(AdaptiveOptions o) : Module("AdaptiveAvgPool2d"), opts_(o) {}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return functional::adaptive_avg_pool2d(x, opts_.out_h, opts_.out_w); }

Sequential::Sequential(std::initializer_list<ModulePtr> mods) : Sequential() {
  for (auto& m : mods) push_back(m);
}
void Sequential::push_back(ModulePtr m) { register_child(std::to_string(named_children().size()), std::move(m)); }
Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& [n, m] : named_children()) h = m->forward(h);
  return h;
}

}  // namespace chorus::nn
