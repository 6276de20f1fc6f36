#pragma once
#include <commtune/error_buffers.h>
#include <commtune/kernels/quantize.h>

namespace commtune {

// Quantized mean (int8, int4 or fp8 e4m3 codes): per-chunk absmax codes exchanged as an all-to-all of shards, each
// rank averaging its own shard and re-encoding it, then an all-gather (each rank sends about
// 2(n-1)/n of the quantized bucket, as a ring allreduce does of the full one). With error
// feedback the first encoding's error is added to the next iteration's gradients.
class QuantizeHook : public ErrorFeedbackHook {
 public:
  struct Options {
    std::string codes = "int8";  // "int8", "int4" (two per byte) or "e4m3" (fp8)
    int64_t chunk = 1024;  // elements per scale
    bool stochastic = true;  // unbiased stochastic rounding; off: round to nearest
    bool error_feedback = true;
    int64_t seed = 0;
    int64_t min_size = 1 << 16;  // buckets under this many bytes go as a plain mean allreduce
  };
  QuantizeHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  // The rounding draws' seed for one pass of one bucket on this rank (-1: round to nearest).
  int64_t draws(const c10d::GradBucket& bucket, int64_t pass) const;

  Options options_;
  quant::Codes codes_;
};

} // namespace commtune
