// The model zoo: MLP, a small CNN for Fashion-MNIST, ResNet-20 and Wide ResNet
// (pre-activation blocks, as ../shared/bench/torch_baseline.py, with the same
// parameter names so weights move between Chorus and PyTorch).
#pragma once

#include <string>
#include <vector>

#include "chorus/nn/layers.h"

namespace chorus::models {

struct ModelSpec {
  Shape input;          // [C, H, W]
  int64_t classes = 10;
};

// MLP: flatten, hidden layers with ReLU, linear classifier.
struct MLPOptions {
  ModelSpec spec;
  std::vector<int64_t> hidden{256, 128};
};
class MLP : public nn::Module {
 public:
  explicit MLP(MLPOptions o);
  Tensor forward(const Tensor& x) override;
  MLPOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(MLP)
 private:
  MLPOptions opts_;
};

// Small CNN: two conv-BN-ReLU-maxpool stages (32, 64 channels), then
// linear(128) - ReLU - linear(classes). About 420k parameters for 28x28 input.
class SmallCNN : public nn::Module {
 public:
  explicit SmallCNN(ModelSpec spec);
  Tensor forward(const Tensor& x) override;
  ModelSpec options_for_clone() const { return spec_; }
  CHORUS_MODULE_CLONEABLE(SmallCNN)
 private:
  ModelSpec spec_;
};

// Pre-activation block: bn1-relu-conv1-bn2-relu-conv2, plus identity or a 1x1
// conv shortcut taken from the activated input (as torch_baseline.py).
struct PreActBlockOptions {
  int64_t in, out, stride;
};
class PreActBlock : public nn::Module {
 public:
  explicit PreActBlock(PreActBlockOptions o);
  Tensor forward(const Tensor& x) override;
  // forward(a + b) left unsummed: the block's input as two addends (b may be
  // undefined), its output as conv2's result and the shortcut, or the sum
  // and undefined (Note [Residual add left to the batch norm] in ops/nn.h).
  // WideResNet chains its blocks this way; forward() is the summed form.
  std::pair<Tensor, Tensor> forward_unsummed(const Tensor& a, const Tensor& b);
  PreActBlockOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(PreActBlock)
 private:
  PreActBlockOptions opts_;
};

// Wide ResNet (Zagoruyko & Komodakis): depth = 6n + 4, widths 16, 16k, 32k, 64k.
struct WideResNetOptions {
  int64_t depth = 28, width = 10;
  ModelSpec spec{{3, 32, 32}, 10};
};
class WideResNet : public nn::Module {
 public:
  explicit WideResNet(WideResNetOptions o);
  Tensor forward(const Tensor& x) override;
  WideResNetOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(WideResNet)
 private:
  WideResNetOptions opts_;
};

// ResNet-20 for CIFAR (He et al. 2016): 3 stages x 3 basic blocks (16, 32, 64),
// conv-BN-ReLU, 1x1 conv + BN shortcuts where the shape changes.
class BasicBlock : public nn::Module {
 public:
  explicit BasicBlock(PreActBlockOptions o);
  Tensor forward(const Tensor& x) override;
  PreActBlockOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(BasicBlock)
 private:
  PreActBlockOptions opts_;
};
class ResNet20 : public nn::Module {
 public:
  explicit ResNet20(ModelSpec spec);
  Tensor forward(const Tensor& x) override;
  ModelSpec options_for_clone() const { return spec_; }
  CHORUS_MODULE_CLONEABLE(ResNet20)
 private:
  ModelSpec spec_;
};

// The head of a pooled network laid out flat: [bn-relu] - global average pool
// - flatten - fc, holding the model's own `bn` and `fc` layers under their
// names (WideResNet, ResNet20).
struct PooledHeadOptions {
  int64_t bn_features = 0;  // 0: no batch norm before the pool (ResNet20)
  int64_t in = 0, classes = 10;
};
class PooledHead : public nn::Module {
 public:
  explicit PooledHead(PooledHeadOptions o);
  PooledHead(nn::ModulePtr bn, nn::ModulePtr fc, PooledHeadOptions o);
  Tensor forward(const Tensor& x) override;
  PooledHeadOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(PooledHead)
 private:
  PooledHeadOptions opts_;
};

// The model as a flat Sequential of its layers, for a pipeline to split: the
// same layer objects (the same tensors), registered under names that keep the
// model's state_dict names ("features.3.conv1.weight", "fc.weight"), and the
// same forward. A Sequential is returned as it is. ValueError for a model
// that cannot be laid out flat (naming its type).
std::shared_ptr<nn::Sequential> as_sequential(const nn::ModulePtr& model);

// The residual blocks of a ResNet20 or WideResNet (their PreActBlock and
// BasicBlock layers, in order); empty for any other model. A sharded run's
// stage-3 units (Note [Sharded units]): the automatic search finds none in
// a `features` list that mixes a stem convolution with the blocks.
std::vector<nn::ModulePtr> residual_blocks(const nn::ModulePtr& model);

// Builds a model by its command-line name: mlp, cnn, resnet20, wrn-16-4,
// wrn-28-10 (any wrn-D-K). Throws ValueError naming the known models.
nn::ModulePtr make_model(const std::string& name, const ModelSpec& spec);
std::vector<std::string> model_names();

}  // namespace chorus::models
