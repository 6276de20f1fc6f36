#include <commtune/hooks/powersgd.h>

#include <commtune/kernels/orthogonalize.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <map>

namespace commtune {
namespace {

struct Shape {
  int64_t rows, cols;
  bool operator<(const Shape& o) const { return rows != o.rows ? rows < o.rows : cols < o.cols; }
};

struct Member {
  at::Tensor matrix;  // view into the bucket
  size_t slot;  // its entry in the bucket's layout
};

// One compressed unit: a batch [b, n, m] of matrices with its P [b, n, r] and Q [b, m, r].
struct Unit {
  at::Tensor matrices;
  at::Tensor p, q;
  std::vector<at::Tensor> sources;  // the bucket views a stacked batch is copied back into
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

Hook::Launch PowerSgdHook::communicate(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  const int64_t bytes = static_cast<int64_t>(buffer.element_size());
  if (iteration() < options_.start_iter) {
    return Launch{allreduce_mean(buffer), nullptr, static_cast<int64_t>(buffer.nbytes())};
  }
  BucketState& state = buckets_[bucket.getIndex()];
  const std::vector<at::Tensor> grads = bucket.getGradients();
  const std::vector<at::Tensor> params = bucket.getParameters();
  std::vector<Slot> layout;
  for (size_t k = 0; k < grads.size(); ++k) {
    layout.push_back(Slot{parameter_index(params[k]),
                          grads[k].storage_offset() - buffer.storage_offset(), grads[k].numel()});
  }
  if (!same_places(layout, state.layout)) {
    // DDP rebuilt its buckets (or a new DDP resumes): carry the state over per parameter.
    stash(state);
  }
  state.layout = std::move(layout);
  const int64_t sampled_iteration = iteration();
  const bool sample = options_.approx_error_every > 0 && sampled_iteration % options_.approx_error_every == 0;
  at::Tensor input_copy;
  if (options_.error_feedback) {
    if (state.error.defined()) {
      buffer.add_(state.error);
    } else {
      state.error = at::zeros_like(buffer);
      for (const Slot& slot : state.layout) {
        auto it = restored_.find(slot.parameter);
        if (it != restored_.end() && it->second.error.defined()) {
          state.error.narrow(0, slot.offset, slot.numel).copy_(it->second.error.view(-1));
          it->second.error = at::Tensor();
        }
      }
      buffer.add_(state.error);
    }
    input_copy = buffer.clone();
  } else if (sample) {
    input_copy = buffer.clone();
  }

  // Which gradients are worth compressing, grouped by shape in order of first appearance.
  std::vector<Shape> order;
  std::map<Shape, std::vector<Member>> groups;
  std::vector<at::Tensor> uncompressed;
  int64_t p_size = 0, q_size = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& grad = grads[k];
    if (grad.dim() == 0) {
      uncompressed.push_back(grad);
      continue;
    }
    at::Tensor matrix = grad.view({grad.size(0), -1});
    const int64_t n = matrix.size(0), m = matrix.size(1);
    const int64_t r = std::min({n, m, options_.rank});
    if (static_cast<double>((n + m) * r) * options_.min_compression_rate < static_cast<double>(n * m)) {
      const Shape shape{n, m};
      if (!groups.count(shape)) {
        order.push_back(shape);
      }
      groups[shape].push_back(Member{matrix, k});
      p_size += n * r;
      q_size += m * r;
    } else {
      uncompressed.push_back(grad);
    }
  }

  bool randomize = !options_.warm_start || !state.q_memory.defined();
  if (randomize) {
    state.p_memory = at::empty({p_size}, buffer.options());
    state.q_memory = at::empty({q_size}, buffer.options());
  }
  std::vector<Unit> units;
  int64_t p_at = 0, q_at = 0;
  for (const Shape& shape : order) {
    std::vector<Member>& members = groups[shape];
    std::vector<std::vector<Member>> batches;
    if (options_.batch_same_shape) {
      batches.push_back(members);
    } else {
      for (const Member& t : members) batches.push_back({t});
    }
    const int64_t r = std::min({shape.rows, shape.cols, options_.rank});
    for (std::vector<Member>& batch : batches) {
      const int64_t b = static_cast<int64_t>(batch.size());
      Unit u;
      for (int64_t i = 0; i < b; ++i) {
        Slot& slot = state.layout[batch[i].slot];
        slot.q_offset = q_at + i * shape.cols * r;
        slot.q_numel = shape.cols * r;
        if (b > 1) u.sources.push_back(batch[i].matrix);
      }
      u.matrices = b == 1 ? batch[0].matrix.unsqueeze(0) : at::stack(u.sources);
      u.p = state.p_memory.narrow(0, p_at, b * shape.rows * r).view({b, shape.rows, r});
      u.q = state.q_memory.narrow(0, q_at, b * shape.cols * r).view({b, shape.cols, r});
      p_at += b * shape.rows * r;
      q_at += b * shape.cols * r;
      units.push_back(std::move(u));
    }
  }

  if (randomize && options_.warm_start) {
    randomize = !restore_q(state);
  }
  if (randomize) {
    // As torch: one CPU generator per bucket, seeded by the shared numpy-style engine.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(draw_torch_seed(engine_, engine_words_));
    for (Unit& u : units) {
      u.q.copy_(at::randn(u.q.sizes(), gen, at::TensorOptions().dtype(buffer.scalar_type())));
    }
  }
  for (Unit& u : units) {
    orthogonalize_(u.q, options_.orthogonalization_epsilon);
    at::bmm_out(u.p, u.matrices, u.q);
  }

  // Collectives in the same order on every rank: the uncompressed rest, P, then Q. The wait
  // for P is a host wait on gloo and a stream wait on NCCL.
  at::Tensor rest = uncompressed.empty()
                        ? at::empty({0}, buffer.options())
                        : at::cat([&] {
                            std::vector<at::Tensor> flat;
                            for (const at::Tensor& t : uncompressed) flat.push_back(t.reshape(-1));
                            return flat;
                          }());
  auto rest_future = allreduce_sum(rest);
  allreduce_sum(state.p_memory)->wait();
  for (Unit& u : units) {
    orthogonalize_(u.p, options_.orthogonalization_epsilon);
    at::bmm_out(u.q, u.matrices.transpose(1, 2), u.p);
  }
  auto q_future = allreduce_sum(state.q_memory);

  const int64_t n = world_size();
  const bool warm = options_.warm_start;
  BucketState* kept = &state;  // buckets_ never erases: the pointer stays valid
  auto finish = [=](const at::Tensor& reduced_q) mutable {
    rest_future->wait();
    rest.div_(n);
    int64_t at = 0;
    for (const at::Tensor& t : uncompressed) {
      t.copy_(rest.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
    reduced_q.div_(n);
    for (Unit& u : units) {
      at::bmm_out(u.matrices, u.p, u.q.transpose(1, 2));
      for (size_t i = 0; i < u.sources.size(); ++i) {
        u.sources[i].copy_(u.matrices[i]);
      }
    }
    if (sample) {
      // Norms stay on the device; extra_stats() reads them, so nothing waits here.
      std::vector<at::Tensor> residual, input;
      for (const Slot& slot : kept->layout) {
        if (slot.q_offset < 0) continue;
        at::Tensor m = input_copy.narrow(0, slot.offset, slot.numel);
        residual.push_back((m - buffer.narrow(0, slot.offset, slot.numel)).square().sum());
        input.push_back(m.square().sum());
      }
      if (!residual.empty()) {
        at::Tensor pair = at::stack({at::stack(residual).sum(), at::stack(input).sum()}).to(at::kDouble);
        std::lock_guard<std::mutex> lock(samples_mutex_);
        at::Tensor& total = samples_[sampled_iteration];
        total = total.defined() ? total + pair : pair;
      }
    }
    if (options_.error_feedback) {
      kept->error = input_copy - buffer;
    }
    if (!warm) {
      kept->p_memory = at::Tensor();
      kept->q_memory = at::Tensor();
    }
    return buffer;
  };
  const int64_t bytes_out = (rest.numel() + p_size + q_size) * bytes;
  return Launch{std::move(q_future), std::move(finish), bytes_out};
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
    at::Tensor pair = it->second.cpu();
    value = std::sqrt(pair[0].item<double>() / pair[1].item<double>());
    at = it->first;
    break;
  }
  return {{"approximation_error", value}, {"approximation_error_iteration", static_cast<double>(at)}};
}

bool PowerSgdHook::same_places(const std::vector<Slot>& a, const std::vector<Slot>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].parameter != b[i].parameter || a[i].offset != b[i].offset) return false;
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
    if (it == restored_.end() || !it->second.q.defined() || it->second.q.numel() != slot.q_numel) {
      return false;  // not every compressed parameter has its Q: start this bucket afresh
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
  engine_.seed(static_cast<uint32_t>(options_.seed));
  engine_words_ = words->second.item<int64_t>();
  engine_.discard(static_cast<unsigned long long>(engine_words_));
  buckets_.clear();
  restored_.clear();
  for (const auto& [key, value] : state) {
    const auto dot = key.find('.');
    if (key == "iteration" || key == "rng_words") continue;
    TORCH_CHECK(dot != std::string::npos, "commtune.PowerSGD: unknown state_dict entry '", key, "'");
    const std::string kind = key.substr(0, dot);
    const int64_t parameter = std::stoll(key.substr(dot + 1));
    if (kind == "error") restored_[parameter].error = value.clone();
    else if (kind == "q_memory") restored_[parameter].q = value.clone();
    else TORCH_CHECK(false, "commtune.PowerSGD: unknown state_dict entry '", key, "'");
  }
}

} // namespace commtune
