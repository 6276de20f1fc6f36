#include <commtune/wrapper_hook.h>

namespace commtune {

WrapperHook::WrapperHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::string name,
                         std::unique_ptr<Hook> inner)
    : Hook(std::move(process_group), std::move(name)), inner_(std::move(inner)) {
  TORCH_CHECK(inner_, "commtune.", this->name(), ": the inner hook is missing");
  TORCH_CHECK(inner_->process_group().get() == this->process_group().get(), "commtune.", this->name(),
              ": the inner hook was built for another process group");
}

void WrapperHook::set_parameters(const std::vector<at::Tensor>& parameters) {
  Hook::set_parameters(parameters);
  inner_->set_parameters(parameters);
}

Hook::Launch WrapperHook::communicate_inner(c10d::GradBucket& bucket) {
  Launch launch = inner_->communicate(bucket);
  if (bucket.isLast()) {
    ++inner_->iteration_;  // the inner hook's rules (PowerSGD's start_iter) follow its own count
  }
  return launch;
}

void WrapperHook::load_state(const StateDict& state) {
  inner_->load_state_dict(state);  // the same iteration count, and the inner hook's entries
}

std::vector<at::Tensor> gradient_views(const c10d::GradBucket& bucket, const at::Tensor& flat) {
  const at::Tensor& buffer = bucket.getBuffer();
  const std::vector<at::Tensor> parameters = bucket.getParameters();
  const std::vector<at::Tensor> grads = bucket.getGradients();
  std::vector<at::Tensor> views;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t offset = grads[i].storage_offset() - buffer.storage_offset();
    const at::Tensor& p = parameters.at(i);
    // With the parameter's strides, as the reducer lays a dense parameter's gradient out in the
    // bucket (channels_last weights included): fused optimizers want matching layouts.
    views.push_back(p.is_non_overlapping_and_dense()
                        ? flat.as_strided(p.sizes(), p.strides(), flat.storage_offset() + offset)
                        : flat.narrow(0, offset, grads[i].numel()).view(grads[i].sizes()));
  }
  return views;
}

} // namespace commtune
