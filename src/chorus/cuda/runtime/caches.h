// The two caches every CUDA library wrapper needs, written once:
//  - ThreadHandles<H>: a library handle per (thread, device) — cuBLASLt and
//    cuDNN handles are not thread-safe, and making one costs milliseconds —
//    with a pool of idle handles per device that exiting threads refill. The
//    pool is deliberately leaked: threads return their handles at exit, which
//    may happen during static destruction after the CUDA runtime is gone, so
//    nothing here ever calls into CUDA at exit.
//  - LockedCache<K, V>: the result of an expensive search (an algorithm, an
//    execution plan) per problem key, shared by every thread. Also leaked by
//    its users: device threads may outlive static destruction.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace chorus::cuda {

template <typename Handle>
class ThreadHandles {
 public:
  // The calling thread's handle for `device`: its own, else an idle one from
  // the pool, else create(device).
  template <typename Create>
  static Handle get(int device, Create&& create) {
    auto& mine = mine_.by_device;
    if (mine.size() <= static_cast<size_t>(device)) mine.resize(static_cast<size_t>(device) + 1, Handle{});
    if (mine[device]) return mine[device];
    {
      Pool& p = pool();
      std::lock_guard<std::mutex> lock(p.mu);
      if (p.free_by_device.size() > static_cast<size_t>(device) && !p.free_by_device[device].empty()) {
        mine[device] = p.free_by_device[device].back();
        p.free_by_device[device].pop_back();
        return mine[device];
      }
    }
    mine[device] = create(device);
    return mine[device];
  }

 private:
  struct Pool {
    std::mutex mu;
    std::vector<std::vector<Handle>> free_by_device;
  };
  static Pool& pool() {
    static Pool* p = new Pool;
    return *p;
  }
  struct Mine {
    std::vector<Handle> by_device;
    ~Mine() {
      Pool& p = pool();
      std::lock_guard<std::mutex> lock(p.mu);
      for (size_t d = 0; d < by_device.size(); ++d) {
        if (!by_device[d]) continue;
        if (p.free_by_device.size() <= d) p.free_by_device.resize(d + 1);
        p.free_by_device[d].push_back(by_device[d]);
      }
    }
  };
  static inline thread_local Mine mine_;
};

// A key made of integer fields (a geometry, a GEMM problem) and its hash
// (FNV-1a over the fields), for LockedCache.
template <size_t N>
using IntKey = std::array<int64_t, N>;
struct IntKeyHash {
  template <size_t N>
  size_t operator()(const IntKey<N>& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

template <typename Key, typename Value, typename Hash = IntKeyHash>
class LockedCache {
 public:
  std::optional<Value> find(const Key& k) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(k);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }
  // Keeps the first value stored for `k` (two threads may search at once).
  void insert(const Key& k, Value v) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.emplace(k, std::move(v));
  }
  // Stores `v` for `k`, replacing any value there (a better choice found
  // later: Note [Timed GEMM algorithm search]).
  void assign(const Key& k, Value v) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.insert_or_assign(k, std::move(v));
  }
  // The value for `k`, from search() on first use. The search runs outside
  // the lock (it may take seconds and use this cache's other keys); when two
  // threads search for one key at once, both get their own result and the
  // first stored stays.
  template <typename Search>
  Value get_or_search(const Key& k, Search&& search) {
    if (std::optional<Value> cached = find(k)) return *std::move(cached);
    Value v = search();
    insert(k, v);
    return v;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<Key, Value, Hash> map_;
};

}  // namespace chorus::cuda

namespace chorus::cuda {

// Owned<T, Destroy>: the one RAII style for a library object (cuDNN and
// cuBLASLt descriptors): destroyed by Destroy when its owner goes, movable,
// never copied. Create it through out(): CHECK(cudnnCreateX(d.out())).
template <typename T, auto Destroy>
class Owned {
 public:
  Owned() = default;
  ~Owned() {
    if (h_) (void)Destroy(h_);  // destructors never throw: nothing to report
  }
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, T{})) {}
  Owned& operator=(Owned&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  T get() const { return h_; }
  T* out() { return &h_; }  // for the library's create call; only on an empty owner

 private:
  T h_{};
};

}  // namespace chorus::cuda
