#include <commtune/hooks/top_k.h>

#include <cmath>

namespace commtune {

TopKHook::TopKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : ErrorFeedbackHook(std::move(process_group), "TopK"), options_(options) {
  check_ratio(options_.ratio);
  check_min_size(options_.min_size);
}

Hook::Launch TopKHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (static_cast<int64_t>(buffer.nbytes()) < options_.min_size) {
    return plain_mean(buffer);
  }
  TORCH_CHECK(buffer.numel() < (int64_t{1} << 31), "commtune.TopK: a bucket of ", buffer.numel(),
              " elements is too large for int32 indices; lower bucket_cap_mb");
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(options_.ratio * buffer.numel())));
  const at::Tensor x = options_.error_feedback ? add_to_error(bucket) : buffer;
  const at::Tensor indices = std::get<1>(x.abs().topk(k, 0, /*largest=*/true, /*sorted=*/false));
  // One int32 piece per rank: the values as float32 bits, then the indices.
  at::Tensor piece = at::empty({2 * k}, buffer.options().dtype(at::kInt));
  piece.narrow(0, 0, k).view(at::kFloat).copy_(x.index_select(0, indices));
  piece.narrow(0, k, k).copy_(indices);
  if (options_.error_feedback) {
    x.index_fill_(0, indices, 0);  // sent in full
  }
  const int64_t n = world_size();
  at::Tensor gathered = at::empty({n * 2 * k}, piece.options());
  auto future = process_group()->_allgather_base(gathered, piece)->getFuture();
  auto finish = [buffer, gathered, n, k](const at::Tensor&) mutable {
    at::Tensor sum = at::zeros({buffer.numel()}, buffer.options().dtype(at::kFloat));
    for (int64_t r = 0; r < n; ++r) {  // one rank at a time: no index repeats within a call, a fixed order
      const at::Tensor part = gathered.narrow(0, r * 2 * k, 2 * k);
      sum.index_add_(0, part.narrow(0, k, k).to(at::kLong), part.narrow(0, 0, k).view(at::kFloat));
    }
    buffer.copy_(sum.div_(n));
    record_on_current_stream(gathered);
    return buffer;
  };
  return Launch{std::move(future), std::move(finish), 2 * k * 4};
}

} // namespace commtune
