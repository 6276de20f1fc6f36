#include <commtune/side_stream.h>

#include <c10/core/Event.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace commtune {

c10::Stream side_stream(const c10::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<c10::Device, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    it = streams.emplace(device, impl.getStreamFromGlobalPool(device)).first;
  }
  return it->second;
}

namespace {

void order_after(const c10::Stream& first, const c10::Stream& then) {
  c10::Event event(first.device_type());
  event.record(first);
  event.block(then);
}

} // namespace

SideStreamScope::SideStreamScope(const c10::Device& device) {
  if (device.is_cpu()) {
    return;
  }
  impl_.emplace(device.type());
  outer_ = impl_->getStream(device);
  side_ = side_stream(device);
  order_after(*outer_, *side_);
  guard_.emplace(*side_);
}

SideStreamScope::~SideStreamScope() {
  if (!outer_) {
    return;
  }
  guard_.reset();
  try {
    order_after(*side_, *outer_);
  } catch (const std::exception& e) {
    // A destructor must not throw; a failing device reports again on its next call.
    TORCH_WARN("commtune: could not order the current stream after the side stream: ", e.what());
  }
}

} // namespace commtune
