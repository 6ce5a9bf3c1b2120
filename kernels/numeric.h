// Number formats of the index-K cache, shared by the CPU reference, the CPU backend and the
// CUDA kernels, so that every backend rounds exactly alike (SPEC.md "Index-K cache").
//
//  * bf16 is carried as its raw 16 bits (uint16_t); fp32 -> bf16 rounds to nearest, ties to even.
//  * fp8 is e4m3 ("fn": no infinities), carried as its raw byte; bf16 -> fp8 rounds to nearest
//    even and saturates at +-448 (no scale: selection only needs the order of scores).
//
// Every function is pure, __host__ __device__ under nvcc and plain inline C++ elsewhere.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define INDEXER_HD __host__ __device__ __forceinline__
#else
#define INDEXER_HD inline
#endif

namespace indexer::kernels {

// Tokens per block (= per page). Fixed by SPEC.md.
inline constexpr int kBlockSize = 128;

// How keys are stored in the cache.
enum class KeyStorage : int { kBf16 = 0, kFp8E4M3 = 1 };

INDEXER_HD int KeyStorageBytes(KeyStorage s) { return s == KeyStorage::kBf16 ? 2 : 1; }

INDEXER_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

INDEXER_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

INDEXER_HD float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest, ties to even. NaN stays NaN (quiet); values past the bf16 range
// become +-Inf, which callers that need finite values must refuse.
INDEXER_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

INDEXER_HD bool Bf16IsFinite(uint16_t b) { return (b & 0x7f80u) != 0x7f80u; }

// e4m3 byte -> float, exact. Byte 0x7f/0xff (NaN) never occurs in the cache.
INDEXER_HD float Fp8E4M3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) * 0.001953125f;  // man * 2^-9: subnormal
  } else {
    mag = BitsToFloat(((exp + 120u) << 23) | (man << 20));  // rebias 7 -> 127
  }
  return BitsToFloat(FloatBits(mag) | sign);
}

// Finite float -> e4m3, round to nearest even, saturating at +-448.
INDEXER_HD uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t mag_bits = u & 0x7fffffffu;
  const float a = BitsToFloat(mag_bits);
  if (!(a < 448.0f)) return static_cast<uint8_t>(sign | 0x7eu);  // 448; also Inf (never given)
  const int exp = static_cast<int>(mag_bits >> 23) - 127;
  if (exp < -6) {
    // Subnormal range: multiples of 2^-9. a * 2^9 < 8 is exact in float; round half to even.
    const float scaled = a * 512.0f;
    uint32_t q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);  // q == 8 encodes the smallest normal, 2^-6
  }
  // Normal: keep 3 of float's 23 mantissa bits, round half to even on the other 20.
  uint32_t man = (mag_bits >> 20) & 0x7u;
  const uint32_t rest = mag_bits & 0xfffffu;
  uint32_t e = static_cast<uint32_t>(exp + 7);
  if (rest > 0x80000u || (rest == 0x80000u && (man & 1u))) {
    if (++man == 8u) {
      man = 0;
      ++e;
    }
  }
  uint32_t bits = (e << 3) | man;
  if (bits > 0x7eu) bits = 0x7eu;  // rounding past 448 saturates
  return static_cast<uint8_t>(sign | bits);
}

// Decoded value of a stored key element.
INDEXER_HD float StoredKeyToFloat(const void* base, int64_t index, KeyStorage s) {
  return s == KeyStorage::kBf16 ? Bf16ToFloat(static_cast<const uint16_t*>(base)[index])
                                : Fp8E4M3ToFloat(static_cast<const uint8_t*>(base)[index]);
}

// Forced scores and the score of a block with no finite dot product (SPEC.md, Select step 3).
inline constexpr float kInitScore = 1e30f;
inline constexpr float kLocalScore = 1e29f;
inline constexpr float kEmptyScore = -1e30f;

// A total order on (score, block id) packed into one integer: larger key = better block.
// -0.0 counts as +0.0; ties go to the lower block id.
INDEXER_HD uint64_t SelectionKey(float score, int32_t block) {
  uint32_t bits = FloatBits(score + 0.0f);  // -0.0 + 0.0 == +0.0
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(block));
}

INDEXER_HD int32_t SelectionKeyBlock(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu));
}

}  // namespace indexer::kernels
