#include "chorus/core/stream.h"

#include "chorus/core/error.h"

namespace chorus {

Stream::Owned::~Owned() {
  if (owned && h) backend(device).destroy_stream(device, h);
}

Stream Stream::create(const Device& device) {
  check_device(device);
  Stream s;
  s.device_ = device;
  s.handle_ = std::make_shared<Owned>(device, backend(device).create_stream(device), true);
  return s;
}

Stream Stream::current(const Device& device) {
  check_device(device);
  Stream s;
  s.device_ = device;
  s.handle_ = std::make_shared<Owned>(device, backend(device).current_stream(device), false);
  return s;
}

void Stream::wait(const Event& e) const {
  CHORUS_CHECK(e.device().type == device_.type, "Stream::wait: event on ", e.device().str(),
               " cannot order a stream on ", device_.str());
  backend(device_).stream_wait_event(device_, handle(), e.handle());
}

void Stream::synchronize() const { backend(device_).synchronize_stream(device_, handle()); }

Event::Impl::~Impl() { backend(device).destroy_event(device, h); }

Event::Event(const Device& device, bool timing) : device_(device) {
  check_device(device);
  impl_ = std::make_shared<Impl>(device, backend(device).create_event(device, timing));
}

void Event::record() { record(Stream::current(device_)); }

void Event::record(const Stream& s) {
  CHORUS_CHECK(s.device() == device_, "Event::record: event of ", device_.str(), " recorded on a stream of ",
               s.device().str());
  backend(device_).record_event(device_, impl_->h, s.handle());
  recorded_ = true;
}

void Event::synchronize() const { backend(device_).synchronize_event(device_, impl_->h); }

bool Event::query() const { return backend(device_).event_query(device_, impl_->h); }

float Event::elapsed(const Event& later) const {
  CHORUS_CHECK(recorded_ && later.recorded_, "Event::elapsed: both events must be recorded first");
  CHORUS_CHECK(device_ == later.device_, "Event::elapsed: events on ", device_.str(), " and ", later.device_.str());
  return backend(device_).event_elapsed_ms(device_, impl_->h, later.impl_->h);
}

StreamGuard::StreamGuard(const Stream& s) : device_(s.device()), prev_(backend(s.device()).current_stream(s.device())) {
  backend(device_).set_current_stream(device_, s.handle());
}

StreamGuard::~StreamGuard() {
  try {
    backend(device_).set_current_stream(device_, prev_);
  } catch (...) {
  }
}

}  // namespace chorus
