// throws_naming(f, {parts...}): f() must throw E (ValueError unless told)
// whose what() contains every part: the op's name, the shapes it got, the
// offending device name. DESIGN.md's contract is that an error says what the
// caller did wrong in terms they can act on; this checks it. Returns an
// AssertionResult, so failures point at the EXPECT_TRUE that called it.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include <chorus/core/error.h>

namespace chorus::test {

template <typename E = ValueError, typename F>
::testing::AssertionResult throws_naming(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& p : parts)
      if (what.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "'" << p << "' is not in the message: " << what;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception type: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace chorus::test
