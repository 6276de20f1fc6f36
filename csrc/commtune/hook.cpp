#include <commtune/hook.h>

#include <commtune/shape.h>
#include <commtune/side_stream.h>

#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include <charconv>
#include <chrono>
#include <optional>

namespace commtune {

Hook::Hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::string name)
    : CppCommHookInterface(std::move(process_group)),
      name_(std::move(name)),
      counters_(std::make_shared<Counters>()) {}

Hook::~Hook() {
  // Nothing is queued once an iteration's backward has finished (the reducer waits for every
  // bucket's future); the reducer, which owns the hook, goes only after that.
  launcher_.reset();
}

void Hook::set_launch_thread(bool on) {
  if (on && !launcher_) {
    launcher_ = std::make_unique<LaunchThread>();
  } else if (!on) {
    launcher_.reset();
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBufferRef();
  TORCH_CHECK(!buffer.is_sparse(),
              "commtune.", name_, ": sparse gradients are not supported (bucket ", std::to_string(bucket.getIndex()),
              "); build the model without sparse gradients (e.g. nn.Embedding(sparse=False))");
  TORCH_CHECK(buffer.is_floating_point(), "commtune.", name_, ": gradient bucket ", std::to_string(bucket.getIndex()),
              " has dtype ", buffer.scalar_type(), "; only floating-point gradients are supported");

  if (input_scale_ != 1.0) {
    bucket.getBufferRef().mul_(input_scale_.load());
  }
  const CounterTicket ticket = counters_->open(bucket.getIndex(), bucket.isLast(), buffer);
  if (!launcher_) {
    return launch(bucket, ticket);
  }
  if (bucket.isLast()) {
    // After the last bucket the reducer may issue collectives of its own (unused-parameter
    // maps): ours must all be on their way first, in the same order on every rank.
    launcher_->drain();
    return launch(bucket, ticket);
  }
  return post_launch(bucket, ticket);
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::post_launch(c10d::GradBucket& bucket, const CounterTicket& ticket) {
  const at::Tensor& buffer = bucket.getBufferRef();
  std::vector<c10::Device> devices;
  std::shared_ptr<c10::Event> ready;
  if (!buffer.is_cpu()) {
    // The launch thread's stream must wait for the gradients this thread's stream writes.
    devices.push_back(buffer.device());
    c10::impl::VirtualGuardImpl impl(buffer.device().type());
    if (!launch_stream_) {
      launch_stream_ = impl.getStreamFromGlobalPool(buffer.device());
    }
    ready = std::make_shared<c10::Event>(buffer.device().type());
    ready->record(impl.getStream(buffer.device()));
  }
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices);
  std::optional<c10::Stream> stream = launch_stream_;
  // The reducer's GradBucket lives only for this call: the task keeps a copy (same tensors).
  launcher_->post([this, bucket = c10d::GradBucket(bucket), ticket, result, ready, stream]() mutable {
    try {
      std::optional<c10::StreamGuard> guard;
      if (ready) {
        guard.emplace(*stream);
        ready->block(*stream);
      }
      launch(bucket, ticket)->addCallback([result](c10::ivalue::Future& done) {
        if (done.hasError()) {
          result->setError(done.exception_ptr());
        } else {
          result->markCompleted(done.value());
        }
      });
    } catch (...) {
      result->setError(std::current_exception());
    }
  });
  return result;
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::launch(c10d::GradBucket& bucket, const CounterTicket& ticket) {
  const auto started = std::chrono::steady_clock::now();
  Launch launch;
  try {
    // Ranges for torch.profiler (and Nsight Systems under torch.autograd.profiler.emit_nvtx()).
    RECORD_FUNCTION("commtune." + name_ + ".communicate", std::vector<c10::IValue>());
    launch = communicate(bucket);
  } catch (...) {
    counters_->drop(ticket);
    throw;
  }
  if (bucket.isLast()) {
    ++iteration_;
  }
  const double host_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count();
  counters_->launched(ticket, host_us, launch.bytes_out, launch.wire_bytes);

  auto counters = counters_;
  auto finish = std::move(launch.finish);
  return launch.future->then(
      [counters, ticket, finish, range = "commtune." + name_ + ".finish"](c10::ivalue::Future& done) -> c10::IValue {
        RECORD_FUNCTION(range, std::vector<c10::IValue>());
        if (done.hasError()) {
          counters->drop(ticket);
          std::rethrow_exception(done.exception_ptr());
        }
        const c10::IValue& value = done.value();
        at::Tensor reduced = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
        // The counters' end event goes on the stream that ran the last of the bucket's work.
        std::optional<SideStreamScope> side;
        at::Tensor result = reduced;
        if (finish) {
          side.emplace(reduced.device());
          result = finish(reduced);
        }
        counters->close(ticket);
        return result;
      },
      c10::TensorType::get());
}

StateDict Hook::state_dict() const {
  StateDict state;
  state["iteration"] = at::scalar_tensor(static_cast<int64_t>(iteration_), at::kLong);
  save_state(state);
  return state;
}

void Hook::load_state_dict(const StateDict& state) {
  auto it = state.find("iteration");
  TORCH_CHECK(it != state.end(), "commtune.", name_, ": state_dict has no 'iteration' entry");
  TORCH_CHECK(it->second.numel() == 1, "commtune.", name_,
              ": state_dict['iteration'] must hold one number, got shape ", shape_of(it->second));
  const int64_t iteration = it->second.item<int64_t>();
  load_state(state);  // may refuse the state_dict: then nothing changes
  iteration_ = iteration;
}

void Hook::set_parameters(const std::vector<at::Tensor>& parameters) {
  parameters_ = parameters;
  parameter_index_.clear();
  for (size_t i = 0; i < parameters.size(); ++i) {
    parameter_index_[parameters[i].unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  }
}

int64_t Hook::parameter_index(const at::Tensor& parameter) const {
  auto it = parameter_index_.find(parameter.unsafeGetTensorImpl());
  TORCH_CHECK(it != parameter_index_.end(), "commtune.", name_,
              ": a bucket holds a parameter that is not in the module's parameters()");
  return it->second;
}

int64_t Hook::parameter_of_entry(const std::string& key, const std::string& prefix, int64_t numel) const {
  int64_t index = -1;
  bool well_formed = key.rfind(prefix, 0) == 0;
  if (well_formed) {
    const char* end = key.data() + key.size();
    const auto [after, error] = std::from_chars(key.data() + prefix.size(), end, index);
    well_formed = error == std::errc() && (after == end || *after == '.');
  }
  TORCH_CHECK(well_formed, "commtune.", name_, ": state_dict entry '", key, "' should be '", prefix,
              "<parameter index>'");
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(parameters_.size()), "commtune.", name_, ": state_dict entry '",
              key, "' belongs to parameter ", std::to_string(index), ", but this model has ",
              std::to_string(parameters_.size()), " parameters: the state_dict was saved from another model");
  const at::Tensor& parameter = parameters_[static_cast<size_t>(index)];
  TORCH_CHECK(numel < 0 || numel == parameter.numel(), "commtune.", name_, ": state_dict entry '", key, "' holds ",
              std::to_string(numel), " values, but parameter ", std::to_string(index), " of this model ",
              shape_of(parameter), " has ", std::to_string(parameter.numel()),
              ": the state_dict was saved from another model");
  return index;
}

bool Hook::backend_is_nccl(const at::Tensor& tensor) const {
  if (!tensor.is_cuda()) {
    return false;
  }
  return process_group()->getBackend(tensor.device().type())->getBackendName() == "nccl";
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::allreduce_sum(at::Tensor& tensor) const {
  std::vector<at::Tensor> tensors{tensor};
  return process_group()->allreduce(tensors)->getFuture();
}

// torch 2.13 named these all_gather_single and all_to_all_single and deprecated the old names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define COMMTUNE_ALL_GATHER_SINGLE all_gather_single
#define COMMTUNE_ALL_TO_ALL_SINGLE all_to_all_single
#else
#define COMMTUNE_ALL_GATHER_SINGLE _allgather_base
#define COMMTUNE_ALL_TO_ALL_SINGLE alltoall_base
#endif

c10::intrusive_ptr<c10::ivalue::Future> Hook::all_gather_into(at::Tensor& gathered, at::Tensor& mine) const {
  return process_group()->COMMTUNE_ALL_GATHER_SINGLE(gathered, mine)->getFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::all_to_all_equal(at::Tensor& received, at::Tensor& sent) const {
  std::vector<int64_t> equal_splits;  // empty: equal parts
  return process_group()->COMMTUNE_ALL_TO_ALL_SINGLE(received, sent, equal_splits, equal_splits)->getFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> Hook::allreduce_mean(at::Tensor& tensor) const {
  c10d::AllreduceOptions options;
  if (world_size() == 1) {
    // The mean of one rank is its value. NCCL's one-rank path would still run a slow
    // scaling pass for PREMUL_SUM (+1.3 ms per ResNet-50 iteration on an H200).
  } else if (backend_is_nccl(tensor)) {
    options.reduceOp.op_ = c10d::ReduceOp::PREMUL_SUM;
    options.reduceOp.supplement_ =
        c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(1.0 / world_size());
  } else {
    tensor.div_(world_size());
  }
  std::vector<at::Tensor> tensors{tensor};
  return process_group()->allreduce(tensors, options)->getFuture();
}

void Hook::after_on_side_stream(const at::Tensor& like, const c10::intrusive_ptr<c10::ivalue::Future>& done,
                                const std::function<void()>& work) {
  std::optional<c10::StreamGuard> side;
  if (!like.is_cpu()) {
    side.emplace(side_stream(like.device()));
  }
  done->wait();
  work();
}

std::unique_ptr<Hook> BuiltHook::take() {
  TORCH_CHECK(hook, "commtune: this hook config was already registered or wrapped; build a new one");
  return std::move(hook);
}

HookHandle register_built(const std::shared_ptr<c10d::Reducer>& reducer, BuiltHook& built) {
  TORCH_CHECK(reducer, "commtune: the DDP module has no reducer");
  std::unique_ptr<Hook> hook = built.take();
  Hook* raw = hook.get();
  reducer->register_comm_hook(std::move(hook));
  return HookHandle{reducer, raw};
}

void record_on_current_stream(const at::Tensor& t) {
  if (!t.defined() || t.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

} // namespace commtune
