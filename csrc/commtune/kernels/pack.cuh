#pragma once
// Sixteen bytes of consecutive elements as one access, and a stretch of a buffer cut where its
// 16-byte boundaries fall: the dense passes that write or read a bucket's slice whole (RandomK's
// take and place, TopK's place) use whole packs between single entries at either end.
#include <cstdint>

namespace commtune {

template <typename T>
struct alignas(16) Pack {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// Entries [lo, hi) of base as single entries before the first 16-byte boundary ([lo, packs)),
// whole packs ([packs, tail)) and single entries after the last ([tail, hi)).
struct PackedSpan {
  int64_t packs, tail;
};

template <typename T>
__device__ __forceinline__ PackedSpan packed_span(const T* base, int64_t lo, int64_t hi) {
  constexpr int64_t count = Pack<T>::kCount;
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base + lo) % 16) / sizeof(T);
  const int64_t packs = min(hi, lo + (count - misaligned) % count);
  return {packs, packs + (hi - packs) / count * count};
}

} // namespace commtune
