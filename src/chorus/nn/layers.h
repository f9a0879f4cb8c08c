// The standard layers. Each keeps its options (for clone()) and reads its
// parameters through the Module's registry, so replicas and shared parameters
// work without per-layer code (Note [State dict names] in module.h).
#pragma once

#include <initializer_list>

#include "chorus/nn/functional.h"
#include "chorus/nn/module.h"

namespace chorus::nn {

struct LinearOptions {
  int64_t in, out;
  bool bias = true;
};
class Linear : public Module {
 public:
  explicit Linear(LinearOptions o);
  Linear(int64_t in, int64_t out, bool bias = true) : Linear(LinearOptions{in, out, bias}) {}
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return own_parameters()[0].second; }
  Tensor bias() { return opts_.bias ? own_parameters()[1].second : Tensor(); }
  std::string extra_repr() const override;
  LinearOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(Linear)
 private:
  LinearOptions opts_;
};

struct Conv2dOptions {
  int64_t in, out, kernel;
  int64_t stride = 1, padding = 0, dilation = 1, groups = 1;
  bool bias = true;
};
class Conv2d : public Module {
 public:
  explicit Conv2d(Conv2dOptions o);
  Tensor forward(const Tensor& x) override;
  // forward(x) + residual, the add in the convolution's epilogue on a GPU
  // (functional::conv2d_add): a residual block's last convolution.
  Tensor forward_add(const Tensor& x, const Tensor& residual);
  // The same left unsummed where the device finds that cheaper: {sum,
  // undefined} or {forward(x), residual}, for the next batch norm's
  // forward_relu_sum to add (functional::conv2d_add_unsummed). No bias.
  std::pair<Tensor, Tensor> forward_add_unsummed(const Tensor& x, const Tensor& residual);
  Tensor& weight() { return own_parameters()[0].second; }
  Tensor bias() { return opts_.bias ? own_parameters()[1].second : Tensor(); }
  std::string extra_repr() const override;
  Conv2dOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(Conv2d)
 private:
  Conv2dOptions opts_;
};

struct BatchNorm2dOptions {
  int64_t features;
  double eps = 1e-5, momentum = 0.1;
  bool affine = true;
};
// Running statistics are buffers: under DataParallel each replica updates its
// own during forward and the replica on the first device is the one copied
// back (Torch7 DataParallelTable's behaviour); see parallel/data_parallel.h.
// dist::SyncBatchNorm (data_parallel/sync_batch_norm.h) derives from it: code that
// holds a BatchNorm2d (models' fused bn_relu) runs either.
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(BatchNorm2dOptions o);
  explicit BatchNorm2d(int64_t features) : BatchNorm2d(BatchNorm2dOptions{features}) {}
  Tensor forward(const Tensor& x) override;
  // relu(forward(x)) in one fused pass when training (functional::batch_norm_relu).
  Tensor forward_relu(const Tensor& x);
  // {s, forward_relu(s)} for s = a + b (b undefined: s = a), the add done by
  // the statistics pass where it can (functional::batch_norm_relu_sum). A
  // subclass (SyncBatchNorm) adds first and runs its own forward_relu.
  std::pair<Tensor, Tensor> forward_relu_sum(const Tensor& a, const Tensor& b);
  std::string extra_repr() const override;
  BatchNorm2dOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(BatchNorm2d)
 protected:
  BatchNorm2d(BatchNorm2dOptions o, std::string type_name);
  // forward (relu false) and forward_relu (true); a subclass changes both here.
  virtual Tensor run(const Tensor& x, bool relu);
 private:
  struct Step;  // the checked input and what both paths pass the functional ops
  Step step_for(const Tensor& input);
  BatchNorm2dOptions opts_;
};

struct NoOptions {};
#define CHORUS_SIMPLE_LAYER(Name)                                 \
  class Name : public Module {                                    \
   public:                                                        \
    Name() : Module(#Name) {}                                     \
    explicit Name(NoOptions) : Name() {}                          \
    Tensor forward(const Tensor& x) override;                     \
    NoOptions options_for_clone() const { return {}; }            \
    CHORUS_MODULE_CLONEABLE(Name)                                 \
  };
CHORUS_SIMPLE_LAYER(ReLU)
CHORUS_SIMPLE_LAYER(Flatten)
CHORUS_SIMPLE_LAYER(Identity)
#undef CHORUS_SIMPLE_LAYER

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  double options_for_clone() const { return p_; }
  CHORUS_MODULE_CLONEABLE(Dropout)
 private:
  double p_;
};

struct Pool2dOptions {
  int64_t kernel, stride = 0 /* 0: = kernel */, padding = 0;
};
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Pool2dOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  Pool2dOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(MaxPool2d)
 private:
  Pool2dOptions opts_;
};
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Pool2dOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  Pool2dOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(AvgPool2d)
 private:
  Pool2dOptions opts_;
};

struct AdaptiveOptions {
  int64_t out_h = 1, out_w = 1;
};
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(AdaptiveOptions o = {});
  Tensor forward(const Tensor& x) override;
  AdaptiveOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(AdaptiveAvgPool2d)
 private:
  AdaptiveOptions opts_;
};

// Children run in order; named "0", "1", ... as PyTorch's nn.Sequential.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(NoOptions) : Sequential() {}
  Sequential(std::initializer_list<ModulePtr> mods);
  void push_back(ModulePtr m);
  // Under a given name: "features.3" keeps a nested model's state_dict names
  // when its layers are laid out flat for a pipeline; "" adds no prefix.
  void push_back(const std::string& name, ModulePtr m) { register_child(name, std::move(m)); }
  Tensor forward(const Tensor& x) override;
  size_t size() const { return named_children().size(); }
  ModulePtr operator[](size_t i) const { return named_children()[i].second; }
  NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(Sequential)
};

}  // namespace chorus::nn
