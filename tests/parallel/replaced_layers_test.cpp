// Models whose layers were replaced after construction, cloned and run by
// DataParallel (Note [Clones copy the tree] in nn/module.cpp): every model of
// the zoo with its batch norms made SyncBatchNorm and a ReLU (or, in a Wide
// ResNet that has no ReLU module, a residual block) made an Identity. A clone
// must have the tree as it is, and DataParallel over cpu:0 and cpu:1 must
// compute what one device computes, in float64 to rounding.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/sync_batch_norm.h>
#include <chorus/models/models.h>
#include <chorus/parallel/data_parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

#include "testing/devices.h"

namespace chorus::parallel::replaced_layers_test {
namespace {

namespace F = nn::functional;
using nn::ModulePtr;

// Small inputs: float64 on the CPU, and wrn-28-10 has 36M parameters (the
// Wide ResNets pool globally, so 2x2 images go through every block).
models::ModelSpec spec_of(const std::string& name) {
  return name.rfind("wrn-", 0) == 0 ? models::ModelSpec{{3, 2, 2}, 5} : models::ModelSpec{{3, 4, 4}, 5};
}
constexpr int64_t kBatch = 4;

// max |a - b| / max |b|, in double.
double rel_err64(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  const std::vector<double> va = a.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
  const std::vector<double> vb = b.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / std::max(scale, 1e-300);
}

// Replaces the first child (depth first) for which `pick` holds with `make()`;
// false when there is none.
bool replace_first(const ModulePtr& root, const std::function<bool(const nn::Module&)>& pick,
                   const std::function<ModulePtr()>& make) {
  for (const ModulePtr& m : root->modules())
    for (auto& [name, child] : m->own_children())
      if (pick(*child)) {
        child = make();
        return true;
      }
  return false;
}

// The model by name, built from a fixed seed, with its batch norms made
// SyncBatchNorm (no process group: the replicas' batches make the batch) and
// one ReLU, or one shape-keeping residual block, made an Identity; float64.
// `what` says which layers were replaced.
ModulePtr replaced_model(const std::string& name, std::string* what) {
  manual_seed(4242);
  ModulePtr model = models::make_model(name, spec_of(name));
  int bns = 0;
  for (const ModulePtr& m : model->modules()) bns += dynamic_cast<nn::BatchNorm2d*>(m.get()) != nullptr;
  model = dist::convert_sync_batchnorm(model);
  *what = std::to_string(bns) + " BatchNorm2d -> SyncBatchNorm";
  auto identity = [] { return std::make_shared<nn::Identity>(); };
  if (replace_first(model, [](const nn::Module& m) { return typeid(m) == typeid(nn::ReLU); }, identity)) {
    *what += ", a ReLU -> Identity";
  } else {
    auto keeps_shape = [](const nn::Module& m) {
      auto* b = dynamic_cast<const models::PreActBlock*>(&m);
      return b && b->options_for_clone().in == b->options_for_clone().out && b->options_for_clone().stride == 1;
    };
    EXPECT_TRUE(replace_first(model, keeps_shape, identity)) << name << ": no layer to replace";
    *what += ", a PreActBlock -> Identity";
  }
  model->to(kFloat64);
  return model;
}

std::vector<std::string> type_names(const ModulePtr& m) {
  std::vector<std::string> out;
  for (const ModulePtr& s : m->modules()) out.push_back(typeid(*s.get()).name());
  return out;
}

TEST(ModuleClone, CopiesEveryBuiltInModelWithItsReplacedLayers) {
  for (const std::string& name : models::model_names()) {
    std::string what;
    ModulePtr model = replaced_model(name, &what);
    SCOPED_TRACE(name + " (" + what + ")");
    ModulePtr copy = model->clone(cpu_device(1));
    EXPECT_EQ(type_names(copy), type_names(model));
    EXPECT_EQ(copy->str(), model->str());
    const nn::NamedTensors a = model->state_dict(), b = copy->state_dict();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_EQ(b[i].second.device(), cpu_device(1)) << a[i].first;
      EXPECT_EQ(rel_err64(b[i].second, a[i].second), 0.0) << a[i].first;
    }
    // The same function: in eval mode, bit for bit.
    model->eval();
    copy->eval();
    manual_seed(7);
    const models::ModelSpec spec = spec_of(name);
    Tensor x = randn({2, spec.input[0], spec.input[1], spec.input[2]}).to(kFloat64);
    NoGradGuard ng;
    EXPECT_EQ(rel_err64(copy->forward(x.to(cpu_device(1))), model->forward(x)), 0.0);
  }
}

// One training forward and backward: the loss, every parameter's gradient,
// the input's gradient and the running statistics.
struct Step {
  std::vector<std::pair<std::string, Tensor>> values;
};
Step run_step(const ModulePtr& model, const Tensor& x0, const Tensor& y) {
  Tensor x = x0.clone().set_requires_grad(true);
  model->zero_grad();
  Tensor loss = F::cross_entropy(model->forward(x), y);
  loss.backward();
  Step s;
  s.values.emplace_back("loss", loss.detach());
  s.values.emplace_back("input gradient", x.grad());
  for (const auto& [n, p] : model->named_parameters()) s.values.emplace_back(n + " gradient", p.grad().clone());
  for (const auto& [n, b] : model->named_buffers()) s.values.emplace_back(n, b.clone());
  return s;
}

TEST(DataParallelReplacedLayers, EveryBuiltInModelMatchesOneDeviceInFloat64) {
  for (const std::string& name : models::model_names()) {
    std::string what;
    ModulePtr one = replaced_model(name, &what);
    SCOPED_TRACE(name + " (" + what + ")");
    manual_seed(11);
    const models::ModelSpec spec = spec_of(name);
    Tensor x = randn({kBatch, spec.input[0], spec.input[1], spec.input[2]}).to(kFloat64);
    Tensor y = randint(0, spec.classes, {kBatch});
    const Step ref = run_step(one, x, y);

    ModulePtr dp = std::make_shared<DataParallel>(replaced_model(name, &what), test::cpus(2));
    EXPECT_EQ(type_names(std::static_pointer_cast<DataParallel>(dp)->replica(1)),
              type_names(std::static_pointer_cast<DataParallel>(dp)->replica(0)));
    const Step got = run_step(dp, x, y);
    ASSERT_EQ(got.values.size(), ref.values.size());
    double worst = 0;
    for (size_t i = 0; i < ref.values.size(); ++i) {
      ASSERT_EQ(got.values[i].first, ref.values[i].first);
      const double e = rel_err64(got.values[i].second, ref.values[i].second);
      EXPECT_LE(e, 1e-11) << ref.values[i].first;
      worst = std::max(worst, e);
    }
    std::printf("%s (%s): DataParallel over cpu:0,cpu:1 vs one device, float64: max relative error %.2e\n",
                name.c_str(), what.c_str(), worst);
  }
}

}  // namespace
}  // namespace chorus::parallel::replaced_layers_test
