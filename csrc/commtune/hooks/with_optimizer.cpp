#include <commtune/hooks/with_optimizer.h>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>

namespace commtune {
namespace {

void check_options(const OptimizerHook::Options& o) {
  TORCH_CHECK(o.optimizer == "sgd" || o.optimizer == "adamw",
              "commtune.WithOptimizer: optimizer must be \"sgd\" or \"adamw\", got \"", o.optimizer, "\"");
  TORCH_CHECK(o.lr >= 0 && o.momentum >= 0 && o.weight_decay >= 0 && o.eps >= 0,
              "commtune.WithOptimizer: lr, momentum, weight_decay and eps must be >= 0");
  TORCH_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
              "commtune.WithOptimizer: betas must be in [0, 1)");
  TORCH_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
              "commtune.WithOptimizer: nesterov needs momentum > 0 and dampening 0");
}

} // namespace

OptimizerHook::OptimizerHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::unique_ptr<Hook> inner,
                             const Options& options)
    : WrapperHook(std::move(process_group), "WithOptimizer", std::move(inner)), options_(options) {
  check_options(options_);
}

void OptimizerHook::set_hyperparameters(const Options& options) {
  check_options(options);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(options.optimizer == options_.optimizer, "commtune.WithOptimizer: the optimizer is ", options_.optimizer,
              "; it cannot change to ", options.optimizer);
  options_ = options;
}

OptimizerHook::Options OptimizerHook::hyperparameters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_;
}

Hook::Launch OptimizerHook::communicate(c10d::GradBucket& bucket) {
  Launch launch = communicate_inner(bucket);
  auto inner_finish = std::move(launch.finish);
  launch.finish = [this, inner_finish, bucket = c10d::GradBucket(bucket)](const at::Tensor& reduced) {
    at::Tensor result = inner_finish ? inner_finish(reduced) : reduced;
    update(bucket.getParameters(), gradient_views(bucket, result));
    return result;
  };
  return launch;
}

std::vector<OptimizerHook::ParameterState*> OptimizerHook::states_of(const std::vector<at::Tensor>& parameters,
                                                                     bool& first_step) {
  std::vector<ParameterState*> out;
  first_step = false;
  for (const at::Tensor& p : parameters) {
    auto [it, created] = states_.try_emplace(parameter_index(p));
    ParameterState& s = it->second;
    if (created || !s.first.defined()) {
      first_step = true;
      if (options_.optimizer == "adamw") {
        s.step = at::zeros({}, p.options().dtype(at::kFloat));
        s.first = at::zeros_like(p, at::MemoryFormat::Preserve);
        s.second = at::zeros_like(p, at::MemoryFormat::Preserve);
      } else if (options_.momentum > 0) {
        s.first = at::empty_like(p, at::MemoryFormat::Preserve);  // the first step copies the gradient in
      }
    }
    for (at::Tensor* t : {&s.step, &s.first, &s.second}) {
      if (t->defined() && t->device() != p.device()) *t = t->to(p.device());  // loaded on another device
    }
    out.push_back(&s);
  }
  return out;
}

void OptimizerHook::update(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& grads) {
  Options o;
  bool first_step = false;
  std::vector<at::Tensor> steps, firsts, seconds;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    o = options_;
    for (ParameterState* s : states_of(parameters, first_step)) {
      if (s->step.defined()) steps.push_back(s->step);
      if (s->first.defined()) firsts.push_back(s->first);
      if (s->second.defined()) seconds.push_back(s->second);
    }
  }
  // DDP hands parameters over as plain tensors: the update must not be recorded by autograd.
  at::NoGradGuard no_grad;
  if (o.optimizer == "adamw") {
    at::_foreach_add_(steps, 1);  // one launch for the bucket, not one per parameter
    at::_fused_adamw_(parameters, grads, firsts, seconds, /*max_exp_avg_sqs=*/at::TensorList(), steps, o.lr, o.beta1,
                      o.beta2, o.weight_decay, o.eps, /*amsgrad=*/false, o.maximize);
  } else {
    at::_fused_sgd_(parameters, grads, firsts, o.weight_decay, o.momentum, o.lr, o.dampening, o.nesterov, o.maximize,
                    first_step);
  }
}

void OptimizerHook::save_state(StateDict& state) const {
  WrapperHook::save_state(state);
  std::lock_guard<std::mutex> lock(mutex_);
  const bool adamw = options_.optimizer == "adamw";
  for (const auto& [index, s] : states_) {
    const std::string prefix = "optim." + std::to_string(index) + ".";
    if (s.step.defined()) state[prefix + "step"] = s.step;
    if (s.first.defined()) state[prefix + (adamw ? "exp_avg" : "momentum_buffer")] = s.first;
    if (s.second.defined()) state[prefix + "exp_avg_sq"] = s.second;
  }
}

void OptimizerHook::load_state(const StateDict& state) {
  StateDict inner;  // the "optim.*" entries are this hook's; the inner hook refuses entries not its own
  for (const auto& [key, value] : state) {
    if (key.rfind("optim.", 0) != 0) inner.emplace(key, value);
  }
  WrapperHook::load_state(inner);
  load_optimizer_state(state);
}

void OptimizerHook::load_optimizer_state(const StateDict& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool adamw = options_.optimizer == "adamw";
  std::map<int64_t, ParameterState> loaded;
  for (const auto& [key, value] : state) {
    if (key.rfind("optim.", 0) != 0) continue;
    const size_t dot = key.find('.', 6);
    TORCH_CHECK(dot != std::string::npos, "commtune.WithOptimizer: malformed state_dict key '", key, "'");
    const std::string name = key.substr(dot + 1);
    ParameterState& s = loaded[parameter_of_entry(key, "optim.", name == "step" ? -1 : value.numel())];
    // Copies: the caller's tensors stay theirs.
    if (name == "step") {
      s.step = value.to(at::kFloat).clone();
    } else if (name == (adamw ? "exp_avg" : "momentum_buffer")) {
      s.first = value.clone();
    } else if (adamw && name == "exp_avg_sq") {
      s.second = value.clone();
    } else {
      TORCH_CHECK(false, "commtune.WithOptimizer: state_dict key '", key, "' does not belong to ", options_.optimizer);
    }
  }
  states_ = std::move(loaded);
}

} // namespace commtune
