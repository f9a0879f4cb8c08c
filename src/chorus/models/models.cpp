#include "chorus/models/models.h"

#include "chorus/autograd/functions.h"
#include "chorus/core/error.h"
#include "chorus/nn/init.h"

namespace chorus::models {

using nn::Conv2dOptions;
using nn::Module;
using nn::ModulePtr;

namespace {
ModulePtr child(const Module& m, size_t i) { return m.named_children()[i].second; }
std::shared_ptr<nn::Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<nn::Conv2d>(Conv2dOptions{in, out, 3, stride, 1, 1, 1, false});
}
std::shared_ptr<nn::Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<nn::Conv2d>(Conv2dOptions{in, out, 1, stride, 0, 1, 1, false});
}
void check_spec(const ModelSpec& s, const char* model) {
  CHORUS_CHECK(s.input.size() == 3 && s.input[0] > 0 && s.input[1] > 0 && s.input[2] > 0, model,
               ": input shape must be [C, H, W], got ", shape_str(s.input));
  CHORUS_CHECK(s.classes > 1, model, ": needs at least 2 classes, got ", s.classes);
}
// relu(bn(x)) as one fused op (BatchNorm2d::forward_relu): same numbers, one
// pass over the activations instead of two, forward and backward.
Tensor bn_relu(const nn::ModulePtr& bn, const Tensor& x) {
  return std::static_pointer_cast<nn::BatchNorm2d>(bn)->forward_relu(x);
}
}  // namespace

MLP::MLP(MLPOptions o) : Module("MLP"), opts_(o) {
  check_spec(o.spec, "MLP");
  auto body = std::make_shared<nn::Sequential>();
  body->push_back(std::make_shared<nn::Flatten>());
  int64_t in = numel_of(o.spec.input);
  for (int64_t h : o.hidden) {
    body->push_back(std::make_shared<nn::Linear>(in, h));
    body->push_back(std::make_shared<nn::ReLU>());
    in = h;
  }
  body->push_back(std::make_shared<nn::Linear>(in, o.spec.classes));
  register_module("layers", body);
}
Tensor MLP::forward(const Tensor& x) { return child(*this, 0)->forward(x); }

SmallCNN::SmallCNN(ModelSpec spec) : Module("SmallCNN"), spec_(spec) {
  check_spec(spec, "SmallCNN");
  CHORUS_CHECK(spec.input[1] >= 4 && spec.input[2] >= 4, "SmallCNN: input must be at least 4x4, got ",
               shape_str(spec.input));
  const int64_t c = spec.input[0];
  auto features = std::make_shared<nn::Sequential>(std::initializer_list<ModulePtr>{
      std::make_shared<nn::Conv2d>(Conv2dOptions{c, 32, 3, 1, 1, 1, 1, false}),
      std::make_shared<nn::BatchNorm2d>(32), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}),
      std::make_shared<nn::Conv2d>(Conv2dOptions{32, 64, 3, 1, 1, 1, 1, false}),
      std::make_shared<nn::BatchNorm2d>(64), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2})});
  const int64_t flat = 64 * (spec.input[1] / 4) * (spec.input[2] / 4);
  auto classifier = std::make_shared<nn::Sequential>(std::initializer_list<ModulePtr>{
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(flat, 128), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(128, spec.classes)});
  register_module("features", features);
  register_module("classifier", classifier);
}
Tensor SmallCNN::forward(const Tensor& x) { return child(*this, 1)->forward(child(*this, 0)->forward(x)); }

PreActBlock::PreActBlock(PreActBlockOptions o) : Module("PreActBlock"), opts_(o) {
  register_module("bn1", std::make_shared<nn::BatchNorm2d>(o.in));
  register_module("conv1", conv3x3(o.in, o.out, o.stride));
  register_module("bn2", std::make_shared<nn::BatchNorm2d>(o.out));
  register_module("conv2", conv3x3(o.out, o.out, 1));
  if (o.in != o.out || o.stride != 1) register_module("short", conv1x1(o.in, o.out, o.stride));
}
Tensor PreActBlock::forward(const Tensor& x) {
  Tensor o = bn_relu(child(*this, 0), x);
  Tensor y = child(*this, 1)->forward(o);
  Tensor shortcut = named_children().size() > 4 ? child(*this, 4)->forward(o) : x;
  // conv2(relu(bn2(y))) + shortcut, the add in conv2's epilogue on a GPU.
  return std::static_pointer_cast<nn::Conv2d>(child(*this, 3))->forward_add(bn_relu(child(*this, 2), y), shortcut);
}

std::pair<Tensor, Tensor> PreActBlock::forward_unsummed(const Tensor& a, const Tensor& b) {
  auto [x, o] = std::static_pointer_cast<nn::BatchNorm2d>(child(*this, 0))->forward_relu_sum(a, b);
  Tensor y = child(*this, 1)->forward(o);
  Tensor shortcut = named_children().size() > 4 ? child(*this, 4)->forward(o) : x;
  return std::static_pointer_cast<nn::Conv2d>(child(*this, 3))->forward_add_unsummed(bn_relu(child(*this, 2), y),
                                                                                    shortcut);
}

WideResNet::WideResNet(WideResNetOptions o) : Module("WideResNet"), opts_(o) {
  check_spec(o.spec, "WideResNet");
  CHORUS_CHECK(o.depth >= 10 && (o.depth - 4) % 6 == 0, "WideResNet: depth must be 6n+4 (e.g. 16, 28), got ", o.depth);
  CHORUS_CHECK(o.width >= 1, "WideResNet: width must be positive, got ", o.width);
  const int64_t n = (o.depth - 4) / 6;
  const int64_t w[4] = {16, 16 * o.width, 32 * o.width, 64 * o.width};
  auto features = std::make_shared<nn::Sequential>();
  features->push_back(conv3x3(o.spec.input[0], w[0], 1));
  int64_t cin = w[0];
  const int64_t strides[3] = {1, 2, 2};
  for (int g = 1; g <= 3; ++g) {
    for (int64_t i = 0; i < n; ++i) {
      features->push_back(std::make_shared<PreActBlock>(PreActBlockOptions{cin, w[g], i == 0 ? strides[g - 1] : 1}));
      cin = w[g];
    }
  }
  register_module("features", features);
  register_module("bn", std::make_shared<nn::BatchNorm2d>(cin));
  register_module("fc", std::make_shared<nn::Linear>(cin, o.spec.classes));
}
Tensor WideResNet::forward(const Tensor& x) {
  // The blocks pass their outputs on unsummed, each add done by the next
  // batch norm where that is cheaper (Note [Residual add left to the batch
  // norm] in ops/nn.h); as_sequential's layers sum them as they go.
  const auto& layers = child(*this, 0)->named_children();
  Tensor a = layers[0].second->forward(x), b;
  for (size_t i = 1; i < layers.size(); ++i) {
    if (auto block = std::dynamic_pointer_cast<PreActBlock>(layers[i].second)) {
      std::tie(a, b) = block->forward_unsummed(a, b);
    } else {  // a layer put in place of a block: it takes the sum
      a = layers[i].second->forward(b.defined() ? chorus::add(a, b) : a);
      b = Tensor();
    }
  }
  Tensor h = std::static_pointer_cast<nn::BatchNorm2d>(child(*this, 1))->forward_relu_sum(a, b).second;
  h = nn::functional::adaptive_avg_pool2d(h, 1, 1).flatten(1);
  return child(*this, 2)->forward(h);
}

BasicBlock::BasicBlock(PreActBlockOptions o) : Module("BasicBlock"), opts_(o) {
  register_module("conv1", conv3x3(o.in, o.out, o.stride));
  register_module("bn1", std::make_shared<nn::BatchNorm2d>(o.out));
  register_module("conv2", conv3x3(o.out, o.out, 1));
  register_module("bn2", std::make_shared<nn::BatchNorm2d>(o.out));
  if (o.in != o.out || o.stride != 1) {
    register_module("shortcut", std::make_shared<nn::Sequential>(std::initializer_list<ModulePtr>{
                                    conv1x1(o.in, o.out, o.stride), std::make_shared<nn::BatchNorm2d>(o.out)}));
  }
}
Tensor BasicBlock::forward(const Tensor& x) {
  Tensor y = bn_relu(child(*this, 1), child(*this, 0)->forward(x));
  y = child(*this, 3)->forward(child(*this, 2)->forward(y));
  Tensor s = named_children().size() > 4 ? child(*this, 4)->forward(x) : x;
  return chorus::relu(chorus::add(y, s));
}

ResNet20::ResNet20(ModelSpec spec) : Module("ResNet20"), spec_(spec) {
  check_spec(spec, "ResNet20");
  auto features = std::make_shared<nn::Sequential>();
  features->push_back(conv3x3(spec.input[0], 16, 1));
  features->push_back(std::make_shared<nn::BatchNorm2d>(16));
  features->push_back(std::make_shared<nn::ReLU>());
  int64_t cin = 16;
  const int64_t widths[3] = {16, 32, 64};
  for (int g = 0; g < 3; ++g)
    for (int i = 0; i < 3; ++i) {
      features->push_back(std::make_shared<BasicBlock>(PreActBlockOptions{cin, widths[g], (g > 0 && i == 0) ? 2 : 1}));
      cin = widths[g];
    }
  register_module("features", features);
  register_module("fc", std::make_shared<nn::Linear>(64, spec.classes));
}
Tensor ResNet20::forward(const Tensor& x) {
  Tensor h = child(*this, 0)->forward(x);
  h = nn::functional::adaptive_avg_pool2d(h, 1, 1).flatten(1);
  return child(*this, 1)->forward(h);
}

PooledHead::PooledHead(PooledHeadOptions o)
    : PooledHead(o.bn_features > 0 ? std::make_shared<nn::BatchNorm2d>(o.bn_features) : nullptr,
                 std::make_shared<nn::Linear>(o.in, o.classes), o) {}
PooledHead::PooledHead(nn::ModulePtr bn, nn::ModulePtr fc, PooledHeadOptions o)
    : Module("PooledHead"), opts_(o) {
  if (bn) register_module("bn", bn);
  register_module("fc", fc);
}
Tensor PooledHead::forward(const Tensor& x) {
  const bool has_bn = named_children().size() > 1;
  Tensor h = has_bn ? bn_relu(child(*this, 0), x) : x;
  h = nn::functional::adaptive_avg_pool2d(h, 1, 1).flatten(1);
  return child(*this, has_bn ? 1 : 0)->forward(h);
}

namespace {
// Every child of `seq` under "prefix.i".
void append_layers(nn::Sequential& out, const std::string& prefix, const Module& seq) {
  for (const auto& [name, layer] : seq.named_children()) out.push_back(prefix + "." + name, layer);
}
int64_t linear_in(const ModulePtr& fc) { return fc->named_parameters()[0].second.size(1); }
}  // namespace

std::vector<ModulePtr> residual_blocks(const ModulePtr& model) {
  std::vector<ModulePtr> out;
  if (!dynamic_cast<WideResNet*>(model.get()) && !dynamic_cast<ResNet20*>(model.get())) return out;
  for (const auto& [name, layer] : child(*model, 0)->named_children())
    if (dynamic_cast<PreActBlock*>(layer.get()) || dynamic_cast<BasicBlock*>(layer.get())) out.push_back(layer);
  return out;
}

std::shared_ptr<nn::Sequential> as_sequential(const ModulePtr& model) {
  CHORUS_CHECK(model != nullptr, "as_sequential: the model is null");
  if (auto seq = std::dynamic_pointer_cast<nn::Sequential>(model)) return seq;
  auto out = std::make_shared<nn::Sequential>();
  out->train(model->is_training());
  const auto& kids = model->named_children();
  if (dynamic_cast<MLP*>(model.get())) {
    append_layers(*out, "layers", *kids[0].second);
  } else if (dynamic_cast<SmallCNN*>(model.get())) {
    append_layers(*out, "features", *kids[0].second);
    append_layers(*out, "classifier", *kids[1].second);
  } else if (auto* wrn = dynamic_cast<WideResNet*>(model.get())) {
    append_layers(*out, "features", *kids[0].second);
    const ModulePtr& fc = kids[2].second;
    out->push_back("", std::make_shared<PooledHead>(
                           kids[1].second, fc, PooledHeadOptions{kids[1].second->named_parameters()[0].second.size(0),
                                                                 linear_in(fc), wrn->options_for_clone().spec.classes}));
  } else if (auto* r = dynamic_cast<ResNet20*>(model.get())) {
    append_layers(*out, "features", *kids[0].second);
    const ModulePtr& fc = kids[1].second;
    out->push_back("", std::make_shared<PooledHead>(nullptr, fc,
                                                    PooledHeadOptions{0, linear_in(fc), r->options_for_clone().classes}));
  } else {
    CHORUS_THROW(ValueError, "as_sequential: cannot lay out a ", model->type_name(),
                 " as a sequence of layers (pass an nn::Sequential, or a model of the zoo)");
  }
  return out;
}

std::vector<std::string> model_names() { return {"mlp", "cnn", "resnet20", "wrn-16-4", "wrn-28-10"}; }

ModulePtr make_model(const std::string& name, const ModelSpec& spec) {
  if (name == "mlp") return std::make_shared<MLP>(MLPOptions{spec});
  if (name == "cnn") return std::make_shared<SmallCNN>(spec);
  if (name == "resnet20") return std::make_shared<ResNet20>(spec);
  if (name.rfind("wrn-", 0) == 0) {
    int depth = 0, width = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "wrn-%d-%d%c", &depth, &width, &tail) == 2)
      return std::make_shared<WideResNet>(WideResNetOptions{depth, width, spec});
  }
  CHORUS_THROW(ValueError, "unknown model '", name, "' (expected mlp, cnn, resnet20, wrn-16-4, wrn-28-10 or wrn-D-K)");
}

}  // namespace chorus::models
