#include <commtune/hooks/top_k.h>

#include <commtune/kernels/top_k.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cmath>

namespace commtune {

TopKHook::TopKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : ErrorFeedbackHook(std::move(process_group), "TopK"), options_(options) {
  check_ratio(options_.ratio);
  check_min_size(options_.min_size);
}

// One int32 piece per rank: the values as float32 bits, then the indices. With error feedback
// x is the error buffer and `add` the bucket: the threshold selection adds it in its own pass;
// the picked entries of x are sent in full, so they leave the error buffer.
at::Tensor TopKHook::pick(const at::Tensor& x, int64_t k, const at::Tensor& add) {
  at::Tensor piece = at::empty({2 * k}, x.options().dtype(at::kInt));
  if (options_.selection == Selection::threshold) {
    at::Tensor qualifying = at::empty({1}, x.options().dtype(at::kLong));
    threshold_top_k_(x, k, piece, qualifying, options_.error_feedback, add);  // clears an overflow too
    std::lock_guard<std::mutex> lock(qualifying_mutex_);
    if (!qualifying_total_.defined()) qualifying_total_ = at::zeros({1}, qualifying.options());
    qualifying_total_.add_(qualifying);
    wanted_total_ += k;
    return piece;
  }
  if (add.defined()) x.add_(add);
  // In index order, as top_k_place_ reads a piece (the threshold selection's picks come so).
  const at::Tensor indices =
      std::get<0>(std::get<1>(x.abs().topk(k, 0, /*largest=*/true, /*sorted=*/false)).sort());
  piece.narrow(0, 0, k).view(at::kFloat).copy_(x.index_select(0, indices));
  piece.narrow(0, k, k).copy_(indices);
  if (options_.error_feedback) keep_finite(x.index_fill_(0, indices, 0));
  return piece;
}

std::map<std::string, double> TopKHook::extra_stats() {
  std::lock_guard<std::mutex> lock(qualifying_mutex_);
  if (!qualifying_total_.defined() || wanted_total_ == 0) return {};
  // The sum was added on whatever stream was current: wait for the whole device, then read.
  if (!qualifying_total_.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(qualifying_total_.device().type());
    impl.synchronizeDevice(qualifying_total_.device().index());
  }
  const double qualifying = static_cast<double>(qualifying_total_.cpu().item<int64_t>());
  return {{"topk_qualifying_per_k", qualifying / static_cast<double>(wanted_total_)}};
}

Hook::Launch TopKHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (static_cast<int64_t>(buffer.nbytes()) < options_.min_size) {
    return plain_mean(buffer);
  }
  TORCH_CHECK(buffer.numel() < (int64_t{1} << 31), "commtune.TopK: a bucket of ", std::to_string(buffer.numel()),
              " elements is too large for int32 indices; lower bucket_cap_mb");
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(options_.ratio * buffer.numel())));
  const at::Tensor x = options_.error_feedback ? error_of(bucket) : buffer;
  at::Tensor piece = pick(x, k, options_.error_feedback ? buffer : at::Tensor());
  const int64_t n = world_size();
  at::Tensor gathered = at::empty({n * 2 * k}, piece.options());
  auto future = all_gather_into(gathered, piece);
  auto finish = [buffer, gathered, n](const at::Tensor&) mutable {
    top_k_place_(gathered, buffer, n);  // the ranks' entries summed in rank order, / n; 0 elsewhere
    record_on_current_stream(gathered);
    return buffer;
  };
  return Launch{std::move(future), std::move(finish), 2 * k * 4, wire::all_gather(2 * k * 4, n)};
}

} // namespace commtune
