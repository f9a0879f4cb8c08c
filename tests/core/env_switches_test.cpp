// Note [Environment switches]: the table's names, env::get's reads and its
// refusal of a name the table does not have.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"

namespace chorus {
namespace {

TEST(EnvSwitches, TheTableNamesEachSwitchOnceWithAKindAndAMeaning) {
  std::set<std::string> seen;
  const std::set<std::string> kinds = {"setting", "diagnostic", "comparison", "internal"};
  for (const env::Switch& s : env::switches()) {
    const std::string name = s.name;
    EXPECT_EQ(name.rfind("CHORUS_", 0), 0u) << name;
    EXPECT_TRUE(seen.insert(name).second) << name << " twice";
    EXPECT_TRUE(kinds.count(s.kind)) << name << ": " << s.kind;
    EXPECT_GT(std::string(s.what).size(), 10u) << name;
  }
  EXPECT_GE(seen.size(), 20u);
}

TEST(EnvSwitches, GetReadsTheEnvironmentForATableName) {
  // CHORUS_CONV_SEARCH_LOG is read when a convolution plan is searched: not
  // in this test binary's CPU tests, so setting it here changes nothing else.
  const char* name = "CHORUS_CONV_SEARCH_LOG";
  const char* before = std::getenv(name);
  const std::string saved = before ? before : "";
  ::setenv(name, "7", 1);
  ASSERT_NE(env::get(name), nullptr);
  EXPECT_STREQ(env::get(name), "7");
  ::unsetenv(name);
  EXPECT_EQ(env::get(name), nullptr);
  if (before) ::setenv(name, saved.c_str(), 1);
}

TEST(EnvSwitches, AnUnknownNameIsRefusedNamingTheTable) {
  ::setenv("CHORUS_NOT_A_SWITCH", "1", 1);
  try {
    (void)env::get("CHORUS_NOT_A_SWITCH");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CHORUS_NOT_A_SWITCH is not in Note [Environment switches]"), std::string::npos)
        << e.what();
  }
  ::unsetenv("CHORUS_NOT_A_SWITCH");
}

}  // namespace
}  // namespace chorus
