#include <commtune/hooks/powersgd.h>

#include <commtune/kernels/orthogonalize.h>

#include <ATen/CPUGeneratorImpl.h>

#include <map>

namespace commtune {
namespace {

struct Shape {
  int64_t rows, cols;
  bool operator<(const Shape& o) const { return rows != o.rows ? rows < o.rows : cols < o.cols; }
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
  at::Tensor input_copy;
  if (options_.error_feedback) {
    if (state.error.defined()) {
      buffer.add_(state.error);
    } else {
      state.error = at::zeros_like(buffer);
    }
    input_copy = buffer.clone();
  }

  // Which gradients are worth compressing, grouped by shape in order of first appearance.
  std::vector<Shape> order;
  std::map<Shape, std::vector<at::Tensor>> groups;
  std::vector<at::Tensor> uncompressed;
  int64_t p_size = 0, q_size = 0;
  for (const at::Tensor& grad : bucket.getGradients()) {
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
      groups[shape].push_back(matrix);
      p_size += n * r;
      q_size += m * r;
    } else {
      uncompressed.push_back(grad);
    }
  }

  const bool randomize = !options_.warm_start || !state.p_memory.defined();
  if (randomize) {
    state.p_memory = at::empty({p_size}, buffer.options());
    state.q_memory = at::empty({q_size}, buffer.options());
  }
  std::vector<Unit> units;
  int64_t p_at = 0, q_at = 0;
  for (const Shape& shape : order) {
    std::vector<at::Tensor>& members = groups[shape];
    std::vector<std::vector<at::Tensor>> batches;
    if (options_.batch_same_shape) {
      batches.push_back(members);
    } else {
      for (const at::Tensor& t : members) batches.push_back({t});
    }
    const int64_t r = std::min({shape.rows, shape.cols, options_.rank});
    for (std::vector<at::Tensor>& batch : batches) {
      const int64_t b = static_cast<int64_t>(batch.size());
      Unit u;
      u.matrices = b == 1 ? batch[0].unsqueeze(0) : at::stack(batch);
      if (b > 1) u.sources = batch;
      u.p = state.p_memory.narrow(0, p_at, b * shape.rows * r).view({b, shape.rows, r});
      u.q = state.q_memory.narrow(0, q_at, b * shape.cols * r).view({b, shape.cols, r});
      p_at += b * shape.rows * r;
      q_at += b * shape.cols * r;
      units.push_back(std::move(u));
    }
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
    if (input_copy.defined()) {
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

void PowerSgdHook::save_state(StateDict& state) const {
  state["rng_words"] = at::scalar_tensor(engine_words_, at::kLong);
  for (const auto& [index, s] : buckets_) {
    const std::string i = std::to_string(index);
    if (s.error.defined()) state["error." + i] = s.error;
    if (s.p_memory.defined()) state["p_memory." + i] = s.p_memory;
    if (s.q_memory.defined()) state["q_memory." + i] = s.q_memory;
  }
}

void PowerSgdHook::load_state(const StateDict& state) {
  auto words = state.find("rng_words");
  TORCH_CHECK(words != state.end(), "commtune.PowerSGD: state_dict has no 'rng_words' entry");
  engine_.seed(static_cast<uint32_t>(options_.seed));
  engine_words_ = words->second.item<int64_t>();
  engine_.discard(static_cast<unsigned long long>(engine_words_));
  buckets_.clear();
  for (const auto& [key, value] : state) {
    const auto dot = key.find('.');
    if (dot == std::string::npos) continue;
    const std::string kind = key.substr(0, dot);
    const size_t index = std::stoul(key.substr(dot + 1));
    BucketState& s = buckets_[index];
    at::Tensor copy = value.clone();
    if (kind == "error") s.error = copy;
    else if (kind == "p_memory") s.p_memory = copy;
    else if (kind == "q_memory") s.q_memory = copy;
    else TORCH_CHECK(false, "commtune.PowerSGD: unknown state_dict entry '", key, "'");
  }
}

} // namespace commtune
