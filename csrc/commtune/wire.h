#pragma once
// Bytes one rank sends in a collective on n ranks, as nccl-tests counts bus traffic
// (PERFORMANCE.md): what the counters' wire_bytes add up, so that every scheme is priced in the
// same unit as a ring allreduce of the bucket.
#include <cstdint>

namespace commtune::wire {

// A ring allreduce of `bytes`: a reduce-scatter and an all-gather, each (n - 1) / n of it.
inline double allreduce(int64_t bytes, int64_t ranks) {
  return 2.0 * static_cast<double>(ranks - 1) * static_cast<double>(bytes) / static_cast<double>(ranks);
}
// An all-gather of one `piece` from every rank: this rank's piece goes to the n - 1 others.
inline double all_gather(int64_t piece, int64_t ranks) {
  return static_cast<double>(ranks - 1) * static_cast<double>(piece);
}
// An all-to-all of `bytes` cut into n equal pieces: all but this rank's own piece leave.
inline double all_to_all(int64_t bytes, int64_t ranks) {
  return static_cast<double>(ranks - 1) * static_cast<double>(bytes) / static_cast<double>(ranks);
}

} // namespace commtune::wire
