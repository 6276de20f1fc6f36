#pragma once
// A hook that runs another hook's communication and adds work around it (WithOptimizer, Fused).
// The inner hook is built as usual but never registered: the wrapper is what the reducer calls,
// keeps the counters, and passes the inner hook its iterations, parameters and state.
#include <commtune/hook.h>

#include <memory>

namespace commtune {

class WrapperHook : public Hook {
 public:
  WrapperHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::string name, std::unique_ptr<Hook> inner);

  void set_parameters(const std::vector<at::Tensor>& parameters) override;
  std::map<std::string, double> extra_stats() override { return inner_->extra_stats(); }

 protected:
  // The inner hook's launch for `bucket`; counts the inner hook's iteration as Hook does.
  Launch communicate_inner(c10d::GradBucket& bucket);
  void save_state(StateDict& state) const override { inner_->save_state(state); }
  void load_state(const StateDict& state) override;

  Hook& inner() { return *inner_; }

 private:
  std::unique_ptr<Hook> inner_;
};

// The views of `flat` (a bucket's result) that the bucket's gradients are of its buffer.
std::vector<at::Tensor> gradient_views(const c10d::GradBucket& bucket, const at::Tensor& flat);

} // namespace commtune
