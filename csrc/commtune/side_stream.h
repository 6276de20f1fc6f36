#pragma once
// One side stream per device for the GPU work of hooks' continuations.
//
// c10's Future runs each then() callback on the next stream of torch's pool, a different one per
// bucket. Kernels queued that way cost ResNet-50 on an H200 about 1 ms per iteration, however
// small they are; the same kernels on one fixed stream cost nothing measurable
// (benchmarks/results/NOTES.md, "Continuations on one side stream").

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

namespace commtune {

// commtune's side stream on `device` (created on first use, shared by every hook).
c10::Stream side_stream(const c10::Device& device);

// Work queued while a scope lives runs on the side stream, after everything the current stream
// had queued; when the scope ends the current stream waits for that work. On CPU it does nothing.
class SideStreamScope {
 public:
  explicit SideStreamScope(const c10::Device& device);
  ~SideStreamScope();
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;

 private:
  std::optional<c10::impl::VirtualGuardImpl> impl_;
  std::optional<c10::Stream> outer_;
  std::optional<c10::Stream> side_;
  std::optional<c10::StreamGuard> guard_;
};

} // namespace commtune
