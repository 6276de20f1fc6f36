#pragma once
// Optimizer overlap: the optimizer's update of a bucket's parameters runs in that bucket's
// continuation, right after its gradients are reduced, so early buckets' updates run while
// later buckets are still being computed and sent. The update is torch's own fused kernel
// (_fused_sgd_ / _fused_adamw_), over all of the bucket's parameters in one call.
#include <commtune/wrapper_hook.h>

#include <mutex>

namespace commtune {

class OptimizerHook : public WrapperHook {
 public:
  struct Options {
    std::string optimizer = "sgd";  // "sgd" or "adamw"
    // The hyperparameters of torch.optim.SGD / AdamW (the ones the other does not use are ignored).
    double lr = 1e-3;
    double momentum = 0.0;
    double dampening = 0.0;
    bool nesterov = false;
    double weight_decay = 0.0;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    bool maximize = false;
  };
  OptimizerHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::unique_ptr<Hook> inner,
                const Options& options);

  // Takes effect from the next bucket on (ct.OverlappedOptimizer sets them before each forward).
  void set_hyperparameters(const Options& options);
  Options hyperparameters() const;
  // Replaces the per-parameter state by the "optim.*" entries of `state` (see save_state).
  void load_optimizer_state(const StateDict& state);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;
  // Under "optim.<parameter index>.<name>", the names torch's optimizers use in their state.
  void save_state(StateDict& state) const override;
  void load_state(const StateDict& state) override;

 private:
  struct ParameterState {
    at::Tensor step;  // AdamW: float32 scalar on the parameter's device
    at::Tensor first;  // SGD: momentum_buffer; AdamW: exp_avg
    at::Tensor second;  // AdamW: exp_avg_sq
  };
  void update(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& grads);
  // The states of these parameters, created (zeros) for those seen the first time.
  std::vector<ParameterState*> states_of(const std::vector<at::Tensor>& parameters, bool& first_step);

  mutable std::mutex mutex_;  // continuations of different buckets may run on different threads
  Options options_;
  std::map<int64_t, ParameterState> states_;  // by parameter index (std::map: stable addresses)
};

} // namespace commtune
