#include <commtune/hooks/quantize.h>


namespace commtune {

QuantizeHook::QuantizeHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : ErrorFeedbackHook(std::move(process_group), "Quantize"), options_(options), codes_(codes_named(options.codes)) {
  TORCH_CHECK(options_.chunk >= 8 && options_.chunk <= 8192 && options_.chunk % 8 == 0,
              "commtune.Quantize: chunk must be a multiple of 8 between 8 and 8192, got ",
              std::to_string(options_.chunk));
  check_min_size(options_.min_size);
}

int64_t QuantizeHook::draws(const c10d::GradBucket& bucket, int64_t pass) const {
  if (!options_.stochastic) return -1;
  uint64_t z = quant::mix(static_cast<uint64_t>(options_.seed) ^ 0x5175616E74697A65ull);
  for (uint64_t word : {static_cast<uint64_t>(iteration()), static_cast<uint64_t>(bucket.getIndex()),
                        static_cast<uint64_t>(process_group()->getRank()), static_cast<uint64_t>(pass)}) {
    z = quant::mix(z ^ word);
  }
  return static_cast<int64_t>(z >> 1);
}

Hook::Launch QuantizeHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (static_cast<int64_t>(buffer.nbytes()) < options_.min_size) {
    return plain_mean(buffer);
  }
  const int64_t n = world_size();
  const QuantizeLayout layout = QuantizeLayout::of(buffer.numel(), n, options_.chunk, codes_);
  // With error feedback the encoding adds the bucket to the error buffer in its own pass.
  const at::Tensor error = options_.error_feedback ? error_of(bucket) : at::Tensor();
  const at::TensorOptions bytes = buffer.options().dtype(at::kByte);
  at::Tensor packed = at::empty({n * layout.piece_bytes()}, bytes);
  quantize_shards_(buffer, error, packed, layout, draws(bucket, 0), options_.error_feedback);

  at::Tensor received = at::empty_like(packed);
  auto sent = all_to_all_equal(received, packed);
  at::Tensor gathered = at::empty_like(packed);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  after_on_side_stream(buffer, sent, [&] {
    at::Tensor mine = at::empty({layout.piece_bytes()}, bytes);
    reduce_shard_(received, mine, layout, n, draws(bucket, 1));
    future = all_gather_into(gathered, mine);
  });
  auto finish = [buffer, gathered, received, layout](const at::Tensor&) mutable {
    dequantize_shards_(gathered, buffer, layout);
    record_on_current_stream(gathered);
    record_on_current_stream(received);  // read on the side stream, which this one is behind
    return buffer;
  };
  // The all-to-all takes the whole quantized bucket, the all-gather this rank's reduced piece.
  const int64_t piece = layout.piece_bytes();
  return Launch{std::move(future), std::move(finish), (n + 1) * piece,
                wire::all_to_all(n * piece, n) + wire::all_gather(piece, n)};
}

} // namespace commtune
