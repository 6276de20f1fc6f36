#pragma once
// PowerSGD (Vogels et al., 2019) with the semantics of torch's powerSGD_hook: plain mean
// allreduce before start_iter; then each bucket's matrices (gradients viewed as
// [size(0), -1]) that pass the min-compression-rate test are sent as P = M Q and
// Q = M^T P (each allreduced as one packed buffer), everything else as one allreduce;
// error feedback and warm-started Q per bucket; Q's first values come from the same seeded
// generators as torch's (numpy's legacy MT19937 picks each torch CPU seed). State is saved
// per parameter, so a run resumed under a new DDP (another bucket layout) continues exactly.
#include <commtune/hook.h>
#include <commtune/kernels/low_rank.h>

#include <c10/core/Event.h>

#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>

namespace commtune {

class PowerSgdHook : public Hook {
 public:
  struct Options {
    int64_t rank = 1;
    int64_t start_iter = 1000;
    double min_compression_rate = 2.0;
    bool error_feedback = true;
    bool warm_start = true;
    double orthogonalization_epsilon = 0.0;
    int64_t seed = 0;
    bool batch_same_shape = false;
    int64_t approx_error_every = 100;  // sample ||M - PQ^T|| / ||M|| every N iterations; 0: never
  };
  PowerSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);

  // What numpy.random.RandomState(seed).randint(1_000_000_000) returns, draw after draw.
  static int64_t draw_torch_seed(std::mt19937& engine, int64_t& words_used);

 protected:
  Launch communicate(c10d::GradBucket& bucket) override;
  void save_state(StateDict& state) const override;
  // approximation_error: ||M - PQ^T|| / ||M|| over the compressed matrices (M with error
  // feedback added) of the latest sampled iteration, on this rank; NaN before the first sample.
  std::map<std::string, double> extra_stats() override;
  void load_state(const StateDict& state) override;

 private:
  // Where one parameter's state sits in its bucket's buffers.
  struct Slot {
    int64_t parameter;
    int64_t offset, numel;  // in the bucket (and error) buffer
    int64_t q_offset = -1, q_numel = 0;  // in q_memory; -1 when sent uncompressed
  };
  // One draw of random Q values: [batch, cols, rank] at q_offset (torch draws per tensor, or
  // per same-shape batch).
  struct QDraw {
    int64_t q_offset, batch, cols, rank;
  };
  struct BucketState {
    at::Tensor error;  // error feedback: what compression left out last time
    at::Tensor p_memory;
    at::Tensor q_memory;
    at::Tensor q_start;  // warm start: the Q it started from, to start again after an overflow
    std::vector<Slot> layout;
    std::vector<const c10::TensorImpl*> parameters;  // the bucket's parameters, in order
    int64_t numel = 0;  // of the bucket
    LowRankPlan plan;  // the compressed matrices and the rest, for the batched kernels
    std::vector<QDraw> draws;
  };
  // Per-parameter state from load_state_dict, placed into a bucket when it first runs.
  struct Restored {
    at::Tensor error, q;
  };

  // Decides what a bucket compresses and where its P, Q and rest live (once per layout).
  void plan_bucket(BucketState& state, const std::vector<at::Tensor>& grads, const at::Tensor& buffer);
  void draw_q(BucketState& state, at::ScalarType dtype);
  // Keeps a bucket's [||M - PQ^T||^2, ||M||^2] (float64 [2], summed over its compressed
  // matrices, still being computed on the current stream) for its iteration's sample.
  void record_sample(int64_t iteration, const at::Tensor& norms);
  static bool holds_same_parameters(const BucketState& state, const std::vector<at::Tensor>& params,
                                    const at::Tensor& buffer);
  // A bucket's error and Q cut into per-parameter copies.
  static std::vector<std::pair<int64_t, Restored>> per_parameter(const BucketState& s);
  // Moves a bucket's state into restored_, per parameter, and empties the bucket.
  void stash(BucketState& state);
  // Fills a new bucket's Q from restored_ if every compressed parameter has one.
  bool restore_q(BucketState& state);

  Options options_;
  std::unordered_map<size_t, BucketState> buckets_;
  std::unordered_map<int64_t, Restored> restored_;
  // Sampled iterations: per bucket, squared norms [residual, input] on the device, and an event
  // after the kernel that writes them (each bucket finishes on a stream of its own).
  struct Sample {
    std::vector<at::Tensor> norms;
    std::vector<std::optional<c10::Event>> written;
  };
  std::mutex samples_mutex_;
  std::map<int64_t, Sample> samples_;
  std::mt19937 engine_;
  int64_t engine_words_ = 0;  // 32-bit words drawn, to restore the engine from a checkpoint
};

} // namespace commtune
