#include "chorus/core/storage.h"

#include "chorus/core/backend.h"

namespace chorus {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = backend(device).allocate(nbytes, device);
}

Storage::~Storage() { backend(device_).deallocate(data_, device_); }

}  // namespace chorus
