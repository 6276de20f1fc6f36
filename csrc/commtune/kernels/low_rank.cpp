#include <commtune/kernels/low_rank.h>

#include <commtune/kernels/orthogonalize.h>
#include <commtune/shape.h>

#include <algorithm>
#include <cstring>

namespace commtune {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Copies a vector of plain int64 records to the device as one int64 tensor.
template <typename Entry>
at::Tensor to_device_table(const std::vector<Entry>& entries, const at::Device& device) {
  static_assert(sizeof(Entry) % sizeof(int64_t) == 0, "table entries are int64 records");
  const int64_t width = sizeof(Entry) / sizeof(int64_t);
  at::Tensor host = at::empty({static_cast<int64_t>(entries.size()), width}, at::kLong);
  if (!entries.empty()) std::memcpy(host.data_ptr<int64_t>(), entries.data(), entries.size() * sizeof(Entry));
  return host.to(device);
}

at::Tensor matrix_view(const at::Tensor& memory, int64_t offset, int64_t rows, int64_t cols) {
  return memory.narrow(0, offset, rows * cols).view({rows, cols});
}

void check_memory(const at::Tensor& t, int64_t numel, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.numel() >= numel && t.is_contiguous(), "PowerSGD low-rank step: ", what,
              " must be a contiguous 1-D tensor of at least ", std::to_string(numel), " elements, got shape ",
              shape_of(t));
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == like.scalar_type(), "PowerSGD low-rank step: ",
              what, " must match the bucket's device and dtype");
}

} // namespace

LowRankPlan::LowRankPlan(std::vector<LowRankMatrix> matrices, std::vector<RestSegment> rest, const at::Device& device)
    : matrices_(std::move(matrices)), rest_(std::move(rest)), defined_(true) {
  for (const LowRankMatrix& m : matrices_) {
    TORCH_INTERNAL_ASSERT(m.rank >= 1 && m.rank <= std::min(m.rows, m.cols));
    max_rank_ = std::max(max_rank_, m.rank);
  }
  const int64_t group = rows_per_group(max_rank_);
  std::vector<FactorEntry> p_factors, q_factors;
  for (LowRankMatrix& m : matrices_) {
    m.group_start = row_groups_;
    m.back_tile_start = back_tiles_;
    m.scratch_offset = scratch_numel_;
    m.q_start = q_numel_;
    row_groups_ += ceil_div(m.rows, group);
    back_tiles_ += ceil_div(m.cols, kBackTileCols) * ceil_div(m.rows, kBackTileRows);
    scratch_numel_ += ceil_div(m.rows, kBackTileRows) * m.cols * m.rank;
    p_numel_ += m.rows * m.rank;
    q_numel_ += m.cols * m.rank;
    max_p_factor_ = std::max(max_p_factor_, m.rows * m.rank);
    max_q_factor_ = std::max(max_q_factor_, m.cols * m.rank);
    p_factors.push_back(FactorEntry{m.p_offset, m.rows, m.rank});
    q_factors.push_back(FactorEntry{m.q_offset, m.cols, m.rank});
  }
  for (RestSegment& s : rest_) {
    s.tile_start = rest_tiles_;
    rest_tiles_ += ceil_div(s.numel, kOutTile);
    rest_numel_ += s.numel;
  }
#ifdef COMMTUNE_WITH_CUDA
  batched_ = device.is_cuda() && max_rank_ <= kMaxKernelRank;
#endif
  if (batched_) {
    matrix_table_ = to_device_table(matrices_, device);
    rest_table_ = to_device_table(rest_, device);
    p_table_ = to_device_table(p_factors, device);
    q_table_ = to_device_table(q_factors, device);
  }
}

void low_rank_compress_(const at::Tensor& src, const at::Tensor& addend, const at::Tensor& q, const at::Tensor& p,
                        const at::Tensor& rest, const LowRankPlan& plan) {
  check_memory(q, plan.q_numel(), src, "Q memory");
  check_memory(p, plan.p_numel(), src, "P memory");
  check_memory(rest, plan.rest_numel(), src, "rest");
  if (addend.defined()) check_memory(addend, src.numel(), src, "addend");
#ifdef COMMTUNE_WITH_CUDA
  if (plan.batched_kernels()) return low_rank_compress_cuda_(src, addend, q, p, rest, plan);
#endif
  if (addend.defined()) src.add_(addend);
  for (const LowRankMatrix& m : plan.matrices()) {
    at::Tensor out = matrix_view(p, m.p_offset, m.rows, m.rank);
    at::mm_out(out, matrix_view(src, m.offset, m.rows, m.cols), matrix_view(q, m.q_offset, m.cols, m.rank));
  }
  for (const RestSegment& s : plan.rest()) {
    rest.narrow(0, s.rest_offset, s.numel).copy_(src.narrow(0, s.offset, s.numel));
  }
}

void low_rank_project_back_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                            const LowRankPlan& plan) {
  check_memory(q, plan.q_numel(), src, "Q memory");
  check_memory(p, plan.p_numel(), src, "P memory");
#ifdef COMMTUNE_WITH_CUDA
  if (plan.batched_kernels()) return low_rank_project_back_cuda_(src, p, q, plan);
#endif
  for (const LowRankMatrix& m : plan.matrices()) {
    at::Tensor out = matrix_view(q, m.q_offset, m.cols, m.rank);
    at::mm_out(out, matrix_view(src, m.offset, m.rows, m.cols).t(), matrix_view(p, m.p_offset, m.rows, m.rank));
  }
}

void orthogonalize_factors_(const at::Tensor& memory, Factor which, double epsilon, const LowRankPlan& plan) {
  check_memory(memory, which == Factor::P ? plan.p_numel() : plan.q_numel(), memory,
               which == Factor::P ? "P memory" : "Q memory");
#ifdef COMMTUNE_WITH_CUDA
  if (plan.batched_kernels()) {
    const int64_t count = static_cast<int64_t>(plan.matrices().size());
    return orthogonalize_cuda_(memory, plan.factor_table(which), count, plan.max_rank(),
                               plan.max_factor_numel(which), epsilon);
  }
#endif
  for (const LowRankMatrix& m : plan.matrices()) {
    const int64_t rows = which == Factor::P ? m.rows : m.cols;
    const int64_t offset = which == Factor::P ? m.p_offset : m.q_offset;
    orthogonalize_(matrix_view(memory, offset, rows, m.rank).unsqueeze(0), epsilon);
  }
}

void low_rank_decompress_(const at::Tensor& p, const at::Tensor& q, const at::Tensor& rest, int64_t divisor,
                          const at::Tensor& out, const at::Tensor& error, const at::Tensor& norms,
                          const LowRankPlan& plan) {
  TORCH_CHECK(divisor >= 1, "PowerSGD low-rank step: divisor must be >= 1");
  check_memory(q, plan.q_numel(), out, "Q memory");
  check_memory(p, plan.p_numel(), out, "P memory");
  check_memory(rest, plan.rest_numel(), out, "rest");
  if (error.defined()) check_memory(error, out.numel(), out, "error");
  TORCH_CHECK(!norms.defined() || (norms.numel() == 2 && norms.scalar_type() == at::kDouble &&
                                   norms.device() == out.device() && norms.is_contiguous()),
              "PowerSGD low-rank step: norms must be a float64 tensor of 2 elements on the bucket's device");
#ifdef COMMTUNE_WITH_CUDA
  if (plan.batched_kernels()) return low_rank_decompress_cuda_(p, q, rest, divisor, out, error, norms, plan);
#endif
  // As torch: Q divided (rounded) first, then the product.
  const at::Tensor q_mean = divisor == 1 ? q : q / divisor;
  for (const LowRankMatrix& m : plan.matrices()) {
    at::Tensor target = matrix_view(out, m.offset, m.rows, m.cols);
    // A copy: `target` (or `error`) is overwritten next.
    const at::Tensor before =
        norms.defined() ? (error.defined() ? matrix_view(error, m.offset, m.rows, m.cols) : target)
                              .to(at::kDouble, /*non_blocking=*/false, /*copy=*/true)
                        : at::Tensor();
    at::mm_out(target, matrix_view(p, m.p_offset, m.rows, m.rank), matrix_view(q_mean, m.q_offset, m.cols, m.rank).t());
    if (error.defined()) matrix_view(error, m.offset, m.rows, m.cols).sub_(target).nan_to_num_(0.0, 0.0, 0.0);
    if (norms.defined()) {
      norms[0].add_((before - target.to(at::kDouble)).square().sum());
      norms[1].add_(before.square().sum());
    }
  }
  const at::Tensor rest_mean = divisor == 1 ? rest : rest / divisor;
  for (const RestSegment& s : plan.rest()) {
    at::Tensor target = out.narrow(0, s.offset, s.numel);
    target.copy_(rest_mean.narrow(0, s.rest_offset, s.numel));
    if (error.defined()) error.narrow(0, s.offset, s.numel).sub_(target).nan_to_num_(0.0, 0.0, 0.0);
  }
}

} // namespace commtune
