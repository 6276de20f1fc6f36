#pragma once
// Error-feedback memory of a compressing hook: one buffer per bucket, laid out as the bucket,
// kept per parameter when DDP rebuilds its buckets and in state_dict (DDP's bucket layout
// differs between runs, the parameters do not).
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

  // The bucket's buffer: zeros at first, or what was kept for its parameters.
  at::Tensor& of(c10d::GradBucket& bucket, const ParameterIndex& index_of);
  // Entries "error.<parameter index>".
  void save(std::map<std::string, at::Tensor>& state) const;
  // Takes the "error.*" entries; others are left to the caller.
  void load(const std::map<std::string, at::Tensor>& state);

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

} // namespace commtune
