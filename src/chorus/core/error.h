// Errors: one base class (chorus::Error, message carrying file:line) and one
// subclass per kind of failure a caller may want to catch separately. Library
// code throws; it never calls exit() or abort(). CHORUS_CHECK is for caller
// errors (bad arguments), CHORUS_ASSERT for internal invariants.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace chorus {

class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, const char* file, int line);
  explicit Error(const std::string& msg) : std::runtime_error(msg), message_(msg), what_(msg) {}
  // The message without the file:line suffix (for one-line CLI output).
  const std::string& message() const { return message_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string message_;
  std::string what_;
};

#define CHORUS_DECLARE_ERROR(Name)                                          \
  class Name : public Error {                                               \
   public:                                                                  \
    using Error::Error;                                                     \
  };
CHORUS_DECLARE_ERROR(ValueError)
CHORUS_DECLARE_ERROR(DeviceError)
CHORUS_DECLARE_ERROR(OutOfMemoryError)
CHORUS_DECLARE_ERROR(DistError)
CHORUS_DECLARE_ERROR(IOError)
// Something a captured CUDA graph cannot hold (core/graph_capture.h).
CHORUS_DECLARE_ERROR(CaptureError)
#undef CHORUS_DECLARE_ERROR

// Note [Distributed failure first]: when a process group has aborted its
// communicator (a rank died or stopped; Note [Collective timeouts]), device
// work that was waiting on the collective can then fail with a CUDA error of
// its own (an aborted NCCL kernel leaves the context unusable). The root cause
// is the distributed failure, so the group records it here and the CUDA error
// checks throw it, as DistError, instead of the secondary CUDA message.
void set_distributed_failure(const std::string& message);
// The recorded failure's message; empty when there is none.
std::string distributed_failure();

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace chorus

#define CHORUS_THROW(Kind, ...) \
  throw ::chorus::Kind(::chorus::detail::str_cat(__VA_ARGS__), __FILE__, __LINE__)

#define CHORUS_CHECK(cond, ...)                    \
  do {                                             \
    if (!(cond)) CHORUS_THROW(ValueError, __VA_ARGS__); \
  } while (0)

#define CHORUS_CHECK_T(Kind, cond, ...)            \
  do {                                             \
    if (!(cond)) CHORUS_THROW(Kind, __VA_ARGS__);  \
  } while (0)

// The one shape of the foreign libraries' check macros (CHORUS_CUDA_CHECK and
// the others; cuda/runtime/context.h says where each lives): a `Status` other than
// `ok` from `call` goes to thrower(status, text, __FILE__, __LINE__), which
// throws. `text` is #call, spelled by the library's macro so that it is the
// call as written.
#define CHORUS_STATUS_CHECK(Status, ok, thrower, call, text)                      \
  do {                                                                            \
    Status chorus_status_ = (call);                                               \
    if (chorus_status_ != (ok)) thrower(chorus_status_, text, __FILE__, __LINE__); \
  } while (0)

#define CHORUS_ASSERT(cond)                                                          \
  do {                                                                               \
    if (!(cond)) CHORUS_THROW(Error, "internal error: assertion failed: " #cond);    \
  } while (0)
