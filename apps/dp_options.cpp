// The environment switches of DataParallel's gradient sums: A/B switches
// between measured speed paths, read here (the one place; the library takes
// them as DataParallelOptions):
//   CHORUS_DP_ALLREDUCE        auto | nccl | copy-engine | in-update: how the
//                              replicas' gradients are summed (--dp-all-reduce
//                              wins over it; dist::GradSumMethod)
//   CHORUS_DP_GRADS            in-place (default) | packed: large gradients
//                              summed where the backward wrote them, or every
//                              one packed into flat buckets first
//   CHORUS_DP_GRADS_MIN_BYTES  the smallest gradient summed in place (bytes;
//                              default 1 MiB)
#include <cstdlib>
#include <string>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "commands.h"

namespace chorus::app {

parallel::DataParallelOptions dp_options(double bucket_mb, std::optional<double> last_bucket_mb,
                                         const std::optional<std::string>& all_reduce) {
  parallel::DataParallelOptions o;
  o.bucket_bytes = mib_to_bytes(bucket_mb);
  if (last_bucket_mb) o.last_bucket_bytes = mib_to_bytes(*last_bucket_mb);
  if (all_reduce) {
    o.grad_sum = dist::parse_grad_sum_method(*all_reduce, "--dp-all-reduce");
  } else if (const char* e = chorus::env::get("CHORUS_DP_ALLREDUCE"); e && *e) {
    o.grad_sum = dist::parse_grad_sum_method(e, "CHORUS_DP_ALLREDUCE");
  }
  if (const char* e = chorus::env::get("CHORUS_DP_GRADS"); e && *e) {
    const std::string s = e;
    CHORUS_CHECK(s == "in-place" || s == "packed", "CHORUS_DP_GRADS='", s,
                 "' is not a way to hand gradients to the all-reduce (expected in-place or packed)");
    o.grads_in_place = s == "in-place";
  }
  if (const char* e = chorus::env::get("CHORUS_DP_GRADS_MIN_BYTES"); e && *e) {
    char* end = nullptr;
    const long long v = std::strtoll(e, &end, 10);
    CHORUS_CHECK(end && *end == '\0' && v >= 0, "CHORUS_DP_GRADS_MIN_BYTES='", e,
                 "' is not a number of bytes (the smallest gradient summed where it is)");
    o.in_place_min_bytes = v;
  }
  return o;
}

}  // namespace chorus::app
