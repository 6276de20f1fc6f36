#pragma once
#include <commtune/hook.h>

namespace commtune {

// Sends the bucket as fp16 or bf16: one fused scale-and-cast pass, a sum
// allreduce of the 16-bit copy, and a copy back into the bucket in the continuation.
class CastHook : public Hook {
 public:
  struct Options {
    at::ScalarType dtype = at::kBFloat16;
  };
  CastHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;

 private:
  Options options_;
};

} // namespace commtune
