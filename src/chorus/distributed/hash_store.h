// HashStore: a Store inside one process (threads of one test, a world of one),
// and the table behind TCPStore's server.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>

#include "chorus/distributed/store.h"

namespace chorus::dist {

class HashStore final : public Store {
 public:
  using Store::Store;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys();

  // Waits until every key exists, `cancelled()` says stop (polled every few
  // ms), or `timeout` passes; true when the keys are there.
  bool wait_until(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                  const std::function<bool()>& cancelled);
  // The value of `key` if it exists.
  bool try_get(const std::string& key, Bytes* out);

 private:
  bool has_all(const std::vector<std::string>& keys) const;  // under mu_
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, Bytes> data_;
};

// Throws DistError "timed out after N ms waiting for KEYS".
[[noreturn]] void throw_store_timeout(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                                      const std::string& where);

}  // namespace chorus::dist
