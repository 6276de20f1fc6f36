#include <commtune/error_buffers.h>

namespace commtune {

at::Tensor& ErrorBuffers::of(c10d::GradBucket& bucket, const ParameterIndex& index_of) {
  const at::Tensor& buffer = bucket.getBufferRef();
  Bucket& b = buckets_[bucket.getIndex()];
  const std::vector<at::Tensor> params = bucket.getParameters();
  bool same = b.error.defined() && b.numel == buffer.numel() && b.parameters.size() == params.size();
  for (size_t i = 0; same && i < params.size(); ++i) same = b.parameters[i] == params[i].unsafeGetTensorImpl();
  if (same) return b.error;

  keep(b);  // DDP rebuilt its buckets, or this is the first call
  const std::vector<at::Tensor> grads = bucket.getGradients();
  b.numel = buffer.numel();
  b.error = at::zeros_like(buffer);
  for (size_t k = 0; k < grads.size(); ++k) {
    const Slot slot{index_of(params[k]), grads[k].storage_offset() - buffer.storage_offset(), grads[k].numel()};
    b.parameters.push_back(params[k].unsafeGetTensorImpl());
    b.slots.push_back(slot);
    auto it = kept_.find(slot.parameter);
    if (it != kept_.end()) {  // load() checked its size
      b.error.narrow(0, slot.offset, slot.numel).copy_(it->second.view(-1));
      kept_.erase(it);
    }
  }
  return b.error;
}

void ErrorBuffers::keep(Bucket& b) {
  if (b.error.defined()) {
    for (const Slot& slot : b.slots) kept_[slot.parameter] = b.error.narrow(0, slot.offset, slot.numel).clone();
  }
  b = Bucket{};
}

void ErrorBuffers::save(std::map<std::string, at::Tensor>& state) const {
  for (const auto& [parameter, error] : kept_) state["error." + std::to_string(parameter)] = error;
  for (const auto& [index, b] : buckets_) {
    if (!b.error.defined()) continue;
    for (const Slot& slot : b.slots) {
      state["error." + std::to_string(slot.parameter)] = b.error.narrow(0, slot.offset, slot.numel).clone();
    }
  }
}

void ErrorBuffers::load(const std::map<std::string, at::Tensor>& state, const std::string& hook,
                        const EntryIndex& index_of) {
  std::unordered_map<int64_t, at::Tensor> loaded;
  for (const auto& [key, value] : state) {
    if (key == "iteration") continue;
    TORCH_CHECK(key.rfind("error.", 0) == 0, "commtune.", hook, ": unknown state_dict entry '", key, "'");
    loaded[index_of(key, value)] = value.clone();
  }
  // Only once every entry has passed: a refused state_dict leaves the hook as it was.
  buckets_.clear();
  kept_ = std::move(loaded);
}

} // namespace commtune
