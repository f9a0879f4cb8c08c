#include "train_pipeline.h"

#include <charconv>

#include "chorus/core/error.h"
#include "chorus/models/models.h"
#include "chorus/parallel/placement.h"

namespace chorus::app {

std::vector<int64_t> parse_balance(const std::string& text) {
  std::vector<int64_t> out;
  if (text == "time" || text == "memory") return out;  // measured when the pipeline is built
  size_t pos = 0;
  for (;;) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    CHORUS_CHECK(!item.empty() && ec == std::errc() && ptr == item.data() + item.size() && v >= 1 && v <= 100000,
                 "--balance: '", item, "' is not a layer count from 1 to 100000 (expected e.g. 14,15)");
    out.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

namespace {
std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}
}  // namespace

std::shared_ptr<parallel::Pipeline> make_pipeline(const nn::ModulePtr& model, const std::vector<Device>& devices,
                                                  const PipelineChoice& c, const Tensor& sample,
                                                  std::string* describe) {
  auto layers = models::as_sequential(model);
  parallel::PipelineOptions o;
  o.micro_batches = c.micro_batches;
  o.schedule = parallel::parse_schedule(c.schedule);
  o.checkpoint = parallel::parse_checkpoint(c.recompute);
  o.deferred_batch_norm = c.deferred_batch_norm;
  o.virtual_stages = c.virtual_stages;
  o.measure = c.measure;
  std::vector<int64_t> balance;
  std::string how;
  if (c.balance && *c.balance != "time" && *c.balance != "memory") {
    balance = parse_balance(*c.balance);
    how = "given";
  } else {
    const int64_t v = c.virtual_stages > 0 ? c.virtual_stages : (o.schedule == parallel::Schedule::Interleaved ? 2 : 1);
    const int64_t stages = static_cast<int64_t>(devices.size()) * v;
    CHORUS_CHECK(stages <= static_cast<int64_t>(layers->size()), "--strategy pipeline: ", stages, " stages but ",
                 model->type_name(), " has only ", layers->size(), " layers to split");
    if (c.balance && *c.balance == "memory") {
      balance = parallel::balance_by_memory(*layers, sample, stages);
      how = "by measured memory";
    } else {
      balance = parallel::balance_by_time(*layers, sample, stages, 2);
      how = "by measured time";
    }
  }
  auto pipe = std::make_shared<parallel::Pipeline>(layers, balance, devices, o);
  if (describe) {
    std::string devs;
    for (const Device& d : devices) devs += (devs.empty() ? "" : ",") + d.str();
    *describe = "pipeline: " + std::to_string(layers->size()) + " layers in " + std::to_string(balance.size()) +
                " stages (" + join(balance) + ", " + how + ") over " + devs + ", " + std::to_string(c.micro_batches) +
                " micro-batches, schedule " + c.schedule + ", recompute " + c.recompute;
  }
  return pipe;
}

}  // namespace chorus::app
