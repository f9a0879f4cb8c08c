// Scatter and gather of nested values (parallel/scatter_gather.h), and Note
// [Scatter from where the batch is]: every chunk is copied from the source
// tensor itself to its device -- a host batch never passes through the first
// device -- with results unchanged.
#include <gtest/gtest.h>

#include <chorus/autograd/node.h>
#include <chorus/chorus.h>
#include <chorus/parallel/data_parallel.h>
#include <chorus/parallel/scatter_gather.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "testing/compare.h"

namespace chorus::parallel {
namespace {

using test::rel_err;

// The names of the nodes from t's grad_fn back to a leaf, first edges only.
std::vector<std::string> chain(const Tensor& t) {
  std::vector<std::string> out;
  for (autograd::Node* n = t.grad_fn().get(); n; n = n->next.empty() ? nullptr : n->next[0].fn.get())
    out.push_back(n->name());
  return out;
}

const std::vector<std::string> kDirect = {"ToDeviceBackward", "SliceBackward", "AccumulateGrad"};

TEST(ScatterGather, ChunksAreCopiedFromTheSourceToTheirDevice) {
  manual_seed(3);
  Tensor x = randn({7, 3});  // host memory (cpu:0)
  x.set_requires_grad(true);
  nn::Value in(nn::Value::List{nn::Value(x), nn::Value(nn::Value::Map{{"m", nn::Value(x * 2.0)}})});
  EXPECT_EQ(batch_size(in, 0), 7);
  nn::Value part = scatter(in, 0, 3, 2, cpu_device(2));
  const Tensor& c = part.list()[0].tensor();
  EXPECT_EQ(c.device(), cpu_device(2));
  EXPECT_EQ(c.to_vector<float>(), x.narrow(0, 3, 2).contiguous().to_vector<float>());
  EXPECT_EQ(chain(c), kDirect) << "one copy, straight from the source";
  EXPECT_EQ(part.list()[1].map().at("m").tensor().device(), cpu_device(2));
  // Gather concatenates on the output device, and scalars become a vector.
  std::vector<nn::Value> outs = {nn::Value(randn({2, 3}, {kFloat32, cpu_device(1)})),
                                 nn::Value(randn({1, 3}, {kFloat32, cpu_device(2)}))};
  Tensor g = gather(outs, 0, cpu_device(0)).tensor();
  EXPECT_EQ(g.device(), cpu_device(0));
  EXPECT_EQ(g.sizes(), (Shape{3, 3}));
  EXPECT_EQ(gather({nn::Value(randn({})), nn::Value(randn({}))}, 0, cpu_device(0)).tensor().sizes(), Shape{2});
}

// Records each replica's input as it arrives.
std::mutex g_mu;
std::map<Device, Tensor> g_inputs;

class Probe : public nn::Module {
 public:
  explicit Probe(nn::NoOptions = {}) : Module("Probe") { lin_ = register_module("lin", std::make_shared<nn::Linear>(3, 2)); }
  Tensor forward(const Tensor& x) override {
    {
      std::lock_guard<std::mutex> lk(g_mu);
      g_inputs[x.device()] = x;
    }
    return lin_->forward(x);
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(Probe)
 private:
  std::shared_ptr<nn::Linear> lin_;
};

// A batch in host memory reaches every replica (none of them on the host's
// cpu:0 here) in one copy from the batch itself, and the output equals the
// plain module's.
TEST(ScatterGather, DataParallelScattersAHostBatchStraightToEachDevice) {
  manual_seed(4);
  auto net = std::make_shared<Probe>();
  net->to(cpu_device(1));
  manual_seed(5);
  Tensor x = randn({5, 3});
  x.set_requires_grad(true);
  Tensor ref = net->forward(x.detach().to(cpu_device(1)));
  DataParallel dp(net, {cpu_device(1), cpu_device(2), cpu_device(3)});
  g_inputs.clear();
  Tensor y = dp.forward(x);
  ASSERT_EQ(g_inputs.size(), 3u);
  for (const auto& [d, in] : g_inputs) EXPECT_EQ(chain(in), kDirect) << d.str();
  EXPECT_EQ(y.device(), cpu_device(1));
  EXPECT_LE(rel_err(y, ref), 1e-6);
  y.sum().backward();
  Tensor x2 = x.detach().clone();
  x2.set_requires_grad(true);
  net->forward(x2.to(cpu_device(1))).sum().backward();
  EXPECT_LE(rel_err(x.grad(), x2.grad()), 1e-6);
}

}  // namespace
}  // namespace chorus::parallel
