#include <commtune/hooks/cast.h>

#include <commtune/kernels/cast_scale.h>

namespace commtune {

CastHook::CastHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : Hook(std::move(process_group), "Cast"), options_(options) {
  TORCH_CHECK(options_.dtype == at::kHalf || options_.dtype == at::kBFloat16,
              "commtune.Cast: dtype must be torch.float16 or torch.bfloat16, got ", options_.dtype);
}

Hook::Launch CastHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  at::Tensor copy16 = cast_scale(buffer, 1.0 / world_size(), options_.dtype);
  auto future = allreduce_sum(copy16);
  auto finish = [buffer](const at::Tensor& reduced) mutable {
    buffer.copy_(reduced);
    return buffer;
  };
  const auto bytes = static_cast<int64_t>(copy16.nbytes());
  return Launch{std::move(future), std::move(finish), bytes, wire::allreduce(bytes, world_size())};
}

} // namespace commtune
