#pragma once
#include <commtune/error_buffers.h>

namespace commtune {

// Top-k sparsification with error feedback: each rank sends the k = ceil(ratio * numel) entries
// of largest magnitude (values and int32 indices in one all-gather); every rank adds the
// ranks' entries into a zero bucket in rank order and divides by the world size. What was not
// sent stays in the error buffer for the next iteration. Selection is torch's topk (a radix
// select on CUDA, not a full sort), so k is exact.
class TopKHook : public ErrorFeedbackHook {
 public:
  struct Options {
    double ratio = 0.01;
    bool error_feedback = true;
    int64_t min_size = 1 << 16;  // buckets under this many bytes go as a plain mean allreduce
  };
  TopKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  Options options_;
};

} // namespace commtune
