#include "chorus/parallel/pipeline_links.h"

#include "chorus/core/error.h"
#include "chorus/ops/factory.h"

namespace chorus::parallel {

PipelineLinks& PipelineLinks::operator=(PipelineLinks&& other) noexcept {
  if (this != &other) {
    release();
    out = std::move(other.out);
    in = std::move(other.in);
    created = std::move(other.created);
  }
  return *this;
}

void PipelineLinks::release() noexcept {
  // Note [Pipeline links at exit]: `created` then holds the only references.
  out = {};
  in = {};
  while (!created.empty()) created.pop_back();
}

PipelineLinks make_pipeline_links(const dist::ProcessGroupPtr& group, bool ring) {
  CHORUS_CHECK(group != nullptr, "pipeline links: no process group");
  PipelineLinks links;
  const int P = group->size(), me = group->rank();
  if (P == 1) return links;
  // Note [Pipeline links]: every rank walks the same list of links, creating
  // (new_group counts on every rank) and connecting those it is part of.
  for (int dir = 0; dir < 2; ++dir)
    for (int r = 0; r < P; ++r) {
      const bool wraps = dir == 0 ? r == P - 1 : r == 0;
      if (wraps && !ring) continue;
      const int to = dir == 0 ? (r + 1) % P : (r + P - 1) % P;
      dist::ProcessGroupPtr link = group->new_group({r, to});
      if (!link) continue;
      links.created.push_back(link);
      Tensor hello = zeros({1}, {kFloat32, link->device()});
      if (r == me) {
        links.out[static_cast<size_t>(dir)] = link;
        link->send(hello, PipelineLinks::kReceiver)->wait();
      } else {
        links.in[static_cast<size_t>(dir)] = link;
        link->recv(hello, PipelineLinks::kSender)->wait();
      }
    }
  return links;
}

}  // namespace chorus::parallel
