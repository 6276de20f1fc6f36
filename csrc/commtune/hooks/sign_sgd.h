#pragma once
#include <commtune/error_buffers.h>
#include <commtune/kernels/sign.h>

namespace commtune {

// 1-bit SignSGD with error feedback (EF-SignSGD): each rank sends the signs of its gradients
// (plus what the last round lost) and one scale per chunk, the mean of the chunk's absolute
// values; the pieces are all-gathered and every rank averages their decoded values.
class SignSgdHook : public ErrorFeedbackHook {
 public:
  struct Options {
    int64_t chunk = 1024;  // elements per scale, a multiple of 32
    bool error_feedback = true;
    int64_t min_size = 1 << 16;  // buckets under this many bytes go as a plain mean allreduce
  };
  SignSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  Options options_;
};

} // namespace commtune
