#include "chorus/data_parallel/replica_sync.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <sstream>

#include "chorus/core/error.h"
#include "chorus/ops/factory.h"

namespace chorus::dist {

namespace {

uint64_t fnv1a(const std::vector<std::string>& lines) {
  uint64_t h = 1469598103934665603ull;
  for (const std::string& l : lines) {
    for (unsigned char c : l) h = (h ^ c) * 1099511628211ull;
    h = (h ^ '\n') * 1099511628211ull;
  }
  return h;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

}  // namespace

FlatSet::FlatSet(const std::vector<Tensor>& ts) {
  std::map<Device, std::vector<size_t>> by_device;
  for (size_t i = 0; i < ts.size(); ++i) by_device[ts[i].device()].push_back(i);
  for (auto& [device, members] : by_device) {
    PerDevice d;
    std::vector<Tensor> mine;
    for (size_t i : members) mine.push_back(ts[i]);
    d.layout = FlatLayout(mine);
    for (size_t g = 0; g < d.layout.groups(); ++g)
      d.flats.push_back(empty({d.layout.numels[g]}, TensorOptions(d.layout.dtypes[g], device)));
    d.members = std::move(members);
    devices.push_back(std::move(d));
  }
}

std::vector<Tensor> FlatSet::views(size_t n) const {
  std::vector<Tensor> out(n);
  for (const PerDevice& d : devices)
    for (size_t j = 0; j < d.members.size(); ++j)
      out[d.members[j]] = d.layout.view(d.flats[d.layout.segments[j].group], j);
  return out;
}

void FlatSet::broadcast(ProcessGroup& group) const {
  for (const PerDevice& d : devices)
    for (const Tensor& f : d.flats) on_group_device(group, f, [&](const Tensor& w) { return group.broadcast(w, 0); });
}

std::unique_ptr<FlatSet> flatten_module_buffers(nn::Module& module) {
  std::vector<Tensor> list;
  for (auto& [name, b] : module.named_buffers()) list.push_back(b);
  if (list.empty()) return nullptr;
  auto set = std::make_unique<FlatSet>(list);
  std::vector<Tensor> views = set->views(list.size());
  ops::copy_multi(list, views);
  std::unordered_map<const TensorImpl*, Tensor> view_of;
  for (size_t i = 0; i < list.size(); ++i) view_of[list[i].impl()] = views[i];
  for (const nn::ModulePtr& m : module.modules())
    for (auto& [name, slot] : m->own_buffers())
      if (slot.defined())
        if (auto it = view_of.find(slot.impl()); it != view_of.end()) slot = it->second;
  return set;
}

void broadcast_module_buffers(const FlatSet& buffers, ProcessGroup& group, nn::Module& module) {
  if (group.size() == 1) return;
  buffers.broadcast(group);
  for (const nn::ModulePtr& m : module.modules())
    for (auto& [name, slot] : m->own_buffers())
      if (slot.defined()) slot.bump_version();
}

ReplicaParameters check_replica(const nn::Module& module, ProcessGroup& group, const std::string& who,
                                const std::string& key, bool group_device_only) {
  ReplicaParameters out;
  std::vector<std::string> signature;
  const Device home = group.device();
  for (auto& [name, p] : module.named_parameters()) {
    signature.push_back(describe("parameter", name, p) + (p.requires_grad() ? "" : " frozen"));
    if (!p.requires_grad()) {
      out.frozen.push_back(p);
      continue;
    }
    if (home.is_cuda())
      CHORUS_CHECK(group_device_only ? p.device() == home : p.device().is_cuda(), who, ": parameter '", name,
                   "' is on ", p.device().str(), " but the ", group.backend(), " group reduces tensors on ",
                   group_device_only ? home.str() : std::string("GPUs"));
    else
      CHORUS_CHECK(p.device().is_cpu(), who, ": parameter '", name, "' is on ", p.device().str(), " but the ",
                   group.backend(), " group reduces CPU tensors (use the nccl backend for GPUs)");
    out.names.push_back(name);
    out.trainable.push_back(p);
  }
  for (auto& [name, b] : module.named_buffers()) signature.push_back(describe("buffer", name, b));
  CHORUS_CHECK(!out.trainable.empty(), who, ": the module has no parameter that requires grad");
  check_same_model(group, signature, who, key);
  return out;
}

bool PassStack::push(const std::unordered_set<const TensorImpl*>& leaves, const std::vector<Tensor>& params) {
  const bool ours = std::any_of(params.begin(), params.end(), [&](const Tensor& p) { return leaves.count(p.impl()) > 0; });
  push(ours);
  return ours;
}

std::vector<size_t> unreached_params(const std::unordered_set<const TensorImpl*>& leaves,
                                     const std::vector<Tensor>& params, std::vector<int64_t>& used) {
  std::vector<size_t> unreached;
  used.assign(params.size(), 0);
  for (size_t k = 0; k < params.size(); ++k) {
    const bool reached = leaves.count(params[k].impl()) > 0;
    if (!reached) unreached.push_back(k);
    used[k] = reached || params[k].grad().defined();
  }
  return unreached;
}

NoSyncGuard::NoSyncGuard(std::shared_ptr<void> state, std::mutex& mu, bool& flag)
    : state_(std::move(state)), mu_(&mu), flag_(&flag) {
  std::lock_guard<std::mutex> lk(*mu_);
  prev_ = *flag_;
  *flag_ = true;
}

NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : state_(std::move(other.state_)), mu_(other.mu_), flag_(other.flag_), prev_(other.prev_) {
  other.flag_ = nullptr;
}

NoSyncGuard::~NoSyncGuard() {
  if (!flag_) return;
  std::lock_guard<std::mutex> lk(*mu_);
  *flag_ = prev_;
}

// rank 0's values into `ts` (packed, one broadcast per device and dtype).
void broadcast_in_place(ProcessGroup& group, const std::vector<Tensor>& ts) {
  if (ts.empty()) return;
  FlatSet set(ts);
  std::vector<Tensor> views = set.views(ts.size());
  ops::copy_multi(ts, views);
  set.broadcast(group);
  ops::copy_multi(views, ts);  // bumps the versions: DataParallel replicas re-sync
}

std::string describe(const std::string& kind, const std::string& name, const Tensor& t) {
  std::ostringstream os;
  os << kind << " '" << name << "' " << shape_str(t.sizes()) << " " << dtype_name(t.dtype());
  return os.str();
}

// Note [DDP model check] (ddp.h).
void check_same_model(ProcessGroup& group, const std::vector<std::string>& mine, const std::string& who,
                      const std::string& key) {
  const int n = group.size();
  if (n == 1) return;
  const int64_t h = static_cast<int64_t>(fnv1a(mine));
  Tensor in = ops::to_device(from_vector(std::vector<int64_t>{h}, {1}), group.device());
  Tensor out = empty({n}, TensorOptions(kInt64, group.device()));
  group.all_gather(in, out)->wait();
  const std::vector<int64_t> all = out.to_vector<int64_t>();
  int differs = -1;
  for (int r = 1; r < n && differs < 0; ++r)
    if (all[r] != all[0]) differs = r;
  if (differs < 0) return;
  const std::string prefix = key + "/model/";
  group.store()->set(prefix + std::to_string(group.rank()), join_lines(mine));
  const std::vector<std::string> root = split_lines(group.store()->get_string(prefix + "0"));
  const std::vector<std::string> other = split_lines(group.store()->get_string(prefix + std::to_string(differs)));
  std::string what;
  for (size_t i = 0; i < std::max(root.size(), other.size()) && what.empty(); ++i) {
    if (i >= other.size())
      what = "rank " + std::to_string(differs) + " lacks " + root[i] + " of rank 0";
    else if (i >= root.size())
      what = "rank " + std::to_string(differs) + " has " + other[i] + " that rank 0 lacks";
    else if (root[i] != other[i])
      what = "rank " + std::to_string(differs) + " has " + other[i] + " where rank 0 has " + root[i];
  }
  CHORUS_THROW(ValueError, who, ": the ranks hold different models: ", what,
               " (every rank must build the same model before wrapping it)");
}

}  // namespace chorus::dist
