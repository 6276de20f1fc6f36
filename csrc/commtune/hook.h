#pragma once
// The base class of every commtune communication hook.
//
// DDP's reducer calls runHook() once per bucket. The base class opens the
// bucket's counter record, asks the derived hook to launch its communication
// (communicate()), and chains one continuation that finishes the bucket
// (decompression, if any, on the side stream of side_stream.h) and closes the record. Once any hook is registered
// the reducer no longer divides by the world size: every hook must.

#include <commtune/counters.h>
#include <commtune/launch_thread.h>
#include <commtune/wire.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace commtune {

using StateDict = std::map<std::string, at::Tensor>;

class Hook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  Hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::string name);

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) final;

  ~Hook() override;

  const std::string& name() const { return name_; }
  // On: communicate() runs on a launch thread of the hook's own, in bucket order, so autograd's
  // thread does not wait for the hook's host work; the last bucket of an iteration still runs
  // on the caller's thread, after the others, so the reducer's own collectives come after ours.
  // Change it between iterations only.
  void set_launch_thread(bool on);
  bool launch_thread() const { return static_cast<bool>(launcher_); }
  Counters& counters() { return *counters_; }
  // Iterations handed over so far (a bucket with isLast() closes one); kept in state_dict.
  int64_t iteration() const { return iteration_; }

  // Hook-specific figures for stats() beyond the counters (may wait on the device).
  virtual std::map<std::string, double> extra_stats() { return {}; }

  StateDict state_dict() const;
  void load_state_dict(const StateDict& state);

  // The model's parameters in a fixed order (module.parameters()): per-parameter state is
  // saved under these indices, since DDP's bucket layout differs between runs.
  virtual void set_parameters(const std::vector<at::Tensor>& parameters);

  // Multiplies each bucket by `scale` before it is communicated (1: not at all). Gradient
  // accumulation sets 1/steps for the step that communicates, so the ranks' mean of the
  // accumulated sums is the mean over every micro-batch. Change it between iterations only.
  void set_input_scale(double scale) { input_scale_ = scale; }
  double input_scale() const { return input_scale_; }

 protected:
  struct Launch {
    Launch() = default;
    // Every field named: a hook that forgets its wire bytes does not compile.
    Launch(c10::intrusive_ptr<c10::ivalue::Future> future, std::function<at::Tensor(const at::Tensor&)> finish,
           int64_t bytes_out, double wire_bytes)
        : future(std::move(future)), finish(std::move(finish)), bytes_out(bytes_out), wire_bytes(wire_bytes) {}
    // Completes with the reduced payload (a tensor, or a list whose first entry it is).
    c10::intrusive_ptr<c10::ivalue::Future> future;
    // Turns the reduced payload into the bucket's result; empty: the payload is the result.
    std::function<at::Tensor(const at::Tensor& reduced)> finish;
    int64_t bytes_out = 0;  // handed to collectives
    double wire_bytes = 0;  // sent by this rank, as wire.h counts each collective
  };

  // Launches the bucket's communication without waiting for it.
  virtual Launch communicate(c10d::GradBucket& bucket) = 0;
  // Hook-specific state beyond the iteration count.
  virtual void save_state(StateDict& /*state*/) const {}
  virtual void load_state(const StateDict& /*state*/) {}

  // Index of a bucket's parameter in set_parameters' list.
  int64_t parameter_index(const at::Tensor& parameter) const;
  // The parameter a per-parameter state_dict entry belongs to: the number that follows `prefix`
  // in `key` ("error.3", "optim.3.exp_avg"), checked against this model, which must have that
  // parameter, with `numel` values where `numel` >= 0. Else the state_dict came from another
  // model, and loading it would silently drop or misplace the state.
  int64_t parameter_of_entry(const std::string& key, const std::string& prefix, int64_t numel) const;

  friend class WrapperHook;  // runs an inner hook's communicate() and state

  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return state_; }
  int world_size() const { return state_->getSize(); }

  // Sum-allreduces `tensor` in place.
  c10::intrusive_ptr<c10::ivalue::Future> allreduce_sum(at::Tensor& tensor) const;
  // gathered = every rank's `mine`, in rank order (world_size() times its size).
  c10::intrusive_ptr<c10::ivalue::Future> all_gather_into(at::Tensor& gathered, at::Tensor& mine) const;
  // received = the world_size() equal parts of every rank's `sent` meant for this one.
  c10::intrusive_ptr<c10::ivalue::Future> all_to_all_equal(at::Tensor& received, at::Tensor& sent) const;
  // Mean-allreduces `tensor` in place. On NCCL the 1/world_size factor rides in
  // the collective (PREMUL_SUM); elsewhere one scale pass runs first.
  c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(at::Tensor& tensor) const;
  // The whole bucket as one mean allreduce, uncompressed, with its bytes counted.
  Launch plain_mean(at::Tensor& buffer) const {
    const auto bytes = static_cast<int64_t>(buffer.nbytes());
    return Launch{allreduce_mean(buffer), nullptr, bytes, wire::allreduce(bytes, world_size())};
  }
  // Runs `work` once `done` has completed. On a GPU it is queued on commtune's side stream
  // (side_stream.h) behind `done`, so the stream of backward does not wait; on CPU the host waits.
  static void after_on_side_stream(const at::Tensor& like, const c10::intrusive_ptr<c10::ivalue::Future>& done,
                                   const std::function<void()>& work);

 private:
  bool backend_is_nccl(const at::Tensor& tensor) const;
  // communicate(), then the continuation that finishes the bucket and closes its record.
  c10::intrusive_ptr<c10::ivalue::Future> launch(c10d::GradBucket& bucket, const CounterTicket& ticket);
  // Posts launch() to the launch thread; the returned future completes with its result.
  c10::intrusive_ptr<c10::ivalue::Future> post_launch(c10d::GradBucket& bucket, const CounterTicket& ticket);

  std::string name_;
  std::shared_ptr<Counters> counters_;  // shared with continuations still in flight
  std::atomic<int64_t> iteration_{0};
  std::atomic<double> input_scale_{1.0};
  std::unordered_map<const c10::TensorImpl*, int64_t> parameter_index_;
  std::vector<at::Tensor> parameters_;  // set_parameters' list, for parameter_of_entry
  std::unique_ptr<LaunchThread> launcher_;
  std::optional<c10::Stream> launch_stream_;  // the launch thread's stream, per hook
};

// Lets the caching allocator reuse a tensor's memory only after the work queued so far on the
// current stream (for tensors a hook uses on streams other than the one they were made on).
void record_on_current_stream(const at::Tensor& t);

// Keeps the reducer, which owns the hook, alive for as long as Python holds it.
struct HookHandle {
  std::shared_ptr<c10d::Reducer> reducer;
  Hook* hook;
};

// A hook built but not registered yet: a reducer takes it, or a wrapper hook takes it inside.
struct BuiltHook {
  std::unique_ptr<Hook> hook;
  // The hook, once; a second take (registering or wrapping it twice) is an error.
  std::unique_ptr<Hook> take();
};

// Registers the built hook on the reducer (once per reducer).
HookHandle register_built(const std::shared_ptr<c10d::Reducer>& reducer, BuiltHook& built);

} // namespace commtune
