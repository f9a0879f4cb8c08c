#include "chorus/distributed/collective_watch.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <vector>

#include "chorus/distributed/roll_call.h"

namespace chorus::dist {

namespace {

std::string bytes_text(int64_t b) {
  char buf[32];
  if (b >= (1 << 20)) std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(b) / (1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f kB", static_cast<double>(b) / 1024);
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

CollectiveWatch::CollectiveWatch(StorePtr store, std::string group, std::string backend, int rank, int size,
                                 std::chrono::milliseconds timeout, size_t keep)
    : store_(std::move(store)), group_(std::move(group)), backend_(std::move(backend)), rank_(rank), size_(size),
      timeout_(timeout), warn_after_(timeout / 4),
      presence_after_(std::min<std::chrono::milliseconds>(timeout / 16, std::chrono::seconds(1))), keep_(keep) {
  if (size_ > 1 && store_) thread_ = std::thread([this] { watch(); });
}

CollectiveWatch::~CollectiveWatch() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CollectiveWatch::begin(const char* op, uint64_t seq, int64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry e;
  e.op = op;
  e.seq = seq;
  e.bytes = bytes;
  e.start = std::chrono::steady_clock::now();
  log_.push_back(std::move(e));
  // Forget the oldest finished ones; those in flight stay until they end.
  for (auto it = log_.begin(); log_.size() > keep_ && it != log_.end();)
    it = it->seconds >= 0 ? log_.erase(it) : std::next(it);
}

void CollectiveWatch::end(uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  // Newest first: the one ending is usually among the last begun.
  for (auto it = log_.rbegin(); it != log_.rend(); ++it)
    if (it->seq == seq && it->seconds < 0) {
      it->seconds = since(it->start);
      return;
    }
}

void CollectiveWatch::end_all() {
  std::lock_guard<std::mutex> lk(mu_);
  for (Entry& e : log_)
    if (e.seconds < 0) e.seconds = since(e.start);
}

std::string CollectiveWatch::recent() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out;
  for (const Entry& e : log_) {
    char line[160];
    if (e.seconds >= 0)
      std::snprintf(line, sizeof line, "  #%llu %s %s %.3f s\n", static_cast<unsigned long long>(e.seq), e.op.c_str(),
                    bytes_text(e.bytes).c_str(), e.seconds);
    else
      std::snprintf(line, sizeof line, "  #%llu %s %s running for %.1f s\n", static_cast<unsigned long long>(e.seq),
                    e.op.c_str(), bytes_text(e.bytes).c_str(), since(e.start));
    out += line;
  }
  return out;
}

void CollectiveWatch::watch() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, std::chrono::milliseconds(50));
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    std::vector<uint64_t> to_mark;
    Entry* oldest = nullptr;
    for (Entry& e : log_) {
      if (e.seconds >= 0) continue;
      if (!oldest) oldest = &e;
      if (!e.marked && now - e.start >= presence_after_) {
        e.marked = true;
        to_mark.push_back(e.seq);
      }
    }
    if (!to_mark.empty()) {
      lk.unlock();  // the store may take a while; the group must not wait for it
      for (uint64_t seq : to_mark) mark_arrived(*store_, group_, rank_, seq);
      lk.lock();
      continue;  // log_ may have changed meanwhile
    }
    if (oldest && oldest->marked && !oldest->warned && now - oldest->start >= warn_after_) {
      oldest->warned = true;
      const Entry copy = *oldest;
      lk.unlock();
      warn(copy);
      lk.lock();
    }
  }
}

int CollectiveWatch::job_rank(int r) const {
  return job_ranks_.empty() ? r : job_ranks_.at(static_cast<size_t>(r));
}

void CollectiveWatch::warn(const Entry& e) {
  const auto grace = presence_after_ + std::chrono::milliseconds(500);
  std::vector<int> missing = not_arrived(*store_, group_, rank_, size_, e.seq, grace);
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Finished meanwhile (a slow rank arrived): nothing to say.
    bool running = false;
    for (const Entry& x : log_) running = running || (x.seq == e.seq && x.seconds < 0);
    if (!running) return;
  }
  std::string who;
  if (missing.size() == 1 && missing[0] == -1) {
    who = "the store cannot be reached either (rank 0 or the launcher may have died)";
  } else if (missing.empty()) {
    who = "every rank has arrived (the transfer itself is slow)";
  } else {
    who = missing.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < missing.size(); ++i) who += (i ? ", " : "") + std::to_string(job_rank(missing[i]));
    who += missing.size() == 1 ? " has" : " have";
    who += " not arrived (stopped, dead, slow, or on another code path)";
  }
  std::fprintf(stderr, "chorus: rank %d: %s %s%s #%llu (%s) has waited %.1f s of its %.0f s timeout: %s\n",
               job_rank(rank_), backend_.c_str(), e.op.c_str(), job_ranks_.empty() ? "" : (" of group " + group_).c_str(), static_cast<unsigned long long>(e.seq), bytes_text(e.bytes).c_str(),
               since(e.start), static_cast<double>(timeout_.count()) / 1000.0, who.c_str());
  std::fflush(stderr);
}

}  // namespace chorus::dist
