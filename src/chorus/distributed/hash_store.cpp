#include "chorus/distributed/hash_store.h"

#include <string>

#include "chorus/core/error.h"

namespace chorus::dist {

void throw_store_timeout(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                         const std::string& where) {
  std::string names;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) names += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 8) names += ", ... (" + std::to_string(keys.size()) + " keys)";
  CHORUS_THROW(DistError, "store", where.empty() ? "" : " at " + where, ": timed out after ", timeout.count(),
               " ms waiting for ", names);
}

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    data_[key] = value;
  }
  changed_.notify_all();
}

Bytes HashStore::get(const std::string& key) {
  wait({key});
  Bytes out;
  try_get(key, &out);
  return out;
}

bool HashStore::try_get(const std::string& key, Bytes* out) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  *out = it->second;
  return true;
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Bytes& b = data_[key];
    if (!b.empty()) {
      try {
        v = std::stoll(std::string(b.begin(), b.end()));
      } catch (const std::exception&) {
        CHORUS_THROW(DistError, "store: add on key '", key, "', whose value is not an integer");
      }
    }
    v += delta;
    const std::string s = std::to_string(v);
    b.assign(s.begin(), s.end());
  }
  changed_.notify_all();
  return v;
}

Bytes HashStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Bytes now;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = data_.find(key);
    if (it == data_.end()) {
      if (!expected.empty()) return expected;  // PyTorch's rule: absent and expecting a value: unchanged
      data_[key] = desired;
      now = desired;
    } else if (it->second == expected) {
      it->second = desired;
      now = desired;
    } else {
      return it->second;
    }
  }
  changed_.notify_all();
  return now;
}

bool HashStore::has_all(const std::vector<std::string>& keys) const {
  for (const auto& k : keys)
    if (!data_.count(k)) return false;
  return true;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lk(mu_);
  return has_all(keys);
}

bool HashStore::wait_until(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                           const std::function<bool()>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lk(mu_);
  while (!has_all(keys)) {
    if (cancelled && cancelled()) return false;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    changed_.wait_until(lk, cancelled ? std::min(deadline, now + std::chrono::milliseconds(20)) : deadline);
  }
  return true;
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (!wait_until(keys, timeout, nullptr)) throw_store_timeout(keys, timeout, "");
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lk(mu_);
  return data_.erase(key) > 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(data_.size());
}

}  // namespace chorus::dist
