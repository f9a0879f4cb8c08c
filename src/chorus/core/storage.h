// Storage: one allocation on one device, shared by every tensor that views it.
// The memory goes back to the device's allocator when the last view is gone.
#pragma once

#include <cstddef>
#include <memory>

#include "chorus/core/device.h"

namespace chorus {

class Storage {
 public:
  // Allocates nbytes on `device` (on its current stream, for a GPU).
  Storage(size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Note [Released storage]: sharded data parallelism at stage 3
  // (data_parallel/sharded.h) frees a unit's gathered weights between their uses while
  // the tensors that view them -- the module's parameters, the inputs the
  // autograd graph saved -- stay; reallocate() gives those same views memory
  // again (PyTorch's FSDP resizes the storage to 0 and back). The contents
  // are lost: the caller writes them anew. Released twice or reallocated while
  // allocated: no-ops.
  void release();
  void reallocate();
  bool released() const { return data_ == nullptr && nbytes_ > 0; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
};

}  // namespace chorus
