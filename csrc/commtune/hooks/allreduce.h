#pragma once
#include <commtune/hook.h>

namespace commtune {

// Mean allreduce of the bucket in place: what DDP does without a hook.
class AllReduceHook : public Hook {
 public:
  struct Options {};
  AllReduceHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;
};

} // namespace commtune
