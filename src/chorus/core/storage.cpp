#include "chorus/core/storage.h"

#include "chorus/core/backend.h"

namespace chorus {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = backend(device).allocate(nbytes, device);
}

Storage::~Storage() {
  if (data_ != nullptr) backend(device_).deallocate(data_, device_);
}

// Note [Released storage] (storage.h).
void Storage::release() {
  if (data_ == nullptr) return;
  backend(device_).deallocate(data_, device_);
  data_ = nullptr;
}

void Storage::reallocate() {
  if (data_ == nullptr && nbytes_ > 0) data_ = backend(device_).allocate(nbytes_, device_);
}

}  // namespace chorus
