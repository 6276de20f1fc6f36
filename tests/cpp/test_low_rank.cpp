#include <commtune/kernels/low_rank.h>
#include <commtune/kernels/orthogonalize.h>

#include <gtest/gtest.h>

namespace {

using commtune::LowRankMatrix;
using commtune::LowRankPlan;
using commtune::RestSegment;

// Two matrices and two uncompressed pieces laid out in one flat bucket:
// [rest 5][M0 6x40][rest 3][M1 70x9]
LowRankPlan sample_plan() {
  std::vector<LowRankMatrix> m{{5, 6, 40, 2, 0, 0}, {248, 70, 9, 3, 12, 80}};
  std::vector<RestSegment> r{{0, 5, 0}, {245, 3, 5}};
  return LowRankPlan(m, r, at::Device(at::kCPU));
}

TEST(LowRankPlan, PrefixSumsCoverEveryMatrix) {
  const LowRankPlan plan = sample_plan();
  EXPECT_EQ(plan.p_numel(), 6 * 2 + 70 * 3);
  EXPECT_EQ(plan.q_numel(), 40 * 2 + 9 * 3);
  EXPECT_EQ(plan.rest_numel(), 8);
  EXPECT_EQ(plan.max_rank(), 3);
  // P = M Q: blocks take 4 rows at a time (rank <= 4): 2 groups, then 18.
  EXPECT_EQ(plan.row_groups(), 20);
  EXPECT_EQ(plan.matrices()[1].group_start, 2);
  EXPECT_EQ(plan.max_factor_numel(commtune::Factor::P), 70 * 3);
  EXPECT_EQ(plan.max_factor_numel(commtune::Factor::Q), 40 * 2);
  // Q = M^T P: 1 column tile x 1 row chunk, then 1 x 3 (70 rows in chunks of 32).
  EXPECT_EQ(plan.matrices()[1].back_tile_start, 1);
  EXPECT_EQ(plan.back_tiles(), 4);
  EXPECT_EQ(plan.scratch_numel(), 40 * 2 + 3 * 9 * 3);
  EXPECT_FALSE(plan.batched_kernels());  // CPU: ATen loops
}

TEST(LowRankSteps, MatchPlainMatrixProducts) {
  const LowRankPlan plan = sample_plan();
  at::manual_seed(3);
  at::Tensor src = at::randn({878}, at::kDouble);
  at::Tensor q = at::randn({plan.q_numel()}, at::kDouble), p = at::empty({plan.p_numel()}, at::kDouble);
  at::Tensor rest = at::empty({plan.rest_numel()}, at::kDouble);
  commtune::low_rank_compress_(src, at::Tensor(), q, p, rest, plan);
  for (const LowRankMatrix& m : plan.matrices()) {
    at::Tensor M = src.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
    at::Tensor Q = q.narrow(0, m.q_offset, m.cols * m.rank).view({m.cols, m.rank});
    at::Tensor P = p.narrow(0, m.p_offset, m.rows * m.rank).view({m.rows, m.rank});
    EXPECT_TRUE(at::allclose(P, at::mm(M, Q)));
  }
  commtune::low_rank_project_back_(src, p, q, plan);
  at::Tensor out = at::full({878}, 123.0, at::kDouble), error = src.clone();
  commtune::low_rank_decompress_(p, q, rest, 1, out, error, at::Tensor(), plan);
  for (const LowRankMatrix& m : plan.matrices()) {
    at::Tensor M = src.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
    at::Tensor P = p.narrow(0, m.p_offset, m.rows * m.rank).view({m.rows, m.rank});
    at::Tensor Q = q.narrow(0, m.q_offset, m.cols * m.rank).view({m.cols, m.rank});
    EXPECT_TRUE(at::allclose(Q, at::mm(M.t(), P)));
    EXPECT_TRUE(at::allclose(out.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols}), at::mm(P, Q.t())));
  }
  // The rest went out and came back unchanged; error = input - output everywhere.
  EXPECT_TRUE(at::equal(out.narrow(0, 0, 5), src.narrow(0, 0, 5)));
  EXPECT_TRUE(at::equal(out.narrow(0, 245, 3), src.narrow(0, 245, 3)));
  EXPECT_TRUE(at::allclose(error, src - out));
}

TEST(Orthogonalize, ColumnsAreOrthonormal) {
  at::manual_seed(5);
  for (int64_t r : {1, 2, 4, 7}) {
    at::Tensor a = at::randn({3, 50, r});
    commtune::orthogonalize_(a, 0.0);
    at::Tensor gram = at::bmm(a.transpose(1, 2), a);
    EXPECT_TRUE(at::allclose(gram, at::eye(r).expand({3, r, r}), 1e-5, 1e-5)) << "rank " << r;
  }
}

}  // namespace
