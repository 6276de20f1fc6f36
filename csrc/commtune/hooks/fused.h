#pragma once
// Bucket fusion: buckets smaller than min_bytes are held and sent together with the next one
// (the last bucket always sends), so small buckets stop paying a collective's latency each.
// Every held bucket's future completes with its share of the fused result.
#include <commtune/wrapper_hook.h>

#include <atomic>

namespace commtune {

class FusedHook : public WrapperHook {
 public:
  struct Options {
    int64_t min_bytes = 1 << 20;
  };
  FusedHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::unique_ptr<Hook> inner, const Options& options);

  std::map<std::string, double> extra_stats() override;

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  struct Held {
    at::Tensor buffer;
    std::vector<at::Tensor> grads;  // views of buffer (they own the sizes the fused bucket refers to)
    std::vector<at::Tensor> parameters;
    c10::intrusive_ptr<c10::ivalue::Future> future;  // what the reducer waits on for this bucket
  };
  Launch send_fused(c10d::GradBucket& bucket);

  Options options_;
  std::vector<Held> held_;  // touched by communicate() only, which runs in bucket order
  std::atomic<int64_t> held_buckets_{0};
  std::atomic<int64_t> fused_sends_{0};
};

} // namespace commtune
