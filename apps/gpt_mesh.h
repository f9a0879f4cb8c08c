// What `chorus train --mesh` and `chorus bench --mesh` share: the --mesh
// checks that need no process group, joining the job, the device mesh
// (printed by rank 0), and the tensor-parallel GPT built from --seed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/distributed/device_mesh.h"
#include "chorus/parallel/pipeline.h"
#include "chorus/tensor_parallel/gpt.h"
#include "train_dist.h"

namespace chorus::app {

struct MeshSettings {
  std::string spec;                    // --mesh
  bool sequence_parallel = false;      // --sequence-parallel
  int tp_chunks = 1;                   // --tp-chunks (TPContext::chunks)
  bool allow_tp_across_nodes = false;  // --allow-tp-across-nodes
  std::string devices;                 // --devices (one per process)
  double timeout_s = 300;              // --dist-timeout
  uint64_t seed = 0;
  bool quiet = false;
};

// The axes of `s.spec`, after the checks every rank makes alike before any
// group exists (ValueError, one line): --sequence-parallel only with tp > 1,
// --tp-chunks at least 1 and above 1 only with --sequence-parallel,
// and a sequence divisible by tp, heads and vocabulary divisible by tp, no
// more pipeline stages than the model has layers (embeddings, blocks, head).
std::vector<dist::MeshAxis> check_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq);
int mesh_axis_size(const std::vector<dist::MeshAxis>& axes, const std::string& name);

// --mesh with pp > 1: the options of --strategy pipeline that apply to it.
struct MeshPipeSettings {
  int64_t micro_batches = 4;     // --micro-batches (train: default 4, at least pp)
  std::string schedule = "1f1b";  // --schedule: 1f1b | gpipe | interleaved
  int64_t virtual_stages = 1;    // stages per pipeline rank (--virtual-stages; interleaved only, default 2)
  std::vector<int64_t> balance;  // --balance: layers per stage, pp x virtual_stages counts (empty: by cost, parallel::balance_ranks)
  int64_t stages(int pp) const { return pp * virtual_stages; }
};
// ValueError, one line, every rank alike before any group: an unknown
// schedule, virtual stages with a schedule other than interleaved, more
// stages than layers, fewer micro-batches than pipeline ranks, a batch that
// does not divide into the micro-batches, a balance that is not one count per
// stage adding up to the layers.
void check_mesh_pipeline(const std::vector<dist::MeshAxis>& axes, const models::GPTConfig& cfg,
                         const MeshPipeSettings& p, int64_t batch);

struct MeshGpt {
  RankContext rc;
  std::unique_ptr<dist::DeviceMesh> mesh;
  tp::TPContext ctx;
  std::shared_ptr<tp::TensorParallelGPT> model;
  Device device;
  int dp() const { return mesh->size("dp"); }
  int dp_rank() const { return mesh->coord("dp"); }
  int pp() const { return mesh->size("pp"); }
  int pp_rank() const { return mesh->coord("pp"); }
};
// Joins the job (a world of one without a launcher when the mesh has one
// rank), builds the mesh and the model on this rank's device (Note [Dropout
// across the mesh]: the generators seeded per data rank afterwards). With
// pp > 1 the model stays on the host: start_mesh_pipeline moves this rank's
// stage alone to the device.
MeshGpt start_mesh_gpt(const MeshSettings& s, const models::GPTConfig& cfg, int64_t seq);

// Note [GPT pipelines over the mesh]: with pp > 1 the tensor-parallel GPT's
// layers (tp::pipeline_layers: embeddings, blocks, head) run as a
// parallel::Pipeline over the mesh's pp group, one stage of contiguous layers
// per pipeline rank (the interleaved schedule: V of them, stage s on pipeline
// rank s % pp, Note [Pipeline links] in parallel/pipeline_links.h), each
// stage itself split over its tp group. Every rank
// builds the whole model, so the optimizer can keep the one-process order of
// parameters (checkpoints' indices); the other stages' parameters never get a
// gradient and AdamW leaves them alone. After a step's backwards the
// gradients are averaged over dp (tp::average_gradients, once per optimizer
// step with --grad-accum, not overlapped with the backward as Pipeline's own
// data_group would) and the tied embedding's two copies
// summed over pp (Note [Tied embeddings across stages]); clipping is over tp
// and pp with the last stage's copy counted once. The loss exists on the last
// stage's ranks only: the drivers sum it over the world and divide by the
// ranks that hold it.
struct MeshPipeline {
  std::shared_ptr<parallel::Pipeline> pipe;
  std::vector<tp::ShardedParameter> local;  // this rank's stages' parameters
  std::vector<Tensor> counted_elsewhere;    // the clip's tensors counted on another stage
  bool uses_wte = false;                    // this stage holds a copy of the token embedding
  bool last_stage = false;
  // Per parameter of tp::sharded_parameters(model): the pipeline rank whose
  // stage holds it (the tied embedding: the first stage's rank, 0), for checkpoints.
  std::vector<int> owner;
};
// Collective over the pp group (the pipeline's send/recv groups). Without
// p.balance the stages split the layers by their cost at sequences of `seq`
// (parallel::balance_ranks, Note [Pipeline stages by cost]).
MeshPipeline start_mesh_pipeline(MeshGpt& m, const MeshPipeSettings& p, int64_t seq);
// After the step's backwards: dp average, then the tied embedding's sum over pp.
void reduce_pipeline_gradients(MeshGpt& m, MeshPipeline& mp);
// The step's global gradient norm, clipped to max_norm (0: measured only),
// over tp (and pp with a pipeline).
Tensor clip_mesh_gradients(MeshGpt& m, const MeshPipeline* mp, const std::vector<tp::ShardedParameter>& all,
                           double max_norm);

}  // namespace chorus::app
