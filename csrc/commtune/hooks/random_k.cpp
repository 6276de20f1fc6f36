#include <commtune/hooks/random_k.h>

#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/random_k.h>

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
  // The same positions on every rank: a hash of (seed, iteration, bucket) and the draw's number,
  // computed by the kernels themselves (kernels/random_k.h).
  const uint64_t seed = quant::mix(quant::mix(static_cast<uint64_t>(options_.seed) ^ static_cast<uint64_t>(iteration())) ^
                                   static_cast<uint64_t>(bucket.getIndex()));
  // With error feedback the take adds the bucket to the error buffer in its own pass, and what is
  // sent leaves that buffer, as does an overflow (values[0] carries it to every rank instead).
  const at::Tensor x = options_.error_feedback ? error_of(bucket) : buffer;
  at::Tensor values = at::empty({k}, x.options());
  random_k_take_(x, seed, values, options_.error_feedback, options_.error_feedback ? buffer : at::Tensor());
  auto future = allreduce_sum(values);
  const int64_t n = world_size();
  auto finish = [buffer, seed, n](const at::Tensor& summed) mutable {
    random_k_place_(summed, seed, buffer, n);
    record_on_current_stream(summed);  // read on the side stream: not to be reused before that
    return buffer;
  };
  const int64_t bytes = k * static_cast<int64_t>(buffer.element_size());
  return Launch{std::move(future), std::move(finish), bytes, wire::allreduce(bytes, n)};
}

} // namespace commtune
