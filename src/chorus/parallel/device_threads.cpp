#include "chorus/parallel/device_threads.h"

#include <exception>
#include <optional>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/device_threads.h"
#include "chorus/core/error.h"

namespace chorus::parallel {

void DeviceThreads::run(const std::vector<std::function<void()>>& tasks) {
  CHORUS_ASSERT(tasks.size() <= devices_.size());
  // Grad mode and autocast are thread-local: each task runs under the
  // caller's, as if the caller had run it (a bf16 step must not silently run
  // its replicas in float32). The guards restore the pool thread's own state.
  const bool grad = grad_enabled();
  const std::optional<DType> autocast = current_autocast();
  std::vector<Device> devices(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(tasks.size()));
  std::vector<std::function<void()>> wrapped;
  for (const auto& t : tasks)
    wrapped.push_back([grad, autocast, &t] {
      const bool prev_grad = grad_enabled();
      set_grad_enabled(grad);
      struct RestoreGrad {
        bool prev;
        ~RestoreGrad() { set_grad_enabled(prev); }
      } restore{prev_grad};
      AutocastGuard cast(autocast);
      t();
    });
  std::vector<std::exception_ptr> errors = DeviceThreadPool::global().run(devices, wrapped);
  for (size_t i = 0; i < errors.size(); ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      throw Error("replica on " + devices[i].str() + " failed: " + e.message());
    } catch (const std::exception& e) {
      throw Error("replica on " + devices[i].str() + " failed: " + e.what());
    }
  }
}

}  // namespace chorus::parallel
