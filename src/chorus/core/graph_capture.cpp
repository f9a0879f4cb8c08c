#include "chorus/core/graph_capture.h"

#include <atomic>
#include <mutex>
#include <string>
#include <utility>

#include "chorus/core/error.h"

namespace chorus {

namespace {

std::atomic<bool> g_capturing{false};
std::mutex g_mu;  // guards g_actions
std::vector<std::function<void()>> g_actions;
std::vector<std::function<void()>> g_checks;
std::atomic<uint64_t> g_generation{0};
std::string g_first_error;  // guarded by g_mu

}  // namespace

bool capture_in_progress() noexcept { return g_capturing.load(std::memory_order_acquire); }

void check_not_capturing(const char* what) {
  if (capture_in_progress())
    CHORUS_THROW(CaptureError, what, " cannot be part of a CUDA graph (the graph replays device work only)");
}

void on_each_replay(std::function<void()> action) {
  if (!capture_in_progress()) {
    action();
    return;
  }
  std::lock_guard<std::mutex> g(g_mu);
  g_actions.push_back(std::move(action));
}

void before_each_replay(std::function<void()> check) {
  if (!capture_in_progress()) {
    check();
    return;
  }
  std::lock_guard<std::mutex> g(g_mu);
  g_checks.push_back(std::move(check));
}

void note_capture_error(const std::string& what) {
  if (!capture_in_progress()) return;
  std::lock_guard<std::mutex> g(g_mu);
  if (g_first_error.empty()) g_first_error = what;
}

std::string first_capture_error() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_first_error;
}

uint64_t capture_generation() noexcept { return g_generation.load(std::memory_order_acquire); }

CaptureScope::CaptureScope() {
  bool expected = false;
  if (!g_capturing.compare_exchange_strong(expected, true, std::memory_order_acq_rel))
    CHORUS_THROW(CaptureError, "a CUDA graph capture is already in progress (one at a time per process)");
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  std::lock_guard<std::mutex> g(g_mu);
  g_actions.clear();
  g_checks.clear();
  g_first_error.clear();
}

CaptureScope::~CaptureScope() {
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_actions.clear();
    g_checks.clear();
  }
  g_capturing.store(false, std::memory_order_release);
}

std::vector<std::function<void()>> CaptureScope::take_actions() {
  std::lock_guard<std::mutex> g(g_mu);
  return std::exchange(g_actions, {});
}

std::vector<std::function<void()>> CaptureScope::take_checks() {
  std::lock_guard<std::mutex> g(g_mu);
  return std::exchange(g_checks, {});
}

}  // namespace chorus
