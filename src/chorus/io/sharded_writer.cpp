#include "chorus/io/sharded_writer.h"

#include <chrono>
#include <set>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/warn.h"

namespace chorus::io {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Copies are issued for every tensor first and waited for once per device
// at the end, so a GPU's copies run back to back.
class HostCopier {
 public:
  Tensor operator()(const Tensor& t) {
    if (!t.defined()) return t;
    const Tensor src = t.detach();
    // Contiguous on its own device (stream-ordered), so that nothing reads
    // the host copy before finish() waited for it.
    const Tensor d = src.contiguous();
    devices_.insert(d.device());
    Tensor h = d.to(cpu_device(0));
    // to() and contiguous() hand back the tensor itself when there is
    // nothing to do: the snapshot needs storage of its own.
    return h.storage() == src.storage() ? h.clone() : h;
  }
  void finish() {
    devices_.insert(cpu_device(0));
    for (const Device& d : devices_) synchronize(d);
  }

 private:
  std::set<Device> devices_;
};

}  // namespace

ShardedSave copy_to_host(const ShardedSave& save) {
  HostCopier copy;
  ShardedSave out = save;
  for (ShardPiece& p : out.model) p.values = copy(p.values);
  for (OptimizerPiece& p : out.optimizer)
    for (auto& [name, t] : p.buffers) t = copy(t);
  for (auto& [name, t] : out.replicated_model) t = copy(t);
  for (auto& [name, t] : out.replicated_optimizer) t = copy(t);
  copy.finish();
  return out;
}

ShardedCheckpointWriter::ShardedCheckpointWriter(std::string dir, ShardedSaveOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {}

ShardedCheckpointWriter::~ShardedCheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    warn(std::string("sharded checkpoint: the last background save failed: ") + e.what());
  }
}

void ShardedCheckpointWriter::join_and_rethrow() {
  if (worker_.joinable()) worker_.join();
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(e, error_);
  }
  if (e) std::rethrow_exception(e);
}

std::string ShardedCheckpointWriter::wait() {
  join_and_rethrow();
  std::lock_guard<std::mutex> lock(mu_);
  return last_path_;
}

bool ShardedCheckpointWriter::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

double ShardedCheckpointWriter::last_write_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_write_ms_;
}

double ShardedCheckpointWriter::save(const ShardedSave& save) {
  join_and_rethrow();
  const auto t0 = std::chrono::steady_clock::now();
  ShardedSave host = copy_to_host(save);
  last_stall_ms_ = ms_since(t0);
  ShardedSaveOptions o = options_;
  o.key_prefix += "/save-" + std::to_string(saves_++);
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
  }
  worker_ = std::thread([this, host = std::move(host), o = std::move(o)] {
    const auto start = std::chrono::steady_clock::now();
    std::string path;
    std::exception_ptr error;
    try {
      path = save_sharded_checkpoint(dir_, host, o);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    last_write_ms_ = ms_since(start);
    if (error) error_ = error;
    else last_path_ = path;
  });
  return last_stall_ms_;
}

}  // namespace chorus::io
