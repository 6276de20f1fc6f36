#include <commtune/hooks/fused.h>

namespace commtune {

FusedHook::FusedHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::unique_ptr<Hook> inner,
                     const Options& options)
    : WrapperHook(std::move(process_group), "Fused", std::move(inner)), options_(options) {
  TORCH_CHECK(options_.min_bytes >= 0, "commtune.Fused: min_bytes must be >= 0, got ", std::to_string(options_.min_bytes));
}

std::map<std::string, double> FusedHook::extra_stats() {
  std::map<std::string, double> out = WrapperHook::extra_stats();
  out["fused_buckets"] = static_cast<double>(held_buckets_.load());
  out["fused_sends"] = static_cast<double>(fused_sends_.load());
  return out;
}

Hook::Launch FusedHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  if (!bucket.isLast() && static_cast<int64_t>(buffer.nbytes()) < options_.min_bytes) {
    std::vector<c10::Device> devices;
    if (!buffer.is_cpu()) devices.push_back(buffer.device());
    Held held{buffer, bucket.getGradients(), bucket.getParameters(),
              c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices)};
    auto future = held.future;
    held_.push_back(std::move(held));
    ++held_buckets_;
    return Launch{future, {}, 0, 0.0};  // sent, and counted, with a later bucket
  }
  return held_.empty() ? communicate_inner(bucket) : send_fused(bucket);
}

Hook::Launch FusedHook::send_fused(c10d::GradBucket& bucket) {
  auto held = std::make_shared<std::vector<Held>>(std::move(held_));
  held_.clear();
  ++fused_sends_;
  // One bucket of the held ones and this one, in order, as the inner hook expects buckets.
  std::vector<at::Tensor> pieces, parameters;
  std::vector<size_t> offsets, lengths;
  std::vector<c10::IntArrayRef> sizes;
  auto own_grads = std::make_shared<std::vector<at::Tensor>>(bucket.getGradients());
  size_t offset = 0;
  auto add = [&](const at::Tensor& buffer, const std::vector<at::Tensor>& views, const std::vector<at::Tensor>& ps) {
    for (const at::Tensor& g : views) {
      offsets.push_back(offset + (g.storage_offset() - buffer.storage_offset()));
      lengths.push_back(g.numel());
      sizes.push_back(g.sizes());
    }
    parameters.insert(parameters.end(), ps.begin(), ps.end());
    pieces.push_back(buffer);
    offset += buffer.numel();
  };
  for (const Held& h : *held) add(h.buffer, h.grads, h.parameters);
  const size_t own_offset = offset;
  add(bucket.getBufferRef(), *own_grads, bucket.getParameters());
  const size_t index = bucket.getIndex();
  c10d::GradBucket fused(index, bucket.isLast() ? index + 1 : index + 2, at::cat(pieces), offsets, lengths, sizes,
                         parameters, std::nullopt);
  Launch launch = communicate_inner(fused);

  // If the send fails, the held buckets' futures fail with it (nothing else would complete them).
  launch.future->addCallback([held](c10::ivalue::Future& done) {
    if (done.hasError()) {
      for (Held& h : *held) h.future->setErrorIfNeeded(done.exception_ptr());
    }
  });
  auto inner_finish = std::move(launch.finish);
  at::Tensor own = bucket.getBufferRef();
  launch.finish = [inner_finish, held, own_grads, own_offset, own](const at::Tensor& reduced) mutable {
    at::Tensor result = inner_finish ? inner_finish(reduced) : reduced;
    int64_t at = 0;
    for (Held& h : *held) {
      h.buffer.copy_(result.narrow(0, at, h.buffer.numel()));
      at += h.buffer.numel();
      h.future->markCompleted(c10::IValue(h.buffer));
    }
    // Into the bucket's own buffer: the reducer reads a result through storage offsets, so a
    // view into the fused result would be read from its start.
    own.copy_(result.narrow(0, static_cast<int64_t>(own_offset), own.numel()));
    return own;
  };
  return launch;
}

} // namespace commtune
