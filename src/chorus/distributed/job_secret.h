// The job secret: what proves a connection to the job's store belongs to the
// job (Note [Store job secret] in distributed/store_auth.h). Where it comes from:
//  - chorus launch --job-secret-file FILE (a file only its owner may read);
//  - else CHORUS_JOB_SECRET in the environment;
//  - else, on a job of one node, a fresh random one per launch.
// The launcher hands it to its workers as CHORUS_JOB_SECRET (the environment
// of a process is readable only by its user; a command line by everyone), and
// no message ever prints it.
#pragma once

#include <string>

namespace chorus::dist {

inline constexpr const char* kJobSecretVariable = "CHORUS_JOB_SECRET";
inline constexpr size_t kMinJobSecretBytes = 16;

// CHORUS_JOB_SECRET, or empty when unset or empty. ValueError (one line, not
// showing it) when it is shorter than kMinJobSecretBytes.
std::string job_secret_from_environment();
// The secret in `path` (trailing whitespace dropped). ValueError, one line,
// when the file cannot be read, is readable or writable by its group or by
// others, or holds less than kMinJobSecretBytes.
std::string read_job_secret_file(const std::string& path);
// 32 random bytes from the kernel, as 64 hex digits.
std::string make_job_secret();
// n random bytes from the kernel (getrandom); DistError when it has none.
void random_bytes(void* out, size_t n);

}  // namespace chorus::dist
