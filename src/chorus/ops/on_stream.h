// A scope in which this thread's current stream of a device is another one
// (the copy streams of ops/comm's copy-engine paths). Include from ops/ only.
#pragma once

#include "chorus/core/backend.h"

namespace chorus::ops {

class OnStream {
 public:
  OnStream(const Device& device, StreamHandle stream) : device_(device), prev_(backend(device).current_stream(device)) {
    backend(device_).set_current_stream(device_, stream);
  }
  ~OnStream() { backend(device_).set_current_stream(device_, prev_); }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  Device device_;
  StreamHandle prev_;
};

}  // namespace chorus::ops
