// DeviceMesh: the ranks of a job as a named grid ({dp: 2, tp: 2},
// {dp: 1, pp: 2, tp: 2}), with one process group per axis: the ranks that
// differ only in that axis's coordinate (a rank's "tp group" holds the ranks
// of its own dp and pp coordinates). Megatron-LM's parallel state and
// PyTorch's init_device_mesh, in one object.
//
// Note [Mesh rank order]: ranks are laid out row-major over the axes as given,
// the last axis fastest. The canonical order from parse_mesh_spec is dp, pp,
// tp: the tensor-parallel ranks are consecutive, so under a launcher that
// numbers a node's ranks consecutively (chorus launch, torchrun, srun) a tp
// group stays inside one node, where its per-layer all-reduces ride NVLink.
// A tp group wider than a node is refused unless asked for
// (MeshOptions::allow_tp_across_nodes), since it would put every layer's
// collectives on the network.
#pragma once

#include <string>
#include <vector>

#include "chorus/distributed/process_group.h"

namespace chorus::dist {

struct MeshAxis {
  std::string name;
  int size = 1;
};

// "dp=2,tp=2" (any order, each of dp, pp, tp at most once, sizes >= 1) ->
// {dp, pp, tp} in that order, the missing ones of size 1. Throws ValueError
// with one line naming what is wrong.
std::vector<MeshAxis> parse_mesh_spec(const std::string& spec);
// "dp=2,pp=1,tp=2"
std::string mesh_spec_str(const std::vector<MeshAxis>& axes);

struct MeshOptions {
  int local_world_size = 0;  // ranks per node (0: the world is one node)
  bool allow_tp_across_nodes = false;
};

// The checks DeviceMesh's constructor makes before any group exists: the
// sizes multiply to `world_size`, and a "tp" axis fits inside a node of
// options.local_world_size ranks unless allowed to span nodes. ValueError,
// one line naming --mesh, otherwise.
void check_mesh_fits(const std::vector<MeshAxis>& axes, int world_size, const MeshOptions& options = {});

// Note [Mesh rank order] as arithmetic: the coordinates of `rank` (one per
// axis) and back.
std::vector<int> mesh_coords(const std::vector<MeshAxis>& axes, int rank);
int mesh_rank(const std::vector<MeshAxis>& axes, const std::vector<int>& coords);

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it with the same axes. Throws
  // ValueError when the axis sizes do not multiply to world->size(), or when
  // the "tp" axis spans nodes without MeshOptions::allow_tp_across_nodes.
  DeviceMesh(ProcessGroupPtr world, std::vector<MeshAxis> axes, MeshOptions options = {});

  const std::vector<MeshAxis>& axes() const { return axes_; }
  const ProcessGroupPtr& world() const { return world_; }
  bool has_axis(const std::string& name) const { return index_of(name) >= 0; }
  // Size, this rank's coordinate, and this rank's group along an axis (a
  // group of one for an axis of size 1). Unknown names throw ValueError; an
  // axis the mesh lacks has size 1 and coordinate 0 for size()/coord().
  int size(const std::string& axis) const;
  int coord(const std::string& axis) const;
  const ProcessGroupPtr& group(const std::string& axis) const;
  // The world rank at `coords` (one per axis, in the axes' order).
  int rank_at(const std::vector<int>& coords) const;
  std::vector<int> coords_of(int world_rank) const;
  // "mesh dp=2 x tp=2 over 4 ranks: dp0 [tp0 r0, tp1 r1] dp1 [...]"-style
  // picture, one line per row of the last axis (printed by rank 0 at start).
  std::string describe() const;

 private:
  int index_of(const std::string& name) const;
  ProcessGroupPtr world_;
  std::vector<MeshAxis> axes_;
  std::vector<int> coords_;
  std::vector<ProcessGroupPtr> groups_;  // one per axis
};

}  // namespace chorus::dist
