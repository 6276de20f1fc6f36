#pragma once
// Error-feedback memory of a compressing hook: one buffer per bucket, laid out as the bucket,
// kept per parameter when DDP rebuilds its buckets and in state_dict (DDP's bucket layout
// differs between runs, the parameters do not).
#include <commtune/hook.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace commtune {

class ErrorBuffers {
 public:
  using ParameterIndex = std::function<int64_t(const at::Tensor&)>;
  // The parameter an "error.<index>" entry belongs to, checked against the model.
  using EntryIndex = std::function<int64_t(const std::string& key, const at::Tensor& value)>;

  // The bucket's buffer: zeros at first, or what was kept for its parameters.
  at::Tensor& of(c10d::GradBucket& bucket, const ParameterIndex& index_of);
  // Entries "error.<parameter index>".
  void save(std::map<std::string, at::Tensor>& state) const;
  // Takes the "error.*" entries; refuses any other but "iteration" (in `hook`'s name).
  void load(const std::map<std::string, at::Tensor>& state, const std::string& hook, const EntryIndex& index_of);

 private:
  struct Slot {
    int64_t parameter, offset, numel;
  };
  struct Bucket {
    std::vector<const c10::TensorImpl*> parameters;
    std::vector<Slot> slots;
    int64_t numel = 0;
    at::Tensor error;
  };
  // Moves a bucket's buffer into kept_, per parameter.
  void keep(Bucket& bucket);

  std::unordered_map<size_t, Bucket> buckets_;
  std::unordered_map<int64_t, at::Tensor> kept_;
};

// Keeps no Inf or NaN in an error buffer (they become 0; what was sent carries the overflow to
// every rank, for a loss scaler to skip the step): else every later step would send them
// again. One pass over the buffer: only TopK's exact selection still runs it (the other
// kernels zero an overflow as they write the buffer; PowerSGD's in its decompression).
inline void keep_finite(const at::Tensor& error) { error.nan_to_num_(0.0, 0.0, 0.0); }

// Base of the hooks that send a lossy encoding with error feedback: the buffers, kept in
// state_dict per parameter.
class ErrorFeedbackHook : public Hook {
 protected:
  using Hook::Hook;
  void save_state(StateDict& state) const override { errors_.save(state); }
  void load_state(const StateDict& state) override {
    errors_.load(state, name(), [this](const std::string& key, const at::Tensor& value) {
      return parameter_of_entry(key, "error.", value.numel());
    });
  }
  void check_min_size(int64_t min_size) const {
    TORCH_CHECK(min_size >= 0, "commtune.", name(), ": min_size must be >= 0 bytes, got ", std::to_string(min_size));
  }
  void check_ratio(double ratio) const {
    TORCH_CHECK(ratio > 0 && ratio <= 1, "commtune.", name(), ": ratio must be in (0, 1], got ", std::to_string(ratio));
  }
  // The bucket's error buffer as the last step left it. Each hook's first kernel adds the bucket
  // to it in the pass that reads it (error + bucket is what is sent this time), rather than an
  // add_ of its own: one read and one write of the bucket-sized buffer fewer a step.
  at::Tensor error_of(c10d::GradBucket& bucket) {
    return errors_.of(bucket, [this](const at::Tensor& p) { return parameter_index(p); });
  }

 private:
  ErrorBuffers errors_;
};

} // namespace commtune
