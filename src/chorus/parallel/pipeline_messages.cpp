#include "chorus/parallel/pipeline_messages.h"

#include <algorithm>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/ops/factory.h"
#include "chorus/parallel/pipeline_links.h"

namespace chorus::parallel {

namespace {
constexpr int kHeaderLen = 2 + 8;  // dtype, ndim, sizes
}  // namespace

void send_message(const dist::ProcessGroupPtr& link, const Tensor& v, int header_tag, int data_tag,
                  std::vector<dist::WorkPtr>& sends, std::mutex& sends_mu) {
  Tensor c = v.contiguous();
  std::vector<int64_t> h(kHeaderLen, 0);
  h[0] = static_cast<int64_t>(c.dtype());
  h[1] = c.dim();
  CHORUS_CHECK(c.dim() <= 8, "Pipeline: cannot send a ", c.dim(), "-d tensor between processes (at most 8-d)");
  for (int64_t d = 0; d < c.dim(); ++d) h[static_cast<size_t>(2 + d)] = c.size(d);
  Tensor header = from_vector(h, {kHeaderLen}, {kInt64, link->device()});
  std::lock_guard<std::mutex> g(sends_mu);
  // The sends keep their tensors; a Work is waited for at the end of the
  // step, or here once it is done (its tensors freed then, not every
  // activation sent kept to the end of the step: V times as many with the
  // interleaved schedule).
  std::erase_if(sends, [](const dist::WorkPtr& w) {
    if (!w->is_completed()) return false;
    w->wait();
    return true;
  });
  sends.push_back(link->send(header, PipelineLinks::kReceiver, header_tag));
  sends.push_back(link->send(c, PipelineLinks::kReceiver, data_tag));
}

Tensor recv_message(const dist::ProcessGroupPtr& link, int header_tag, int data_tag, const Device& device,
                    const std::optional<Stream>& side, int from) {
  std::optional<StreamGuard> on_side;
  if (side) on_side.emplace(*side);
  std::vector<int64_t> h;
  {
    Tensor header = zeros({kHeaderLen}, {kInt64, link->device()});
    link->recv(header, PipelineLinks::kSender, header_tag)->wait();
    h = header.to(cpu_device()).to_vector<int64_t>();
  }
  CHORUS_CHECK(h[1] >= 0 && h[1] <= 8, "Pipeline: a malformed header from rank ", from);
  Shape shape(h.begin() + 2, h.begin() + 2 + h[1]);
  Tensor v = empty(shape, {static_cast<DType>(h[0]), device});
  link->recv(v, PipelineLinks::kSender, data_tag)->wait();
  if (!side) return v;
  std::optional<Event> arrived;
  arrived.emplace(device, false);
  arrived->record(*side);
  on_side.reset();
  wait_arrival(v, arrived);  // the compute stream waits for the tensor, and keeps its block until done with it
  return v;
}

void wait_arrival(const Tensor& t, const std::optional<Event>& ready) {
  if (!ready || !t.defined()) return;
  Stream::current(t.device()).wait(*ready);
  backend(t.device()).record_use(t.storage()->data(), t.device(), t.device());
}

}  // namespace chorus::parallel
