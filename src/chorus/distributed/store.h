// Store: the key-value store processes of one job rendezvous through (the NCCL
// unique id, Gloo's pair addresses, rank check-in). One interface, three
// implementations:
//  - TCPStore (distributed/tcp_store.h): a server on rank 0's MASTER_ADDR:MASTER_PORT
//    and a client in every rank. Its wire protocol is PyTorch's TCPStore
//    protocol, so that under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the
//    workers talk to the store torchrun's agent already serves.
//  - HashStore: in one process (tests, single-process groups).
//  - PrefixStore: a namespace inside another store (subgroups, new_group).
//
// Every blocking call waits at most timeout() and then throws DistError naming
// the keys it waited for and for how long.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace chorus::dist {

using Bytes = std::vector<uint8_t>;

class Store {
 public:
  explicit Store(std::chrono::milliseconds timeout = std::chrono::seconds(300)) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits (up to timeout()) until `key` exists, then returns its value.
  virtual Bytes get(const std::string& key) = 0;
  // Adds `delta` to the integer stored at `key` (absent: 0) and returns the
  // new value. Stored as decimal text, as PyTorch's store does.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // If the value at `key` equals `expected` (absent key: `expected` empty),
  // sets it to `desired`. Returns the value now stored.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // True when every key exists (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists, at most `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  virtual bool delete_key(const std::string& key) = 0;

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Conveniences over the byte interface.
  void set(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key) {
    Bytes b = get(key);
    return std::string(b.begin(), b.end());
  }

 protected:
  std::chrono::milliseconds timeout_;
};

using StorePtr = std::shared_ptr<Store>;

}  // namespace chorus::dist
