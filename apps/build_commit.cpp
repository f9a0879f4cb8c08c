// The commit this program was built from: a header that the build writes
// (cmake/commit_header.cmake, at every build, rewritten only when it changes,
// so only this file recompiles after a commit).
#include "commands.h"

#include "chorus_commit.h"

namespace chorus::app {

std::string git_commit() { return CHORUS_GIT_COMMIT; }

}  // namespace chorus::app
