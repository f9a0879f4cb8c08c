// User-facing streams and events (cutorch's / PyTorch's torch.cuda.Stream and
// Event): a Stream is an ordered queue of work on one device, an Event a
// marker in a stream that other streams (or the host) can wait for.
//
// On CPU devices work is synchronous, so streams are trivially ordered and
// events record host time; the same code runs everywhere.
#pragma once

#include <memory>

#include "chorus/core/backend.h"
#include "chorus/core/device.h"

namespace chorus {

class Event;

class Stream {
 public:
  // A new stream on `device` (owned: destroyed with the last copy).
  static Stream create(const Device& device);
  // The thread's current stream of `device` (not owned).
  static Stream current(const Device& device);

  Device device() const { return device_; }
  StreamHandle handle() const { return handle_ ? handle_->h : nullptr; }
  // Work issued to this stream after the call waits for `e`.
  void wait(const Event& e) const;
  // Blocks the host until all work issued to this stream is done.
  void synchronize() const;
  bool operator==(const Stream& o) const { return device_ == o.device_ && handle() == o.handle(); }

 private:
  struct Owned {
    Owned(Device d, StreamHandle s, bool o) : device(d), h(s), owned(o) {}
    Owned(const Owned&) = delete;
    Owned& operator=(const Owned&) = delete;
    ~Owned();
    Device device;
    StreamHandle h;
    bool owned;
  };
  Device device_;
  std::shared_ptr<Owned> handle_;
};

class Event {
 public:
  explicit Event(const Device& device, bool timing = true);
  // Marks the current point of `s` (default: the device's current stream).
  void record();
  void record(const Stream& s);
  // Blocks the host until the marked work is done.
  void synchronize() const;
  bool query() const;
  // Milliseconds between this event and `later` (both recorded, timing on).
  float elapsed(const Event& later) const;
  Device device() const { return device_; }
  EventHandle handle() const { return impl_->h; }

 private:
  struct Impl {
    Impl(Device d, EventHandle e) : device(d), h(e) {}
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl();
    Device device;
    EventHandle h;
  };
  Device device_;
  std::shared_ptr<Impl> impl_;
  bool recorded_ = false;
};

// RAII: makes `s` the current stream of its device for this thread.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Device device_;
  StreamHandle prev_;
};

}  // namespace chorus
