// What `chorus train --mesh` and `chorus bench --mesh` share: the --mesh
// checks that need no process group, joining the job, the device mesh
// (printed by rank 0), and the tensor-parallel GPT built from --seed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/dist/device_mesh.h"
#include "chorus/tensor_parallel/gpt.h"
#include "train_dist.h"

namespace chorus::app {

struct MeshSettings {
  std::string spec;                    // --mesh
  bool sequence_parallel = false;      // --sequence-parallel
  bool allow_tp_across_nodes = false;  // --allow-tp-across-nodes
  std::string devices;                 // --devices (one per process)
  double timeout_s = 300;              // --dist-timeout
  uint64_t seed = 0;
  bool quiet = false;
};

// The axes of `s.spec`, after the checks every rank makes alike before any
// group exists (ValueError, one line): no pp > 1, --sequence-parallel only
// with tp > 1 and a sequence divisible by tp, heads and vocabulary divisible
// by tp.
std::vector<dist::MeshAxis> check_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq);

struct MeshGpt {
  RankContext rc;
  std::unique_ptr<dist::DeviceMesh> mesh;
  tp::TPContext ctx;
  std::shared_ptr<tp::TensorParallelGPT> model;
  Device device;
  int dp() const { return mesh->size("dp"); }
  int dp_rank() const { return mesh->coord("dp"); }
};
// Joins the job (a world of one without a launcher when the mesh has one
// rank), builds the mesh and the model on this rank's device (Note [Dropout
// across the mesh]: the generators seeded per data rank afterwards).
MeshGpt start_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq);

}  // namespace chorus::app
