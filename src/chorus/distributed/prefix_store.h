// PrefixStore: a namespace inside another store ("<prefix>/<key>"), so that
// subgroups (new_group) and restarts of a job never see each other's keys.
#pragma once

#include "chorus/distributed/store.h"

namespace chorus::dist {

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, StorePtr inner)
      : Store(inner->timeout()), prefix_(std::move(prefix) + "/"), inner_(std::move(inner)) {}
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override { inner_->set(prefix_ + key, value); }
  Bytes get(const std::string& key) override { return inner_->get(prefix_ + key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_->add(prefix_ + key, delta); }
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return inner_->compare_set(prefix_ + key, expected, desired);
  }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(prefixed(keys)); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    inner_->wait(prefixed(keys), timeout);
  }
  bool delete_key(const std::string& key) override { return inner_->delete_key(prefix_ + key); }
  const StorePtr& inner() const { return inner_; }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys) out.push_back(prefix_ + k);
    return out;
  }
  std::string prefix_;
  StorePtr inner_;
};

}  // namespace chorus::dist
