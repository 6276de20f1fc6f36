#include <commtune/hooks/allreduce.h>

namespace commtune {

AllReduceHook::AllReduceHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options&)
    : Hook(std::move(process_group), "AllReduce") {}

Hook::Launch AllReduceHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  const auto bytes = static_cast<int64_t>(buffer.nbytes());
  return Launch{allreduce_mean(buffer), nullptr, bytes, wire::allreduce(bytes, world_size())};
}

} // namespace commtune
