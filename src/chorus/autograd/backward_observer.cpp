#include "chorus/autograd/backward_observer.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace chorus::autograd {

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::pair<const void*, std::weak_ptr<BackwardObserver>>> observers;  // (handle, observer)
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: handles may outlive static destruction order
  return *r;
}

}  // namespace

std::shared_ptr<void> add_backward_observer(std::weak_ptr<BackwardObserver> observer) {
  auto handle = std::make_shared<char>(0);
  const void* key = handle.get();
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    r.observers.emplace_back(key, std::move(observer));
  }
  // Unregisters when the last copy of the handle goes.
  return std::shared_ptr<void>(handle.get(), [handle, key](void*) mutable {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    r.observers.erase(std::remove_if(r.observers.begin(), r.observers.end(),
                                     [key](const auto& e) { return e.first == key; }),
                      r.observers.end());
    handle.reset();
  });
}

namespace detail {

std::vector<std::shared_ptr<BackwardObserver>> live_backward_observers() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::shared_ptr<BackwardObserver>> live;
  for (const auto& [key, weak] : r.observers)
    if (auto o = weak.lock()) live.push_back(std::move(o));
  return live;
}

}  // namespace detail

}  // namespace chorus::autograd
