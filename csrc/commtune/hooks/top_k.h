#pragma once
#include <commtune/error_buffers.h>

#include <map>
#include <mutex>
#include <string>

namespace commtune {

// Top-k sparsification with error feedback: each rank sends the k = ceil(ratio * numel) entries
// of largest magnitude (values and int32 indices in one all-gather); every rank adds the
// ranks' entries into a zero bucket in rank order and divides by the world size. What was not
// sent stays in the error buffer for the next iteration. Selection "exact" is torch's topk (a
// radix select on CUDA, not a full sort); "threshold" takes up to k entries above a threshold
// estimated from a sample, in one pass over the bucket (kernels/top_k.h), and reports how many
// qualified against k in the counters (topk_qualifying_per_k).
class TopKHook : public ErrorFeedbackHook {
 public:
  enum class Selection { exact, threshold };
  struct Options {
    double ratio = 0.01;
    bool error_feedback = true;
    int64_t min_size = 1 << 16;  // buckets under this many bytes go as a plain mean allreduce
    Selection selection = Selection::exact;
  };
  TopKHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);
  std::map<std::string, double> extra_stats() override;

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  // The piece (values then indices) of the k entries picked from x, after x += add if add is given.
  at::Tensor pick(const at::Tensor& x, int64_t k, const at::Tensor& add);

  Options options_;
  std::mutex qualifying_mutex_;
  at::Tensor qualifying_total_;  // threshold selection: entries that qualified, summed on the device
  int64_t wanted_total_ = 0;  // and the k's
};

} // namespace commtune
