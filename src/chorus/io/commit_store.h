// CommitStore: what a sharded checkpoint's save needs of the job's processes
// to commit together (Note [Sharded commit] in io/sharded_checkpoint.h): a
// key-value store every rank reaches. io/ does not depend on the distributed
// runtime: apps/ (and tests) adapt the job's dist::Store to it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace chorus::io {

class CommitStore {
 public:
  virtual ~CommitStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of `key` (waiting for it as the store's default timeout allows).
  virtual std::string get(const std::string& key) = 0;
  // key += delta (0: a read); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether every key is set now.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Until every key is set; throws after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};
using CommitStorePtr = std::shared_ptr<CommitStore>;

}  // namespace chorus::io
