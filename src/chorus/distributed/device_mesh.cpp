#include "chorus/distributed/device_mesh.h"

#include <map>
#include <sstream>

#include "chorus/core/error.h"

namespace chorus::dist {

namespace {

const std::vector<std::string>& canonical_axes() {
  static const std::vector<std::string> names = {"dp", "pp", "tp"};
  return names;
}

int parse_size(const std::string& text, const std::string& item) {
  CHORUS_CHECK(!text.empty() && text.size() <= 6 && text.find_first_not_of("0123456789") == std::string::npos,
               "--mesh: '", item, "' needs a whole number of ranks (as in dp=2,tp=2)");
  const int n = std::stoi(text);
  CHORUS_CHECK(n >= 1, "--mesh: '", item, "': an axis needs at least one rank");
  return n;
}

}  // namespace

std::vector<MeshAxis> parse_mesh_spec(const std::string& spec) {
  std::map<std::string, int> given;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto eq = item.find('=');
    CHORUS_CHECK(eq != std::string::npos, "--mesh: '", item, "' is not AXIS=SIZE (axes: dp, pp, tp; e.g. dp=2,tp=2)");
    const std::string name = item.substr(0, eq);
    bool known = false;
    for (const auto& n : canonical_axes()) known = known || n == name;
    CHORUS_CHECK(known, "--mesh: unknown axis '", name, "' (axes: dp, pp, tp)");
    CHORUS_CHECK(!given.count(name), "--mesh: axis '", name, "' is given twice");
    given[name] = parse_size(item.substr(eq + 1), item);
  }
  CHORUS_CHECK(!given.empty(), "--mesh: empty (expected e.g. dp=2,tp=2)");
  std::vector<MeshAxis> axes;
  for (const auto& n : canonical_axes()) axes.push_back({n, given.count(n) ? given[n] : 1});
  return axes;
}

std::string mesh_spec_str(const std::vector<MeshAxis>& axes) {
  std::string s;
  for (const auto& a : axes) s += (s.empty() ? "" : ",") + a.name + "=" + std::to_string(a.size);
  return s;
}

void check_mesh_fits(const std::vector<MeshAxis>& axes, int world_size, const MeshOptions& options) {
  CHORUS_CHECK(!axes.empty(), "DeviceMesh: no axes");
  int64_t product = 1;
  int tp = 1;
  for (size_t i = 0; i < axes.size(); ++i) {
    CHORUS_CHECK(axes[i].size >= 1, "DeviceMesh: axis '", axes[i].name, "' has size ", axes[i].size);
    for (size_t j = 0; j < i; ++j)
      CHORUS_CHECK(axes[j].name != axes[i].name, "DeviceMesh: axis '", axes[i].name, "' is given twice");
    product *= axes[i].size;
    if (axes[i].name == "tp") tp = axes[i].size;
  }
  CHORUS_CHECK(product == world_size, "--mesh ", mesh_spec_str(axes), " needs ", product,
               " processes, but the job has ", world_size, " (the axis sizes must multiply to the world size)");
  const int local = options.local_world_size;
  if (local > 0 && local < world_size && !options.allow_tp_across_nodes) {
    CHORUS_CHECK(local % tp == 0, "--mesh: tp=", tp, " would span nodes of ", local,
                 " processes each (tensor parallelism all-reduces every layer: keep tp within a node, "
                 "or pass --allow-tp-across-nodes)");
  }
}

DeviceMesh::DeviceMesh(ProcessGroupPtr world, std::vector<MeshAxis> axes, MeshOptions options)
    : world_(std::move(world)), axes_(std::move(axes)) {
  CHORUS_CHECK(world_ != nullptr, "DeviceMesh: no world process group");
  check_mesh_fits(axes_, world_->size(), options);
  coords_ = coords_of(world_->rank());
  // Every rank creates every group in the same order (ProcessGroup::new_group's
  // contract); each rank is a member of exactly one group per axis.
  for (size_t a = 0; a < axes_.size(); ++a) {
    ProcessGroupPtr mine;
    for (int r = 0; r < world_->size(); ++r) {
      std::vector<int> c = coords_of(r);
      if (c[a] != 0) continue;  // r is the first rank of its line along axis a
      std::vector<int> line;
      for (int i = 0; i < axes_[a].size; ++i) {
        c[a] = i;
        line.push_back(rank_at(c));
      }
      if (auto g = world_->new_group(line, axes_[a].name)) mine = std::move(g);
    }
    CHORUS_ASSERT(mine != nullptr && mine->size() == axes_[a].size);
    groups_.push_back(std::move(mine));
  }
}

int DeviceMesh::index_of(const std::string& name) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i].name == name) return static_cast<int>(i);
  return -1;
}

int DeviceMesh::size(const std::string& axis) const {
  const int i = index_of(axis);
  return i < 0 ? 1 : axes_[i].size;
}

int DeviceMesh::coord(const std::string& axis) const {
  const int i = index_of(axis);
  return i < 0 ? 0 : coords_[i];
}

const ProcessGroupPtr& DeviceMesh::group(const std::string& axis) const {
  const int i = index_of(axis);
  CHORUS_CHECK(i >= 0, "DeviceMesh: no axis '", axis, "' in ", mesh_spec_str(axes_));
  return groups_[i];
}

std::vector<int> mesh_coords(const std::vector<MeshAxis>& axes, int rank) {
  std::vector<int> c(axes.size());
  for (size_t i = axes.size(); i-- > 0;) {
    c[i] = rank % axes[i].size;
    rank /= axes[i].size;
  }
  return c;
}

int mesh_rank(const std::vector<MeshAxis>& axes, const std::vector<int>& coords) {
  CHORUS_ASSERT(coords.size() == axes.size());
  int r = 0;
  for (size_t i = 0; i < axes.size(); ++i) r = r * axes[i].size + coords[i];
  return r;
}

int DeviceMesh::rank_at(const std::vector<int>& coords) const { return mesh_rank(axes_, coords); }

std::vector<int> DeviceMesh::coords_of(int world_rank) const { return mesh_coords(axes_, world_rank); }

std::string DeviceMesh::describe() const {
  std::ostringstream os;
  os << "mesh " << mesh_spec_str(axes_) << " over " << world_->size() << " rank" << (world_->size() == 1 ? "" : "s")
     << " (" << axes_.back().name << " fastest):";
  // One line per row of the last axis: its leading coordinates, then the ranks.
  const int last = axes_.back().size;
  for (int r = 0; r < world_->size(); r += last) {
    const std::vector<int> c = coords_of(r);
    os << "\n ";
    for (size_t i = 0; i + 1 < axes_.size(); ++i) os << " " << axes_[i].name << c[i];
    os << ": " << axes_.back().name << " ->";
    for (int i = 0; i < last; ++i) os << " rank " << r + i << (i + 1 < last ? "," : "");
  }
  return os.str();
}

}  // namespace chorus::dist
