#pragma once
// Stored codes read and written a 32-bit word (or, int4, 16 bits) at a time by the one-warp
// kernels of quantize_cuda.cu and quantize_reduce_cuda.cu, in fewer instructions than
// quantize_rules.h's per-code functions and with the same bits (the reduce decodes every rank's
// codes, so instructions add up there).
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/quantize_rules.h>

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace commtune::quant_words {

using quant::Codes;

// A lane's word t of a chunk's codes is the chunk's word lane + 32 t: four 8-bit codes (the
// lane's group t, as four::group_start places groups) or eight 4-bit ones (its groups 2t, 2t + 1).
template <Codes kKind>
struct CodeWords {
  static constexpr int kGroups = 8 / quant::bits_of(kKind);  // groups of four codes in a word
  static constexpr int kPerLane = four::kMaxFours / kGroups;
  // Decodes as zero: words past the chunk add nothing to the sums or the absmax.
  static constexpr uint32_t kZero = kKind == Codes::int4 ? 0x88888888u : 0u;
  __device__ static int64_t start(int lane, int i) {
    return 4 * (kGroups * (lane + four::kWarp * (i / kGroups)) + i % kGroups);
  }
  // start(lane, i) - start(lane, 0), the same for every lane
  __host__ __device__ static constexpr int64_t offset(int i) {
    return 4 * (kGroups * four::kWarp * (i / kGroups) + i % kGroups);
  }
  // Byte offset of the lane's word t in the chunk's codes.
  __device__ static int byte_of(int lane, int t) { return 4 * (lane + four::kWarp * t); }
};

// The bits of the float 2^23, whose mantissa level_in_word fills. Kernels take it as an argument
// so that it stays in a register: as a constant, ptxas folds it into the byte permutes and moves
// their selectors into registers instead, reloading them before each use (a move a code, int4).
constexpr uint32_t kMagicBits = 0x4B000000u;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// sm_89 on converts two e4m3 bytes to two fp16 in one instruction, exactly (every e4m3 value,
// subnormals too, is an fp16): the pair's halves hold the levels themselves.
constexpr float kE4m3HalfFactor = 1.0f;
#else
// Elsewhere an e4m3 byte's bits, moved into an fp16's (sign to sign, the rest 7 places up), are
// its level times 2^-8, subnormals included.
constexpr float kE4m3HalfFactor = 256.0f;
#endif

// Codes 2p and 2p + 1 of a word of e4m3 codes as two fp16, their levels over kE4m3HalfFactor.
__device__ __forceinline__ uint32_t e4m3_pair_halves(uint32_t word, int p) {
  uint32_t halves;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // the pair's 16 bits read in place (ptxas selects the register's upper half, no shift)
  if (p == 0) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(halves) : "r"(word));
  } else {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(halves) : "r"(word));
  }
#else
  // the pair's magnitudes (7 bits) at bits 0 and 16, times 2^7, plus their signs at bits 15
  // and 31: two byte permutes and a multiply-add (no carries: the fields do not overlap)
  const uint32_t magnitudes = word & 0x7F7F7F7Fu, signs = word ^ magnitudes;
  const uint32_t low = __byte_perm(magnitudes, 0u, p == 0 ? 0x4140u : 0x4342u);
  const uint32_t high = __byte_perm(signs, 0u, p == 0 ? 0x1404u : 0x3424u);
  halves = low * 128u + high;
#endif
  return halves;
}

// Code k of a word of stored codes as its level (quant::level_of_stored's value) over
// word_scale's factor; `magic`: kMagicBits. Integer codes go into their float's mantissa with
// one byte permute (small_int_to_float's layout) rather than a shift and two masks. e4m3 codes
// go in pairs to fp16 (e4m3_pair_halves), which the converter turns into floats.
template <Codes kKind>
__device__ __forceinline__ float level_in_word(uint32_t word, int k, uint32_t magic) {
  if constexpr (kKind == Codes::e4m3) {
    const uint32_t halves = e4m3_pair_halves(word, k / 2);
    __half2 pair;
    memcpy(&pair, &halves, sizeof pair);
    const float2 values = __half22float2(pair);
    return k % 2 ? values.y : values.x;
  } else {
    // the byte with the code's biased value (int8: code + 128; int4: its nibble, code + 8)
    const uint32_t biased = kKind == Codes::int8 ? word ^ 0x80808080u : (word >> (4 * (k % 2))) & 0x0F0F0F0Fu;
    const int byte = kKind == Codes::int8 ? k : k / 2;
    const uint32_t bits = __byte_perm(biased, magic, 0x7440u | byte);  // 0x4B0000 byte
    return quant::small_int_from_magic(bits, kKind == Codes::int8 ? 128u : 8u);
  }
}

// The reduce's sums of int8 and int4 codes (quant::add_decoded's rule: stored values times
// scales, less the bias times the scales' sum) in a unit where a stored code's bits, read as a
// float, are its value: the subnormal b * 2^-149, linear in b, so a code costs a byte permute and
// a fused multiply-add (subnormal operands: fma_subnormal). Each rank's scale is taken times 2^K,
// K = 254 - the biased exponent of the chunk's largest scale, the most that none overflows; the
// sums are then the CPU's times 2^(K - 149), a power of two, so no rounding differs unless a sum
// falls below float's normal range (ranks whose scales differ by more than 2^100). The re-encode
// does not depend on the unit (its scale is a share of the absmax), so only the stored scale is
// taken back.
template <Codes kKind>
constexpr bool kSubnormalSums = kKind != Codes::e4m3;  // the kinds whose sums SubnormalSums makes

struct SubnormalSums {
  float up_high, up_low;  // 2^K as two normal factors
  float down_high, down_low;  // 2^(149 - K)

  // 2^e for -126 <= e <= 127.
  __device__ static float power(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

  // largest_bits: the bits of the chunk's largest scale (scales are >= 0).
  __device__ static SubnormalSums of(uint32_t largest_bits) {
    const int exponent = max(static_cast<int>(largest_bits >> 23), 1);  // subnormal largest scales as 2^-126
    const int up = 254 - exponent, down = 149 - up;
    return {power(min(up, 127)), power(up - min(up, 127)), power(min(down, 127)), power(down - min(down, 127))};
  }
  __device__ float scale_up(float scale) const { return __fmul_rn(__fmul_rn(scale, up_high), up_low); }
  __device__ float scale_down(float scale) const { return __fmul_rn(__fmul_rn(scale, down_high), down_low); }
};

// a * b + c rounded once, subnormal operands and results kept (the build flushes them to zero
// elsewhere).
__device__ __forceinline__ float fma_subnormal(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// Code k of a word of int8 or int4 codes as stored (code + bias), read as a subnormal float.
template <Codes kKind>
__device__ __forceinline__ float stored_in_word(uint32_t word, int k) {
  const uint32_t stored = kKind == Codes::int8 ? word ^ 0x80808080u : (word >> (4 * (k % 2))) & 0x0F0F0F0Fu;
  const int byte = kKind == Codes::int8 ? k : k / 2;
  return __uint_as_float(__byte_perm(stored, 0u, 0x4440u | byte));
}

// int4 codes read in place, for the reduce's sums: nibble k of a word (bits 4k..4k+3), masked
// where it lies in the word's low half (k < 4) or in its high half moved down (k >= 4), is the
// subnormal float stored * 2^(4 (k % 4) - 149). Times the scale over 2^(4 (k % 4)) it is
// stored_in_word's term times the scale, exactly, so the sums keep their bits, for one mask a
// code where stored_in_word takes a byte permute and a share of two masks and a shift. The scale
// over 2^4, 2^8 or 2^12 is exact wherever it is normal; where it is flushed to 0 the scale is
// below 2^-114, and stored_in_word's product (below 2^-259) rounds to nothing as well.
struct Int4InPlace {
  float over[4];  // the scale over 2^0, 2^4, 2^8, 2^12

  __device__ static Int4InPlace of(float scale) {
    return {{scale, quant::mul(scale, 0x1p-4f), quant::mul(scale, 0x1p-8f), quant::mul(scale, 0x1p-12f)}};
  }
  __device__ static float code(uint32_t word, int k) {
    const uint32_t half = k < 4 ? word : word >> 16;
    return __uint_as_float(half & (0xFu << (4 * (k % 4))));
  }
  // sum + code k of the word times the scale, one rounding (as fma_subnormal of stored_in_word)
  __device__ float add(uint32_t word, int k, float sum) const { return fma_subnormal(code(word, k), over[k % 4], sum); }
};

// The factor level_in_word's levels take to be decoded: the chunk's scale (e4m3: times
// kE4m3HalfFactor, exactly, since scale <= FLT_MAX / 448 cannot overflow).
template <Codes kKind>
__device__ __forceinline__ float word_scale(float scale) {
  return kKind == Codes::e4m3 && kE4m3HalfFactor != 1.0f ? quant::mul(scale, kE4m3HalfFactor) : scale;
}

// The low bytes of a, b, c, d as one word (a's lowest): three byte permutes.
__device__ __forceinline__ uint32_t low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}

// Stores e4m3 codes j..j+3 of a chunk (j a multiple of 4) as quant::store_four_codes does, one word.
__device__ __forceinline__ void store_e4m3_four(uint8_t* codes, int64_t j, const int8_t (&q)[4]) {
  *reinterpret_cast<uint32_t*>(codes + j) = low_bytes(static_cast<uint8_t>(q[0]), static_cast<uint8_t>(q[1]),
                                                      static_cast<uint8_t>(q[2]), static_cast<uint8_t>(q[3]));
}

// The bits of the float 2^23 + r for each of a group's four 16-bit draws r (quant::four_random_at's
// fields: draw k is bits 16k..16k+15 of the mix), one byte permute each: the draw's two bytes
// under the two bytes of 2^23's bits (0x4B00). Rounding to nearest, every draw is kNearestDraw
// (r = kHalf16).
constexpr uint32_t kDrawMagicHigh = 0x4B00u;  // 2^23's top two bytes, as bytes 4 and 5 of a permute
constexpr uint32_t kNearestDraw = 0x4B000000u | quant::kHalf16;
__device__ __forceinline__ void magic_draws(uint64_t point, uint32_t (&draw)[4]) {
  const uint64_t z = quant::mix(point);
  const uint32_t low = static_cast<uint32_t>(z), high = static_cast<uint32_t>(z >> 32);
  draw[0] = __byte_perm(low, kDrawMagicHigh, 0x5410u);
  draw[1] = __byte_perm(low, kDrawMagicHigh, 0x5432u);
  draw[2] = __byte_perm(high, kDrawMagicHigh, 0x5410u);
  draw[3] = __byte_perm(high, kDrawMagicHigh, 0x5432u);
}

// int8 or int4 codes j..j+3 of a chunk (j a multiple of 4) from values x, the chunk's inverse
// scale and the magic draws above: the bytes quant::encode and quant::store_four_codes make, and
// `level`, the codes' values (quant::encode's), in fewer instructions:
//   - the draw u = r * 2^-16 is (2^23 + r) * 2^-16 - 128, one exact multiply-add (uniform_of
//     builds the same number with a shift, two masks and a subtraction);
//   - floor(t), clamped to the codes' range, is the clamp of t rounded down (the same for every
//     t, NaN included: fmaxf takes -top for it either way), and rounding t + 2^23 + bias down to
//     an integer does the floor and lays the stored code (code + bias) into the float's low bits
//     at once;
//   - only the lower clamp is applied: t = x * inverse + u stays below top + 1. The scale is the
//     absmax of the values encoded over top and the inverse its correctly rounded reciprocal, so
//     x * inverse <= top * (1 + 3 * 2^-24) (three roundings), and u <= 1 - 2^-16; the sum rounds
//     below top + 1 for top = 7 and 127. A NaN or infinite scale has an inverse of 0 (quant::inverse),
//     so t is u or NaN, never +Inf.
// Integer codes are packed from those low bits: the int8 byte is flipped at its top; each int4
// byte holds two nibbles, the even code's plus 16 times the odd one's (no carry).
template <Codes kKind>
__device__ __forceinline__ void store_int_four(const float (&x)[4], float inverse, const uint32_t (&draw)[4],
                                               uint8_t* codes, int64_t j, float (&level)[4]) {
  static_assert(kKind != Codes::e4m3, "e4m3 codes are encoded by store_normal_e4m3 or quant::encode");
  constexpr float kTop = kKind == Codes::int8 ? 127.0f : 7.0f;
  constexpr float kMagic = kKind == Codes::int8 ? 8388736.0f : 8388616.0f;  // 2^23 + 128, 2^23 + 8
  uint32_t m[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float u = __fmaf_rn(__uint_as_float(draw[k]), 1.0f / 65536.0f, -128.0f);
    const float t = fmaxf(quant::add(quant::mul(x[k], inverse), u), -kTop);
    m[k] = __float_as_uint(__fadd_rd(t, kMagic));
    level[k] = floorf(t);  // used by the error feedback only (the reduce drops it)
  }
  if constexpr (kKind == Codes::int8) {
    *reinterpret_cast<uint32_t*>(codes + j) = low_bytes(m[0], m[1], m[2], m[3]) ^ 0x80808080u;
  } else {
    const uint32_t pair01 = m[0] + (m[1] << 4), pair23 = m[2] + (m[3] << 4);
    *reinterpret_cast<uint16_t*>(codes + j / 2) = static_cast<uint16_t>(__byte_perm(pair01, pair23, 0x0040u));
  }
}

// e4m3's smallest normal value, 2^-6: scaled values at least this large are rounded in their
// fp32 bits alone (quant::encode_e4m3's second branch).
constexpr float kE4m3Normal = 0.015625f;

// Codes j..j+3 of a chunk as quant::encode_e4m3 makes them (the same bytes and levels) from
// values x[0..3] and their draws, stored as one word, in a third of the per-code rule's
// instructions: when every scaled value is at least 2^-6 in magnitude (no subnormal step, no
// zero, no NaN), each code's magnitude is at least 8, so its sign is the value's, and there is
// no branch a code. Scaled values below that (3.5e-5 of the chunk's absmax) are rare, so the warp
// votes: unless every lane taking part has such a group, it returns false and stores nothing.
__device__ __forceinline__ bool store_normal_e4m3(const float (&x)[4], float inverse, const uint32_t (&random)[4],
                                                  bool nearest, uint8_t* codes, int64_t j, float (&level)[4]) {
  float y[4];
  bool normal = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    y[k] = quant::mul(x[k], inverse);
    normal = normal && fabsf(y[k]) >= kE4m3Normal;  // false for NaN too
  }
  if (!__all_sync(__activemask(), normal)) return false;
  uint32_t magnitude[4], top[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t bits = __float_as_uint(fminf(fabsf(y[k]), 448.0f));
    // magnitude 8..126: no carry into the sign's bit
    const uint32_t kept = quant::e4m3_round_normal(bits, random[k], nearest, magnitude[k]);
    top[k] = __float_as_uint(y[k]) >> 24;  // the sign at bit 7
    level[k] = __uint_as_float(kept | (top[k] << 24 & 0x80000000u));
  }
  const uint32_t signs = low_bytes(top[0], top[1], top[2], top[3]) & 0x80808080u;
  *reinterpret_cast<uint32_t*>(codes + j) = low_bytes(magnitude[0], magnitude[1], magnitude[2], magnitude[3]) | signs;
  return true;
}

} // namespace commtune::quant_words
