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
  int64_t group_start = 0;  // P = M Q: one block per group of rows_per_group(max rank) rows
  int64_t back_tile_start = 0;  // Q = M^T P and P Q^T: tiles of columns x row chunks
  int64_t scratch_offset = 0;  // Q = M^T P: per-chunk partial sums
  int64_t q_start = 0;  // Q = M^T P: summing the chunks, one thread per element of Q_j
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

// P = M Q: rows one block takes together, so each value of Q a thread loads serves them all
// (bounded by the registers its rank x rows accumulators take).
constexpr int64_t rows_per_group(int64_t max_rank) { return max_rank <= 4 ? 4 : (max_rank <= 8 ? 2 : 1); }

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
  // The largest P_j (or Q_j), in elements: the orthogonalization stages factors up to a size in
  // shared memory.
  int64_t max_factor_numel(Factor which) const { return which == Factor::P ? max_p_factor_ : max_q_factor_; }
  // Whether the steps run as the batched CUDA kernels (else as ATen loops).
  bool batched_kernels() const { return batched_; }

  // Device copies of the tables for the kernels, and their grid sizes.
  const at::Tensor& matrix_table() const { return matrix_table_; }
  const at::Tensor& rest_table() const { return rest_table_; }
  const at::Tensor& factor_table(Factor which) const { return which == Factor::P ? p_table_ : q_table_; }
  int64_t row_groups() const { return row_groups_; }
  int64_t back_tiles() const { return back_tiles_; }
  int64_t scratch_numel() const { return scratch_numel_; }
  int64_t rest_tiles() const { return rest_tiles_; }

 private:
  std::vector<LowRankMatrix> matrices_;
  std::vector<RestSegment> rest_;
  int64_t p_numel_ = 0, q_numel_ = 0, rest_numel_ = 0, max_rank_ = 0, max_p_factor_ = 0, max_q_factor_ = 0;
  bool defined_ = false, batched_ = false;
  at::Tensor matrix_table_, rest_table_, p_table_, q_table_;
  int64_t row_groups_ = 0, back_tiles_ = 0, scratch_numel_ = 0, rest_tiles_ = 0;
};

// Tile sizes the plan and the CUDA kernels agree on.
constexpr int64_t kBackTileCols = 256;  // Q = M^T P and P Q^T: columns per tile (one per thread)
constexpr int64_t kBackTileRows = 32;  // Q = M^T P and P Q^T: rows per tile (one chunk of partial sums)
constexpr int64_t kOutTile = 2048;  // the rest: elements per tile

// The first pass over a bucket: with `addend` defined, src += addend everywhere first (error
// feedback: the error buffer takes the bucket in the same pass); then P_j = M_j Q_j for every j
// and `rest` = the uncompressed segments of src, packed.
void low_rank_compress_(const at::Tensor& src, const at::Tensor& addend, const at::Tensor& q, const at::Tensor& p,
                        const at::Tensor& rest, const LowRankPlan& plan);
// Q_j = M_j^T P_j for every j.
void low_rank_project_back_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                            const LowRankPlan& plan);
// Orthonormalizes the columns of every P_j (or Q_j), by orthogonalize_'s rule.
void orthogonalize_factors_(const at::Tensor& memory, Factor which, double epsilon, const LowRankPlan& plan);
// The last pass: M_j = P_j (Q_j / divisor)^T and the uncompressed segments = rest / divisor,
// written into `out`; `error`, if defined, has the same subtracted, and an Inf or a NaN left
// in it becomes 0 (error feedback keeps nothing of an overflow: the step's output carries it
// to every rank instead; in this pass, not one of its own). The divisor (the world
// size: Q and the rest arrive summed over ranks) divides Q as torch does, leaving Q's memory
// as it is. `norms`, if defined (float64 [2]), gets sum (x - M_j)^2 and sum x^2 over the
// compressed matrices added, x being what was there before (`error` if defined, else `out`).
void low_rank_decompress_(const at::Tensor& p, const at::Tensor& q, const at::Tensor& rest, int64_t divisor,
                          const at::Tensor& out, const at::Tensor& error, const at::Tensor& norms,
                          const LowRankPlan& plan);

#ifdef COMMTUNE_WITH_CUDA
void low_rank_compress_cuda_(const at::Tensor& src, const at::Tensor& addend, const at::Tensor& q, const at::Tensor& p,
                             const at::Tensor& rest, const LowRankPlan& plan);
void low_rank_project_back_cuda_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                                 const LowRankPlan& plan);
void orthogonalize_cuda_(const at::Tensor& memory, const at::Tensor& factors, int64_t count, int64_t max_rank,
                         int64_t max_factor_numel, double epsilon);
void low_rank_decompress_cuda_(const at::Tensor& p, const at::Tensor& q, const at::Tensor& rest, int64_t divisor,
                               const at::Tensor& out, const at::Tensor& error, const at::Tensor& norms,
                               const LowRankPlan& plan);
#endif

} // namespace commtune
