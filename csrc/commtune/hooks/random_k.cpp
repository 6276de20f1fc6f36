#include <commtune/hooks/random_k.h>

#include <commtune/kernels/quantize_rules.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace commtune {

RandomKHook::RandomKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : ErrorFeedbackHook(std::move(process_group), "RandomK"), options_(options) {
  check_ratio(options_.ratio);
  check_min_size(options_.min_size);
}

Hook::Launch RandomKHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (static_cast<int64_t>(buffer.nbytes()) < options_.min_size) {
    return plain_mean(buffer);
  }
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(options_.ratio * buffer.numel())));
  // The same positions on every rank: drawn on the host (k numbers) and copied over without
  // waiting (pinned memory), so every rank's device sees the same draw.
  const uint64_t seed = quant::mix(quant::mix(static_cast<uint64_t>(options_.seed) ^ static_cast<uint64_t>(iteration())) ^
                                   static_cast<uint64_t>(bucket.getIndex()));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor positions = at::randint(buffer.numel(), {k}, gen, at::TensorOptions().dtype(at::kLong));
  if (!buffer.is_cpu()) {
    positions = positions.pin_memory().to(buffer.device(), /*non_blocking=*/true);
  }
  const at::Tensor x = options_.error_feedback ? add_to_error(bucket) : buffer;
  at::Tensor values = x.index_select(0, positions);
  // An Inf or NaN the draw missed still reaches every rank, for a loss scaler to skip the step:
  // the first value sent becomes NaN (no host sync, no byte more on the wire).
  values.narrow(0, 0, 1).add_(at::where(at::isfinite(x).all(), 0.0, std::nan("")));
  if (options_.error_feedback) {
    keep_finite(x.index_fill_(0, positions, 0));  // sent in full
  }
  auto future = allreduce_sum(values);
  const int64_t n = world_size();
  auto finish = [buffer, positions, n](const at::Tensor& summed) mutable {
    buffer.zero_();
    buffer.index_copy_(0, positions, summed.div(n));  // a repeated position gets the same value
    record_on_current_stream(positions);
    return buffer;
  };
  const int64_t bytes = k * static_cast<int64_t>(buffer.element_size());
  return Launch{std::move(future), std::move(finish), bytes, wire::allreduce(bytes, n)};
}

} // namespace commtune
