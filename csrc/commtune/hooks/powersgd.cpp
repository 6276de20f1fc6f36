#include <commtune/hooks/powersgd.h>

#include <commtune/error_buffers.h>

#include <commtune/kernels/low_rank.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>

namespace commtune {
namespace {

struct Shape {
  int64_t rows, cols;
  bool operator<(const Shape& o) const { return rows != o.rows ? rows < o.rows : cols < o.cols; }
};

} // namespace

PowerSgdHook::PowerSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : Hook(std::move(process_group), "PowerSGD"),
      options_(options),
      engine_(static_cast<uint32_t>(options.seed)) {
  TORCH_CHECK(options_.rank >= 1, "commtune.PowerSGD: rank must be >= 1");
  TORCH_CHECK(!(options_.error_feedback || options_.warm_start) || options_.start_iter > 1,
              "commtune.PowerSGD: start_iter must be > 1 when error_feedback or warm_start is on");
}

int64_t PowerSgdHook::draw_torch_seed(std::mt19937& engine, int64_t& words_used) {
  // numpy's legacy bounded draw: mask to the smallest power of two above the range, reject.
  constexpr uint32_t kMax = 999999999u;
  constexpr uint32_t kMask = (1u << 30) - 1;
  uint32_t value;
  do {
    value = static_cast<uint32_t>(engine()) & kMask;
    ++words_used;
  } while (value > kMax);
  return value;
}

void PowerSgdHook::plan_bucket(BucketState& state, const std::vector<at::Tensor>& grads, const at::Tensor& buffer) {
  // Which gradients are worth compressing (torch's rule), grouped by shape in order of first
  // appearance: torch's order for P and Q memory and for drawing Q.
  std::vector<Shape> order;
  std::map<Shape, std::vector<size_t>> groups;
  std::vector<bool> compressed(grads.size(), false);
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& grad = grads[k];
    if (grad.dim() == 0) continue;
    const int64_t n = grad.size(0), m = grad.numel() / std::max<int64_t>(n, 1);
    const int64_t r = std::min({n, m, options_.rank});
    if (static_cast<double>((n + m) * r) * options_.min_compression_rate < static_cast<double>(n * m)) {
      const Shape shape{n, m};
      if (!groups.count(shape)) order.push_back(shape);
      groups[shape].push_back(k);
      compressed[k] = true;
    }
  }
  std::vector<LowRankMatrix> matrices;
  int64_t p_at = 0, q_at = 0;
  for (const Shape& shape : order) {
    const std::vector<size_t>& members = groups[shape];
    const int64_t r = std::min({shape.rows, shape.cols, options_.rank});
    // batch_same_shape: one draw of Q for the whole group, as torch's batched tensors.
    const size_t batch = options_.batch_same_shape ? members.size() : 1;
    for (size_t first = 0; first < members.size(); first += batch) {
      state.draws.push_back(QDraw{q_at, static_cast<int64_t>(batch), shape.cols, r});
      for (size_t i = first; i < first + batch; ++i) {
        Slot& slot = state.layout[members[i]];
        slot.q_offset = q_at;
        slot.q_numel = shape.cols * r;
        matrices.push_back(LowRankMatrix{slot.offset, shape.rows, shape.cols, r, p_at, q_at});
        p_at += shape.rows * r;
        q_at += shape.cols * r;
      }
    }
  }
  std::vector<RestSegment> rest;
  int64_t rest_at = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    if (compressed[k]) continue;
    rest.push_back(RestSegment{state.layout[k].offset, state.layout[k].numel, rest_at});
    rest_at += state.layout[k].numel;
  }
  state.plan = LowRankPlan(std::move(matrices), std::move(rest), buffer.device());
}

void PowerSgdHook::draw_q(BucketState& state, at::ScalarType dtype) {
  // As torch: one CPU generator per bucket, seeded by the shared numpy-style engine, then
  // one copy to the bucket's device.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(draw_torch_seed(engine_, engine_words_));
  at::Tensor host = at::empty({state.plan.q_numel()}, at::TensorOptions().dtype(dtype));
  for (const QDraw& d : state.draws) {
    host.narrow(0, d.q_offset, d.batch * d.cols * d.rank)
        .view({d.batch, d.cols, d.rank})
        .copy_(at::randn({d.batch, d.cols, d.rank}, gen, at::TensorOptions().dtype(dtype)));
  }
  state.q_memory.copy_(host);
}

Hook::Launch PowerSgdHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  if (iteration() < options_.start_iter) {
    return plain_mean(buffer);
  }
  BucketState& state = buckets_[bucket.getIndex()];
  const std::vector<at::Tensor> params = bucket.getParameters();
  if (!holds_same_parameters(state, params, buffer)) {
    // DDP rebuilt its buckets (or a new DDP resumes): carry the state over per parameter.
    // The per-gradient views are made only here: they cost host time on every call.
    stash(state);
    const std::vector<at::Tensor> grads = bucket.getGradients();
    for (size_t k = 0; k < grads.size(); ++k) {
      state.layout.push_back(Slot{parameter_index(params[k]),
                                  grads[k].storage_offset() - buffer.storage_offset(), grads[k].numel()});
      state.parameters.push_back(params[k].unsafeGetTensorImpl());
    }
    state.numel = buffer.numel();
    plan_bucket(state, grads, buffer);
  }
  const LowRankPlan& plan = state.plan;
  const double eps = options_.orthogonalization_epsilon;
  const int64_t sampled_iteration = iteration();
  const bool sample = options_.approx_error_every > 0 && sampled_iteration % options_.approx_error_every == 0 &&
                      !plan.matrices().empty();

  // The matrices are read from `input`: the bucket, or with error feedback the error buffer,
  // which takes the bucket in the first pass (torch's bucket + error, without a copy).
  at::Tensor input = buffer, addend;
  if (options_.error_feedback) {
    if (!state.error.defined()) {
      state.error = at::zeros_like(buffer);
      for (const Slot& slot : state.layout) {
        auto it = restored_.find(slot.parameter);
        if (it != restored_.end() && it->second.error.defined()) {
          state.error.narrow(0, slot.offset, slot.numel).copy_(it->second.error.view(-1));
          it->second.error = at::Tensor();
        }
      }
    }
    input = state.error;
    addend = buffer;
  }

  const bool fresh_q = !options_.warm_start || !state.q_memory.defined();
  bool randomize = fresh_q;
  if (randomize) {
    state.q_memory = at::empty({plan.q_numel()}, buffer.options());
  }
  if (randomize && options_.warm_start) {
    randomize = !restore_q(state);
  }
  if (randomize) {
    draw_q(state, buffer.scalar_type());
  }
  if (fresh_q && options_.warm_start) {
    state.q_start = state.q_memory.clone();
  }
  // P and the uncompressed rest share one buffer and one allreduce (torch sends them apart;
  // a sum is a sum): one collective fewer per bucket.
  at::Tensor p_and_rest = at::empty({plan.p_numel() + plan.rest_numel()}, buffer.options());
  state.p_memory = p_and_rest.narrow(0, 0, plan.p_numel());
  at::Tensor rest = p_and_rest.narrow(0, plan.p_numel(), plan.rest_numel());
  orthogonalize_factors_(state.q_memory, Factor::Q, eps, plan);
  low_rank_compress_(input, addend, state.q_memory, state.p_memory, rest, plan);

  // Collectives in the same order on every rank: P with the rest, then Q.
  auto p_future = allreduce_sum(p_and_rest);
  c10::intrusive_ptr<c10::ivalue::Future> q_future;
  after_on_side_stream(buffer, p_future, [&] {
    orthogonalize_factors_(state.p_memory, Factor::P, eps, plan);
    low_rank_project_back_(input, state.p_memory, state.q_memory, plan);
    q_future = allreduce_sum(state.q_memory);
  });

  const int64_t n = world_size();
  const bool error_feedback = options_.error_feedback, warm_start = options_.warm_start;
  PowerSgdHook* self = this;  // the reducer owns the hook and waits for every bucket
  BucketState* kept = &state;  // buckets_ never erases: the pointer stays valid
  auto finish = [=](const at::Tensor& reduced_q) mutable {
    // Q and the rest arrive summed over ranks; the mean is taken inside the writes back.
    const at::Tensor error = error_feedback ? kept->error : at::Tensor();
    const at::Tensor norms = sample ? at::zeros({2}, buffer.options().dtype(at::kDouble)) : at::Tensor();
    low_rank_decompress_(kept->p_memory, reduced_q, rest, n, buffer, error, norms, kept->plan);
    if (sample) {
      self->record_sample(sampled_iteration, norms);
    }
    // An Inf or NaN gradient made this step's output NaN on every rank (a loss scaler skips
    // it); the error buffer and the warm-started Q would keep it for good: the error keeps none
    // of it (the decompression zeroes it as it writes the buffer) and Q starts again from where
    // it started (the same on every rank).
    if (warm_start) {
      kept->q_memory.copy_(at::where(at::isfinite(kept->q_memory).all(), kept->q_memory, kept->q_start));
    }
    if (!warm_start) {
      kept->p_memory = at::Tensor();
      kept->q_memory = at::Tensor();
    }
    record_on_current_stream(p_and_rest);
    return buffer;
  };
  const int64_t bytes_out = (plan.rest_numel() + plan.p_numel() + plan.q_numel()) * buffer.element_size();
  // P (with the uncompressed rest) and Q: one allreduce each.
  return Launch{std::move(q_future), std::move(finish), bytes_out, wire::allreduce(bytes_out, world_size())};
}

void PowerSgdHook::record_sample(int64_t iteration, const at::Tensor& norms) {
  // Nothing waits here: extra_stats() waits for the event before it reads.
  std::optional<c10::Event> written;
  if (!norms.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(norms.device().type());
    written.emplace(norms.device().type());
    written->record(impl.getStream(norms.device()));
  }
  std::lock_guard<std::mutex> lock(samples_mutex_);
  Sample& sample = samples_[iteration];
  sample.norms.push_back(norms);
  sample.written.push_back(std::move(written));
}

std::map<std::string, double> PowerSgdHook::extra_stats() {
  std::lock_guard<std::mutex> lock(samples_mutex_);
  // The newest iteration may still have buckets in flight: report the one before it then.
  while (samples_.size() > 2) samples_.erase(samples_.begin());
  double value = std::numeric_limits<double>::quiet_NaN();
  int64_t at = -1;
  const bool newest_done = samples_.empty() || samples_.rbegin()->first < iteration();
  for (auto it = samples_.rbegin(); it != samples_.rend(); ++it) {
    if (it == samples_.rbegin() && !newest_done) continue;
    double residual = 0, input = 0;
    for (size_t b = 0; b < it->second.norms.size(); ++b) {
      if (it->second.written[b]) it->second.written[b]->synchronize();
      const at::Tensor pair = it->second.norms[b].cpu();
      residual += pair[0].item<double>();
      input += pair[1].item<double>();
    }
    value = std::sqrt(residual / input);
    at = it->first;
    break;
  }
  return {{"approximation_error", value}, {"approximation_error_iteration", static_cast<double>(at)}};
}

bool PowerSgdHook::holds_same_parameters(const BucketState& state, const std::vector<at::Tensor>& params,
                                         const at::Tensor& buffer) {
  // The same parameters in the same order, in a bucket of the same size: the same layout.
  if (!state.plan.defined() || state.numel != buffer.numel() || state.parameters.size() != params.size()) {
    return false;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (state.parameters[i] != params[i].unsafeGetTensorImpl()) return false;
  }
  return true;
}

std::vector<std::pair<int64_t, PowerSgdHook::Restored>> PowerSgdHook::per_parameter(const BucketState& s) {
  std::vector<std::pair<int64_t, Restored>> out;
  for (const Slot& slot : s.layout) {
    Restored r;
    if (s.error.defined()) r.error = s.error.narrow(0, slot.offset, slot.numel).clone();
    if (s.q_memory.defined() && slot.q_offset >= 0) {
      r.q = s.q_memory.narrow(0, slot.q_offset, slot.q_numel).clone();
    }
    out.emplace_back(slot.parameter, std::move(r));
  }
  return out;
}

void PowerSgdHook::stash(BucketState& state) {
  for (auto& [parameter, r] : per_parameter(state)) {
    restored_[parameter] = std::move(r);
  }
  state = BucketState{};
}

bool PowerSgdHook::restore_q(BucketState& state) {
  for (const Slot& slot : state.layout) {
    if (slot.q_offset < 0) continue;
    auto it = restored_.find(slot.parameter);
    if (it == restored_.end() || !it->second.q.defined()) {
      return false;  // not every compressed parameter has its Q: start this bucket afresh
    }
    if (it->second.q.numel() != slot.q_numel) {
      // Q's size is the parameter's columns times the approximation rank: most likely the
      // state_dict was saved with another rank. Starting afresh is sound; say so.
      TORCH_WARN("commtune.PowerSGD: the loaded state_dict's Q of parameter ", std::to_string(slot.parameter),
                 " holds ", std::to_string(it->second.q.numel()), " values, but this hook's (rank ",
                 std::to_string(options_.rank), ") has ", std::to_string(slot.q_numel),
                 ": was it saved with another rank? Its bucket starts from a fresh Q; the error feedback is kept");
      for (const Slot& other : state.layout) {  // the bucket's loaded Qs are of no further use
        auto stale = restored_.find(other.parameter);
        if (stale != restored_.end()) stale->second.q = at::Tensor();
      }
      return false;
    }
  }
  for (const Slot& slot : state.layout) {
    if (slot.q_offset < 0) continue;
    Restored& r = restored_.at(slot.parameter);
    state.q_memory.narrow(0, slot.q_offset, slot.q_numel).copy_(r.q.view(-1));
    r.q = at::Tensor();
  }
  return true;
}

void PowerSgdHook::save_state(StateDict& state) const {
  state["rng_words"] = at::scalar_tensor(engine_words_, at::kLong);
  auto put = [&state](int64_t parameter, const Restored& r) {
    if (r.error.defined()) state["error." + std::to_string(parameter)] = r.error;
    if (r.q.defined()) state["q_memory." + std::to_string(parameter)] = r.q;
  };
  for (const auto& [parameter, r] : restored_) {  // loaded but not used yet: keep it
    put(parameter, r);
  }
  for (const auto& [index, s] : buckets_) {
    for (const auto& [parameter, r] : per_parameter(s)) {
      put(parameter, r);
    }
  }
}

void PowerSgdHook::load_state(const StateDict& state) {
  auto words = state.find("rng_words");
  TORCH_CHECK(words != state.end(), "commtune.PowerSGD: state_dict has no 'rng_words' entry");
  std::unordered_map<int64_t, Restored> loaded;
  for (const auto& [key, value] : state) {
    if (key == "iteration" || key == "rng_words") continue;
    if (key.rfind("error.", 0) == 0) {
      loaded[parameter_of_entry(key, "error.", value.numel())].error = value.clone();
    } else if (key.rfind("q_memory.", 0) == 0) {  // Q's size follows the rank, checked when placed
      loaded[parameter_of_entry(key, "q_memory.", -1)].q = value.clone();
    } else {
      TORCH_CHECK(false, "commtune.PowerSGD: unknown state_dict entry '", key, "'");
    }
  }
  // Only once every entry has passed: a refused state_dict leaves the hook as it was.
  engine_.seed(static_cast<uint32_t>(options_.seed));
  engine_words_ = words->second.item<int64_t>();
  engine_.discard(static_cast<unsigned long long>(engine_words_));
  buckets_.clear();
  restored_ = std::move(loaded);
}

} // namespace commtune
