#pragma once
// The low-rank steps of PowerSGD for every compressed matrix of a bucket at once.
//
// A bucket's compressed gradients are matrices M_j [rows_j, cols_j], row-major views into a
// flat source (the bucket, or the error-feedback buffer holding bucket + error); their factors
// P_j [rows_j, rank_j] and Q_j [cols_j, rank_j] are row-major slices of one flat P memory and
// one flat Q memory. What is not compressed ("the rest") travels packed in one flat tensor.
// On CUDA each step below is one or two launches for the whole bucket; elsewhere, and for
// ranks above kMaxKernelRank, it loops over the matrices with ATen.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace commtune {

constexpr int64_t kMaxKernelRank = 32;

// One compressed matrix. The last fields tell the CUDA kernels which blocks/threads are its own:
// prefix sums over the matrices before it (LowRankPlan fills them).
struct LowRankMatrix {
  int64_t offset;  // of M_j in the source, in elements
  int64_t rows, cols, rank;
  int64_t p_offset, q_offset;  // of P_j and Q_j in their memories
  int64_t row_start = 0;  // P = M Q: one warp per row
  int64_t back_tile_start = 0;  // Q = M^T P: tiles of columns x row chunks
  int64_t scratch_offset = 0;  // Q = M^T P: per-chunk partial sums
  int64_t q_start = 0;  // Q = M^T P: summing the chunks, one thread per element of Q_j
  int64_t out_tile_start = 0;  // P Q^T: tiles of elements
  int64_t pad = 0;
};

// A piece of the bucket that is sent uncompressed, and where it sits in the packed rest.
struct RestSegment {
  int64_t offset, numel, rest_offset;
  int64_t tile_start = 0;
};

// One factor (a P_j or a Q_j) to orthonormalize: [rows, rank] at `offset` of its memory.
struct FactorEntry {
  int64_t offset, rows, rank, pad = 0;
};

enum class Factor { P, Q };

class LowRankPlan {
 public:
  LowRankPlan() = default;
  // Fills the prefix sums and, for a CUDA device, copies the tables to it (once per layout).
  LowRankPlan(std::vector<LowRankMatrix> matrices, std::vector<RestSegment> rest, const at::Device& device);

  bool defined() const { return defined_; }
  const std::vector<LowRankMatrix>& matrices() const { return matrices_; }
  const std::vector<RestSegment>& rest() const { return rest_; }
  int64_t p_numel() const { return p_numel_; }
  int64_t q_numel() const { return q_numel_; }
  int64_t rest_numel() const { return rest_numel_; }
  int64_t max_rank() const { return max_rank_; }
  // Whether the steps run as the batched CUDA kernels (else as ATen loops).
  bool batched_kernels() const { return batched_; }

  // Device copies of the tables for the kernels, and their grid sizes.
  const at::Tensor& matrix_table() const { return matrix_table_; }
  const at::Tensor& rest_table() const { return rest_table_; }
  const at::Tensor& factor_table(Factor which) const { return which == Factor::P ? p_table_ : q_table_; }
  int64_t total_rows() const { return total_rows_; }
  int64_t back_tiles() const { return back_tiles_; }
  int64_t scratch_numel() const { return scratch_numel_; }
  int64_t out_tiles() const { return out_tiles_; }
  int64_t rest_tiles() const { return rest_tiles_; }

 private:
  std::vector<LowRankMatrix> matrices_;
  std::vector<RestSegment> rest_;
  int64_t p_numel_ = 0, q_numel_ = 0, rest_numel_ = 0, max_rank_ = 0;
  bool defined_ = false, batched_ = false;
  at::Tensor matrix_table_, rest_table_, p_table_, q_table_;
  int64_t total_rows_ = 0, back_tiles_ = 0, scratch_numel_ = 0, out_tiles_ = 0, rest_tiles_ = 0;
};

// Tile sizes the plan and the CUDA kernels agree on.
constexpr int64_t kBackTileCols = 256;  // Q = M^T P: columns per tile (one per thread)
constexpr int64_t kBackTileRows = 32;  // Q = M^T P: rows per tile (one chunk of partial sums)
constexpr int64_t kOutTile = 2048;  // P Q^T and the rest: elements per tile

// P_j = M_j Q_j for every j.
void low_rank_project_(const at::Tensor& src, const at::Tensor& q, const at::Tensor& p, const LowRankPlan& plan);
// Q_j = M_j^T P_j for every j.
void low_rank_project_back_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                            const LowRankPlan& plan);
// Orthonormalizes the columns of every P_j (or Q_j), by orthogonalize_'s rule.
void orthogonalize_factors_(const at::Tensor& memory, Factor which, double epsilon, const LowRankPlan& plan);
// M_j = P_j (Q_j / divisor)^T written into `out`; `error`, if defined, has the same subtracted.
// The divisor (the world size: Q arrives summed over ranks) leaves Q's memory as it is.
void low_rank_reconstruct_(const at::Tensor& p, const at::Tensor& q, int64_t divisor, const at::Tensor& out,
                           const at::Tensor& error, const LowRankPlan& plan);
// rest = the uncompressed segments of src, packed.
void gather_rest_(const at::Tensor& src, const at::Tensor& rest, const LowRankPlan& plan);
// The uncompressed segments of `out` = rest / divisor; `error`, if defined, has the same subtracted.
void scatter_rest_(const at::Tensor& rest, int64_t divisor, const at::Tensor& out, const at::Tensor& error,
                   const LowRankPlan& plan);

#ifdef COMMTUNE_WITH_CUDA
void low_rank_project_cuda_(const at::Tensor& src, const at::Tensor& q, const at::Tensor& p, const LowRankPlan& plan);
void low_rank_project_back_cuda_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                                 const LowRankPlan& plan);
void orthogonalize_cuda_(const at::Tensor& memory, const at::Tensor& factors, int64_t count, int64_t max_rank,
                         double epsilon);
void low_rank_reconstruct_cuda_(const at::Tensor& p, const at::Tensor& q, int64_t divisor, const at::Tensor& out,
                                const at::Tensor& error, const LowRankPlan& plan);
void move_rest_cuda_(const at::Tensor& from, const at::Tensor& to, int64_t divisor, const at::Tensor& error,
                     bool gather, const LowRankPlan& plan);
#endif

} // namespace commtune
