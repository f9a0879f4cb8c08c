// Note [Autocast weight copies]: under bf16 autocast a parameter keeps its
// 16-bit copy between steps and SGD writes it with the update. Checked on a
// Wide ResNet (channels-last, as chorus train runs it on a GPU): the copies
// are kept and each equals the parameter cast afresh after every step; five
// steps give bit-identical weights to the same steps with every copy made
// stale (cast afresh each forward, the behaviour before copies); a parameter
// changed in place (load_state_dict) is cast again, not read stale, and no
// copy is taken for a parameter moved to another device; AdamW writes
// them too, and equally matches casting afresh. The
// convolutions are deterministic here (cuda::set_deterministic), so "the
// same" means bit for bit.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <vector>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/ops/copy.h>

#include "testing/deterministic.h"

namespace chorus {
namespace {


nn::ModulePtr copy_test_wrn() {
  manual_seed(31);
  nn::ModulePtr m = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  m->to(cuda_device(0));
  m->to_channels_last();
  return m;
}

std::vector<float> copy_test_floats(const Tensor& t) { return t.to(kFloat32).to(cpu_device(0)).to_vector<float>(); }

// Five SGD steps under bf16 autocast; `stale` makes every kept copy out of
// date before each forward (a version bump), so every weight is cast afresh.
std::vector<std::vector<float>> train_five(nn::Module& m, optim::Optimizer& opt, bool stale, bool check_copies) {
  manual_seed(32);
  const Tensor x = ops::to_channels_last(randn({8, 3, 16, 16}).to(cuda_device(0)));
  const Tensor y = randint(0, 10, {8}).to(cuda_device(0));
  for (int step = 0; step < 5; ++step) {
    if (stale)
      for (const Tensor& p : m.parameters()) p.bump_version();
    Tensor loss;
    {
      AutocastGuard amp(kBFloat16);
      loss = nn::functional::cross_entropy(m.forward(x), y);
    }
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (!check_copies) continue;
    int kept = 0;
    for (const Tensor& p : m.parameters()) {
      const Tensor c = autocast_copy_for_update(p);
      if (!c.defined()) continue;
      ++kept;
      EXPECT_EQ(copy_test_floats(c), copy_test_floats(p.to(kBFloat16))) << "step " << step << ": a kept copy is not the parameter cast";
    }
    EXPECT_GT(kept, 0) << "step " << step << ": no parameter kept a copy";
  }
  std::vector<std::vector<float>> out;
  for (const Tensor& p : m.parameters()) out.push_back(copy_test_floats(p));
  return out;
}

TEST(AutocastCopies, SgdWritesThemAndTheyMatchCastingAfresh_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  nn::ModulePtr a = copy_test_wrn(), b = copy_test_wrn();
  optim::SGD oa(a->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  optim::SGD ob(b->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  const auto kept = train_five(*a, oa, false, true), fresh = train_five(*b, ob, true, false);
  ASSERT_EQ(kept.size(), fresh.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i], fresh[i]) << "parameter " << i;
  EXPECT_GT(autocast_copies_kept(), 0u);
}

TEST(AutocastCopies, AParameterChangedInPlaceIsCastAgain_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  nn::ModulePtr m = copy_test_wrn();
  optim::SGD opt(m->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_five(*m, opt, false, false);
  // Load other weights in place (a checkpoint): the copies are now stale.
  nn::ModulePtr other = copy_test_wrn();
  for (const Tensor& p : other->parameters()) ops::copy_(p, randn(p.sizes()).to(cuda_device(0)).to(p.dtype()));
  m->load_state_dict(other->state_dict());
  for (const Tensor& p : m->parameters()) EXPECT_FALSE(autocast_copy_for_update(p).defined());
  // A move keeps the version (the values are the same) but not the device: no
  // copy is current on the CPU; back on the GPU, the copies mirror the
  // parameters again.
  train_five(*m, opt, false, false);
  m->to(cpu_device(0));
  for (const Tensor& p : m->parameters()) EXPECT_FALSE(autocast_copy_for_update(p).defined());
  m->to(cuda_device(0));
  m->to_channels_last();
  for (const Tensor& p : m->parameters()) {
    const Tensor c = autocast_copy_for_update(p);
    if (c.defined()) EXPECT_EQ(copy_test_floats(c), copy_test_floats(p.to(kBFloat16)));
  }
  m->load_state_dict(other->state_dict());
  manual_seed(33);
  const Tensor x = ops::to_channels_last(randn({4, 3, 16, 16}).to(cuda_device(0)));
  m->eval();
  other->eval();
  AutocastGuard amp(kBFloat16);
  EXPECT_EQ(copy_test_floats(m->forward(x)), copy_test_floats(other->forward(x)));
}

TEST(AutocastCopies, AdamWWritesThemAndTheyMatchCastingAfresh_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  nn::ModulePtr a = copy_test_wrn(), b = copy_test_wrn();
  optim::AdamW oa(a->parameters(), {.lr = 1e-3});
  optim::AdamW ob(b->parameters(), {.lr = 1e-3});
  const auto kept = train_five(*a, oa, false, true), fresh = train_five(*b, ob, true, false);
  ASSERT_EQ(kept.size(), fresh.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i], fresh[i]) << "parameter " << i;
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
