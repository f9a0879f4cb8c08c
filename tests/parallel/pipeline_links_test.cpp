// parallel::make_pipeline_links and Note [Pipeline links at exit]: NCCL
// tears a communicator down with its peers, so both ends of every link must
// release the links in one order, whatever role (sender, receiver) each end
// holds. Checked with groups that log their destruction (the order itself)
// and with two real Gloo ranks on threads (the links each rank creates).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/distributed/hash_store.h"
#include "chorus/distributed/process_group.h"
#include "chorus/parallel/pipeline_links.h"

namespace chorus::parallel {
namespace {

// A group that records its name when destroyed; it never communicates.
class TeardownLoggedGroup final : public dist::ProcessGroup {
 public:
  TeardownLoggedGroup(std::string name, std::vector<std::string>* log)
      : ProcessGroup(0, 2, std::make_shared<dist::HashStore>(), {}), name_(std::move(name)), log_(log) {}
  ~TeardownLoggedGroup() override { log_->push_back(name_); }
  std::string backend() const override { return "logged"; }
  Device device() const override { return cpu_device(0); }
  dist::WorkPtr all_reduce(const Tensor&, dist::ReduceOp) override { return unused(); }
  dist::WorkPtr broadcast(const Tensor&, int) override { return unused(); }
  dist::WorkPtr all_gather(const Tensor&, const Tensor&) override { return unused(); }
  dist::WorkPtr reduce_scatter(const Tensor&, const Tensor&, dist::ReduceOp) override { return unused(); }
  dist::WorkPtr barrier() override { return unused(); }
  dist::WorkPtr send(const Tensor&, int, int) override { return unused(); }
  dist::WorkPtr recv(const Tensor&, int, int) override { return unused(); }

 private:
  static dist::WorkPtr unused() { CHORUS_THROW(ValueError, "TeardownLoggedGroup does not communicate"); }
  std::string name_;
  std::vector<std::string>* log_;
};

// The links of a pp=2 interleaved pipeline (a ring) as rank `me` holds them:
// created in make_pipeline_links's order (activations 0->1, 1->0, gradients
// 0->1, 1->0), each named by that order.
std::vector<std::string> teardown_order_of_rank(int me) {
  std::vector<std::string> log;
  {
    PipelineLinks links;
    const int from[4] = {0, 1, 0, 1};
    for (int k = 0; k < 4; ++k) {
      auto g = std::make_shared<TeardownLoggedGroup>("link" + std::to_string(k), &log);
      links.created.push_back(g);
      const size_t dir = static_cast<size_t>(k / 2);
      (from[k] == me ? links.out : links.in)[dir] = g;
    }
  }
  return log;
}

TEST(PipelineLinks, BothEndsReleaseTheLinksInOneOrder) {
  // Before the fix rank 0 destroyed link3, link1, link2, link0 (in before
  // out, [1] before [0]) and rank 1 link2, link0, link3, link1: over NCCL
  // each waited in ncclCommFinalize for the other.
  const std::vector<std::string> newest_first = {"link3", "link2", "link1", "link0"};
  EXPECT_EQ(teardown_order_of_rank(0), newest_first);
  EXPECT_EQ(teardown_order_of_rank(1), newest_first);
}

TEST(PipelineLinks, MovedLinksAreReleasedOnceAndInOrder) {
  std::vector<std::string> log;
  PipelineLinks a;
  for (int k = 0; k < 2; ++k) {
    a.created.push_back(std::make_shared<TeardownLoggedGroup>("old" + std::to_string(k), &log));
    (k == 0 ? a.out : a.in)[static_cast<size_t>(k)] = a.created.back();
  }
  PipelineLinks b;
  b.created.push_back(std::make_shared<TeardownLoggedGroup>("new0", &log));
  b.out[0] = b.created.back();
  a = std::move(b);  // the old links go first, newest first
  EXPECT_EQ(log, (std::vector<std::string>{"old1", "old0"}));
  PipelineLinks c(std::move(a));
  EXPECT_EQ(log.size(), 2u);
  c.release();
  EXPECT_EQ(log, (std::vector<std::string>{"old1", "old0", "new0"}));
  EXPECT_EQ(c.out[0], nullptr);
}

// Two Gloo ranks on threads: the names of the links each creates, in order.
std::vector<std::vector<std::string>> links_on_two_ranks(bool ring) {
  auto store = std::make_shared<dist::HashStore>();
  std::vector<std::vector<std::string>> names(2);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        dist::ProcessGroupOptions o;
        o.name = "links";
        o.timeout = std::chrono::seconds(60);
        auto world = dist::make_process_group("gloo", r, 2, store, o);
        PipelineLinks links = make_pipeline_links(world, ring);
        for (const auto& g : links.created) names[static_cast<size_t>(r)].push_back(g->options().name);
        // Every role's link is one of those released in order.
        for (const auto* role : {&links.out, &links.in})
          for (const auto& g : *role)
            if (g && std::find(links.created.begin(), links.created.end(), g) == links.created.end())
              names[static_cast<size_t>(r)].push_back("a link outside `created`");
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return names;
}

TEST(PipelineLinks, BothRanksCreateTheSameLinksInTheSameOrder) {
  if (!dist::gloo_available()) GTEST_SKIP() << "this build has no Gloo";
  const auto chain = links_on_two_ranks(false);
  EXPECT_EQ(chain[0], (std::vector<std::string>{"links/sub1", "links/sub2"}));  // 0->1 activations, 1->0 gradients
  EXPECT_EQ(chain[1], chain[0]);
  const auto ring = links_on_two_ranks(true);
  EXPECT_EQ(ring[0], (std::vector<std::string>{"links/sub1", "links/sub2", "links/sub3", "links/sub4"}));
  EXPECT_EQ(ring[1], ring[0]);
}

}  // namespace
}  // namespace chorus::parallel
