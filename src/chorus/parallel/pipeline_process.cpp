// A Pipeline's process groups (parallel/pipeline.h), set up beside its step:
// over processes (a stage group), the checks of the stages this rank builds,
// the links between the ranks (Note [Pipeline links] in pipeline_links.h)
// and the check that a step's lists keep each link's order; with a data
// group, a subgroup of it per local stage and the averaging of that stage's
// gradients over it.
#include "chorus/parallel/pipeline.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/data_parallel/flat_layout.h"
#include "chorus/ops/factory.h"
#include "chorus/parallel/placement.h"

namespace chorus::parallel {

void Pipeline::check_process_stages(int64_t layers) const {
  int64_t total = 0;
  for (size_t i = 0; i < balance_.size(); ++i) {
    CHORUS_CHECK(balance_[i] > 0, "Pipeline: stage ", i, " of the balance (", balance_str(balance_), ") has ", balance_[i],
                 " layers; every stage needs at least one");
    total += balance_[i];
  }
  CHORUS_CHECK(total == layers, "Pipeline: the balance ", balance_str(balance_), " adds up to ", total,
               " layers but the model has ", layers);
  check_device(devices_[0]);
}

void Pipeline::make_groups(int64_t places) {
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  // Several stages per rank: the last rank's activations go on to rank 0 (a ring).
  if (pg) links_ = make_pipeline_links(pg, static_cast<int64_t>(stages_.size()) > places);
  const dist::ProcessGroupPtr& dg = opts_.data_group;
  if (!dg) return;
  // With a stage group, a data group joins the replicas of this rank's
  // stages: its ranks must hold the same place in their pipelines (each
  // creates subgroups for its own stages only, and they must match).
  if (pg) {
    Tensor mine = from_vector(std::vector<int64_t>{pg->rank(), pg->size()}, {2}, {kInt64, dg->device()});
    Tensor all = empty({2 * dg->size()}, {kInt64, dg->device()});
    dg->all_gather(mine, all)->wait();
    const std::vector<int64_t> places_of = all.to(cpu_device()).to_vector<int64_t>();
    for (size_t r = 0; r < static_cast<size_t>(dg->size()); ++r) {
      const int64_t their_rank = places_of[2 * r], their_size = places_of[2 * r + 1];
      CHORUS_CHECK(their_rank == pg->rank() && their_size == pg->size(), "Pipeline: rank ", r,
                   " of the data group is rank ", their_rank, " of a ", their_size, "-rank stage group, this one rank ",
                   pg->rank(), " of ", pg->size(), ": a data group must join ranks at one place of their pipelines");
    }
  }
  std::vector<int> all(static_cast<size_t>(dg->size()));
  for (size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
  for (size_t s = 0; s < stages_.size(); ++s) {
    const Stage& st = stages_[s];
    if (!is_local(static_cast<int64_t>(s))) {
      stage_data_groups_.push_back(nullptr);  // another rank's stage
      continue;
    }
    CHORUS_CHECK(!dg->device().is_cuda() || st.device == dg->device(),
                 "Pipeline: the data group's NCCL communicator is on ", dg->device().str(), " but a stage runs on ",
                 st.device.str());
    stage_data_groups_.push_back(dg->new_group(all));
  }
}

void Pipeline::reduce_stage_gradients(size_t s) {
  const Stage& st = stages_[s];
  std::vector<Tensor> params, grads;
  for (const nn::ModulePtr& l : st.layers)
    for (const Tensor& p : l->parameters()) {
      if (!p.requires_grad()) continue;
      params.push_back(p);
      Tensor g = p.grad();
      grads.push_back(g.defined() ? g : zeros(p.sizes(), {p.dtype(), p.device()}));  // unused here: 0 to the average
    }
  if (params.empty()) return;
  NoGradGuard ng;
  const dist::FlatLayout layout(grads);
  std::vector<Tensor> flats;
  for (size_t gi = 0; gi < layout.groups(); ++gi)
    flats.push_back(empty({layout.numels[gi]}, {layout.dtypes[gi], st.device}));
  for (size_t i = 0; i < grads.size(); ++i) layout.view(flats[layout.segments[i].group], i).copy_(grads[i]);
  for (Tensor& f : flats) stage_data_groups_[s]->all_reduce(f, dist::ReduceOp::Avg)->wait();
  // The gradients become views of the reduced buffers (no copy back).
  for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(layout.view(flats[layout.segments[i].group], i));
}

// Note [Pipeline links]: NCCL matches a link's messages by their order
// alone. The lists are a function of (schedule or forwards only, ranks,
// stages, micro-batches) -- the virtual stages are stages / ranks -- so the
// check runs once per such configuration; one that fails is not remembered,
// and fails again.
void Pipeline::check_link_order(const std::vector<std::vector<PipeTask>>& lists, int stages, int micro_batches,
                                bool forwards_only) const {
  const dist::ProcessGroupPtr& pg = opts_.stage_group;
  const LinkOrderKey key{forwards_only, static_cast<int>(opts_.schedule), pg->size(), stages, micro_batches};
  if (links_checked_.count(key)) return;
  const std::string mismatch = link_order_mismatch(lists, stages);
  CHORUS_CHECK(mismatch.empty(), "Pipeline: the ", schedule_name(opts_.schedule), " schedule over ", pg->size(),
               " processes would deadlock on NCCL: ", mismatch);
  links_checked_.insert(key);
}

}  // namespace chorus::parallel
