#include <commtune/hooks/sign_sgd.h>

namespace commtune {

SignSgdHook::SignSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : ErrorFeedbackHook(std::move(process_group), "SignSGD"), options_(options) {
  TORCH_CHECK(options_.chunk >= 32 && options_.chunk % 32 == 0,
              "commtune.SignSGD: chunk must be a positive multiple of 32, got ",
              std::to_string(options_.chunk));
  check_min_size(options_.min_size);
}

Hook::Launch SignSgdHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (static_cast<int64_t>(buffer.nbytes()) < options_.min_size) {
    return plain_mean(buffer);
  }
  const SignLayout layout = SignLayout::of(buffer.numel(), options_.chunk);
  // With error feedback the encoding adds the bucket to the error buffer in its own pass.
  const at::Tensor error = options_.error_feedback ? error_of(bucket) : at::Tensor();
  const at::TensorOptions bytes = buffer.options().dtype(at::kByte);
  at::Tensor piece = at::empty({layout.piece_bytes()}, bytes);
  sign_encode_(buffer, error, piece, layout, options_.error_feedback);
  at::Tensor gathered = at::empty({world_size() * layout.piece_bytes()}, bytes);
  auto future = all_gather_into(gathered, piece);
  const int64_t n = world_size();
  auto finish = [buffer, gathered, n, layout](const at::Tensor&) mutable {
    sign_decode_mean_(gathered, buffer, n, layout);
    record_on_current_stream(gathered);
    return buffer;
  };
  return Launch{std::move(future), std::move(finish), layout.piece_bytes(), wire::all_gather(layout.piece_bytes(), n)};
}

} // namespace commtune
