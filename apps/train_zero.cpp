#include "train_zero.h"

#include <string>
#include <vector>

#include "chorus/core/error.h"

namespace chorus::app {

dist::ShardOptions zero_flag_options(int stage, double bucket_mb, bool reshard_after_forward,
                                     const std::string& comm_hook, bool prefetch) {
  dist::ShardOptions so;
  so.stage = stage;
  so.prefetch = prefetch;
  so.bucket_bytes = static_cast<int64_t>(bucket_mb * (1 << 20));
  so.reshard_after_forward = reshard_after_forward;
  // --comm-hook bf16: the gradients' reduce-scatter travels in bfloat16.
  CHORUS_CHECK(comm_hook == "allreduce" || comm_hook == "bf16", "--comm-hook for --strategy zero is allreduce "
               "(gradients reduced in their own dtype) or bf16, got '", comm_hook, "'");
  if (comm_hook == "bf16") so.reduce_dtype = kBFloat16;
  return so;
}

dist::ShardOptions zero_flag_options(const TrainConfig& tc) {
  return zero_flag_options(tc.zero_stage.value_or(1), tc.bucket_mb, tc.reshard_after_forward, tc.comm_hook,
                           tc.zero_prefetch);
}

void add_gpt_sharding(dist::ShardOptions& so, const models::GPT& model, bool bf16, const std::string& param_dtype) {
  CHORUS_CHECK(param_dtype.empty() || param_dtype == "bf16" || param_dtype == "fp32",
               "--zero-param-dtype is bf16 or fp32, got '", param_dtype, "'");
  CHORUS_CHECK(param_dtype != "bf16" || bf16, "--zero-param-dtype bf16 needs --precision bf16 (the blocks' "
               "bfloat16 matrices are multiplied under autocast)");
  if (bf16 && param_dtype != "fp32") {
    so.param_dtype = kBFloat16;
    // The blocks' matrices: what autocast casts at each use. The tied
    // embedding (also looked up) and the positions stay float32.
    so.param_dtype_for = [](const std::string& name, const Tensor& p) {
      return p.dim() == 2 && name.find("transformer.h.") != std::string::npos;
    };
  }
  // The blocks, named: stage 3 shards them from construction (Note [Sharded
  // units]): the first step never holds the whole model; stages 1-2 wait for
  // each block's gather just before its forward (Note [Gathers beside the
  // forward]).
  so.units = model.blocks();
}

void validate_zero_options(const TrainConfig& tc) {
  if (tc.strategy != "zero") {
    CHORUS_CHECK(!tc.zero_stage && !tc.hybrid && !tc.zero_param_dtype,
                 tc.zero_stage ? "--zero-stage" : tc.hybrid ? "--hybrid" : "--zero-param-dtype",
                 " goes with --strategy zero");
    CHORUS_CHECK(tc.reshard_after_forward, "--no-reshard-after-forward goes with --strategy zero --zero-stage 3");
    CHORUS_CHECK(tc.zero_prefetch, "--no-zero-prefetch goes with --strategy zero");
    return;
  }
  CHORUS_CHECK(!tc.zero_stage || (*tc.zero_stage >= 1 && *tc.zero_stage <= 3), "--zero-stage must be 1, 2 or 3, got ",
               tc.zero_stage.value_or(0));
  CHORUS_CHECK(tc.zero_stage.value_or(1) == 3 || tc.reshard_after_forward,
               "--no-reshard-after-forward goes with --zero-stage 3 (only stage 3 shards the weights)");
}

std::shared_ptr<dist::ShardedDataParallel> make_sharded(const TrainConfig& tc, const nn::ModulePtr& model,
                                                        const RankContext& ranks, dist::ShardOptions so) {
  dist::ProcessGroupPtr shard_group = ranks.group;
  if (tc.hybrid) {
    // Every rank builds every subgroup, in one order (ProcessGroup::new_group).
    const int world = ranks.env.world_size, per_node = ranks.env.local_world_size;
    CHORUS_CHECK(per_node >= 1 && world % per_node == 0, "--hybrid shards inside each node: the world of ", world,
                 " ranks is not a whole number of nodes of ", per_node, " (LOCAL_WORLD_SIZE)");
    const int nodes = world / per_node, node = ranks.env.rank / per_node, local = ranks.env.rank % per_node;
    for (int n = 0; n < nodes; ++n) {
      std::vector<int> members;
      for (int l = 0; l < per_node; ++l) members.push_back(n * per_node + l);
      auto g = ranks.group->new_group(members);
      if (n == node) shard_group = g;
    }
    for (int l = 0; l < per_node; ++l) {
      std::vector<int> members;
      for (int n = 0; n < nodes; ++n) members.push_back(n * per_node + l);
      auto g = ranks.group->new_group(members);
      if (l == local) so.replicate_group = g;
    }
  }
  return std::make_shared<dist::ShardedDataParallel>(model, shard_group, so);
}

std::string describe_sharding(const dist::ShardedDataParallel& sdp, int world) {
  const dist::ShardOptions& o = sdp.options();
  std::string s = "zero stage " + std::to_string(o.stage) + ": ";
  if (o.stage == 3) {
    const auto names = sdp.unit_names();
    int units = 0;
    for (const std::string& n : names) units += n.empty() ? 0 : 1;
    s += std::to_string(units) + " units and the root, weights ";
    s += o.reshard_after_forward ? "freed after each forward" : "kept from forward to backward";
  } else {
    s += std::to_string(sdp.buckets().size()) + " gradient buckets, " +
         (o.stage == 1 ? "optimizer state sharded" : "optimizer state and gradients sharded");
    // Note [Gathers beside the forward] in data_parallel/sharded.h.
    if (!o.units.empty())
      s += o.prefetch ? ", weights gathered beside the forward (" + std::to_string(o.units.size()) + " units)"
                      : ", every weight gathered before the forward (--no-zero-prefetch)";
  }
  const int shards = sdp.process_group()->size();
  s += ", over " + std::to_string(shards) + " ranks";
  if (o.replicate_group) s += " (x " + std::to_string(world / shards) + " replicas: --hybrid)";
  return s;
}

}  // namespace chorus::app
