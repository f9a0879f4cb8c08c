#include "chorus/distributed/process_group.h"

#include "chorus/core/error.h"

namespace chorus::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

void ProcessGroup::check_tensor(const char* op, const Tensor& t) const {
  CHORUS_CHECK(t.defined(), op, ": the tensor is undefined");
  const DType d = t.dtype();
  CHORUS_CHECK(d == kFloat32 || d == kBFloat16 || d == kFloat64 || d == kInt64, op, ": ", backend(),
               " process groups take float32, bfloat16, float64 or int64 tensors, got ", t.describe());
  CHORUS_CHECK(t.is_contiguous(), op, ": the tensor must be contiguous, got ", t.describe());
}

void ProcessGroup::check_peer(const char* op, int peer, const char* what) const {
  CHORUS_CHECK(peer >= 0 && peer < size_ && peer != rank_, op, ": ", what, " ", peer, " is not another rank of this group (",
               size_, " ranks, this is rank ", rank_, ")");
}

}  // namespace chorus::dist

#include <cctype>
#include <set>

#include "chorus/core/device.h"
#include "chorus/distributed/gloo_group.h"
#include "chorus/distributed/prefix_store.h"
#include "chorus/distributed/nccl_group.h"

namespace chorus::dist {

bool gloo_available() {
#ifdef CHORUS_WITH_GLOO
  return true;
#else
  return false;
#endif
}

bool nccl_backend_available() {
#if defined(CHORUS_WITH_CUDA) && defined(CHORUS_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

ProcessGroupPtr make_process_group(const std::string& backend, int rank, int size, StorePtr store,
                                   ProcessGroupOptions options) {
  CHORUS_CHECK(size >= 1 && rank >= 0 && rank < size, "process group: rank ", rank, " is out of range for ", size,
               " ranks");
  if (backend == "gloo") {
#ifdef CHORUS_WITH_GLOO
    return std::make_shared<ProcessGroupGloo>(rank, size, std::move(store), options);
#else
    CHORUS_THROW(DistError, "this build of Chorus has no Gloo (install Debian's libgloo-dev and rebuild); "
                            "`chorus --version` lists the backends it has");
#endif
  }
  if (backend == "nccl") {
#if defined(CHORUS_WITH_CUDA) && defined(CHORUS_WITH_NCCL)
    CHORUS_CHECK(cuda_device_count() > 0, "the nccl backend needs a CUDA GPU; this machine has none (use gloo)");
    return make_nccl_group(rank, size, std::move(store), options, current_device().is_cuda() ? current_device().index : 0);
#else
    CHORUS_THROW(DistError, "this build of Chorus has no NCCL (build with the CUDA toolkit and NCCL); "
                            "`chorus --version` lists the backends it has");
#endif
  }
  CHORUS_THROW(ValueError, "unknown process-group backend '", backend, "' (expected gloo or nccl)");
}

std::string ProcessGroup::trace_track() const {
  const std::string& n = options_.name;
  const size_t slash = n.rfind('/');
  if (slash == std::string::npos) return backend();
  size_t end = n.size();
  while (end > slash + 1 && std::isdigit(static_cast<unsigned char>(n[end - 1]))) --end;  // the subgroup's number
  return backend() + " " + n.substr(slash + 1, end - slash - 1);
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks, const std::string& label) {
  CHORUS_CHECK(!ranks.empty(), "new_group: the rank list is empty");
  std::set<int> seen;
  for (int r : ranks) {
    CHORUS_CHECK(r >= 0 && r < size_, "new_group: rank ", r, " is not a rank of this group (", size_, " ranks)");
    CHORUS_CHECK(seen.insert(r).second, "new_group: rank ", r, " appears twice");
  }
  const int id = ++subgroups_;  // counted on every rank, members or not
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i] == rank_) mine = static_cast<int>(i);
  if (mine < 0) return nullptr;
  ProcessGroupOptions o = options_;
  o.name = options_.name + "/" + label + std::to_string(id);
  // Note [Ranks named in the job's numbering]
  o.job_ranks.clear();
  for (int r : ranks) o.job_ranks.push_back(job_rank(r));
  o.job_store = job_store();
  auto store = std::make_shared<PrefixStore>("group/" + o.name, store_);
  return make_process_group(backend(), mine, static_cast<int>(ranks.size()), store, o);
}

}  // namespace chorus::dist
