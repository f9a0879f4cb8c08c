#include "chorus/distributed/job_secret.h"

#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "chorus/core/error.h"

namespace chorus::dist {

namespace {
void check_secret_length(const std::string& s, const std::string& where) {
  CHORUS_CHECK_T(ValueError, s.size() >= kMinJobSecretBytes, where, " holds a job secret of ", s.size(),
                 " characters; it needs at least ", kMinJobSecretBytes,
                 " (make one with: od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')");
}
}  // namespace

std::string job_secret_from_environment() {
  const char* v = std::getenv(kJobSecretVariable);
  if (!v || !*v) return "";
  std::string s(v);
  check_secret_length(s, std::string("the environment variable ") + kJobSecretVariable);
  return s;
}

std::string read_job_secret_file(const std::string& path) {
  struct stat st{};
  CHORUS_CHECK_T(ValueError, ::stat(path.c_str(), &st) == 0, "--job-secret-file ", path, ": ", std::strerror(errno));
  // Note [Secret file mode]: as ssh does for a private key, a secret others
  // on the machine can read is refused rather than used: it is no secret.
  CHORUS_CHECK_T(ValueError, (st.st_mode & 077) == 0, "--job-secret-file ", path, " has mode 0",
                 (st.st_mode >> 6) & 7, (st.st_mode >> 3) & 7, st.st_mode & 7,
                 ": others can read it; make it readable only by you (chmod 600 ", path, ")");
  std::ifstream in(path, std::ios::binary);
  CHORUS_CHECK_T(ValueError, in.good(), "--job-secret-file ", path, ": cannot be read");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  check_secret_length(s, "--job-secret-file " + path);
  return s;
}

void random_bytes(void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t k = ::getrandom(p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    CHORUS_CHECK_T(DistError, k > 0, "getrandom: ", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

std::string make_job_secret() {
  unsigned char raw[32];
  random_bytes(raw, sizeof(raw));
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : raw) s += hex[c >> 4], s += hex[c & 15];
  return s;
}

}  // namespace chorus::dist
