#pragma once
#include <commtune/error_buffers.h>

namespace commtune {

// Random-k sparsification with error feedback: every rank draws the same k = ceil(ratio *
// numel) positions, one in each of k strata, by a hash of (seed, iteration, bucket), on the bucket's
// device (kernels/random_k.h), so only the values travel, in one sum allreduce; the mean lands
// at those positions and zeros elsewhere. What was not sent stays in the error buffer.
class RandomKHook : public ErrorFeedbackHook {
 public:
  struct Options {
    double ratio = 0.01;
    int64_t seed = 0;
    bool error_feedback = true;
    int64_t min_size = 1 << 16;  // buckets under this many bytes go as a plain mean allreduce
  };
  RandomKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  Options options_;
};

} // namespace commtune
