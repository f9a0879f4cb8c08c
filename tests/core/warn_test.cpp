// Warnings: the prefix, one line per call, warn_once's once per key across
// threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/warn.h"

namespace chorus {
namespace {

int count_of(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

TEST(Warn, OneLineWithThePrefixOnStderr) {
  testing::internal::CaptureStderr();
  warn("disk almost full");
  warnf("freeing ", 3, " blocks failed: ", "busy");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "chorus: warning: disk almost full\nchorus: warning: freeing 3 blocks failed: busy\n");
}

TEST(Warn, OnceSaysAThingOncePerKey) {
  testing::internal::CaptureStderr();
  EXPECT_TRUE(warn_once("warn_test.param_a", "parameter a copied from cuda:0 to cuda:1"));
  EXPECT_FALSE(warn_once("warn_test.param_a", "parameter a copied from cuda:0 to cuda:1"));
  EXPECT_TRUE(warn_once("warn_test.param_b", "parameter b copied from cuda:0 to cuda:1"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, "parameter a copied"), 1);
  EXPECT_EQ(count_of(err, "parameter b copied"), 1);
}

TEST(Warn, OnceFromManyThreadsPrintsOneWholeLine) {
  constexpr int kThreads = 8;
  std::atomic<int> printed{0};
  testing::internal::CaptureStderr();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        if (warn_once("warn_test.threads", "shared once")) printed.fetch_add(1);
        warnf("thread line ", i);
      }
    });
  for (auto& th : threads) th.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(printed.load(), 1);
  EXPECT_EQ(count_of(err, "chorus: warning: shared once\n"), 1);
  // Every line whole: as many prefixes as newlines, each line starting with one.
  EXPECT_EQ(count_of(err, "chorus: warning: "), 1 + kThreads * 100);
  EXPECT_EQ(static_cast<int>(std::count(err.begin(), err.end(), '\n')), 1 + kThreads * 100);
  EXPECT_EQ(count_of("\n" + err, "\nchorus: warning: "), 1 + kThreads * 100);
}

}  // namespace
}  // namespace chorus
