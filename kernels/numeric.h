// Number formats of the index-K cache, shared by the CPU reference, the CPU backend and the
// CUDA kernels, so that every backend rounds exactly alike (SPEC.md "Index-K cache").
//
//  * bf16 is carried as its raw 16 bits (uint16_t); fp32 -> bf16 rounds to nearest, ties to even.
//  * fp8 is e4m3 ("fn": no infinities), carried as its raw byte; bf16 -> fp8 rounds to nearest
//    even and saturates at +-448 (no scale: selection only needs the order of scores).
//  * fp4 is e2m1 codes with one e4m3 scale per group of 16 values (SPEC.md "fp4 key storage"):
//    a code is 4 bits (sign, 2 exponent bits with bias 1, 1 mantissa bit), values
//    +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; the stored value code * scale is exact in fp32 (and in f16
//    and bf16: at most 6 significant bits, magnitudes in [2^-10, 2688]).
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

// How keys are stored in the cache. The values are the snapshot file's and must not change.
enum class KeyStorage : int { kBf16 = 0, kFp8E4M3 = 1, kFp4E2M1 = 2 };

// The storage's name in flags, logs and messages: "bf16", "fp8" or "fp4".
inline const char* KeyStorageName(KeyStorage s) {
  return s == KeyStorage::kBf16 ? "bf16" : s == KeyStorage::kFp8E4M3 ? "fp8" : "fp4";
}

// Values sharing one fp4 scale; head_dim is a multiple of it.
inline constexpr int kFp4GroupSize = 16;

// Bytes one key of `head_dim` values takes: 2 or 1 per value, or for fp4 half a byte of code per
// value plus one scale byte per group.
INDEXER_HD constexpr int KeyBytes(KeyStorage s, int head_dim) {
  return s == KeyStorage::kBf16      ? 2 * head_dim
         : s == KeyStorage::kFp8E4M3 ? head_dim
                                     : head_dim / 2 + head_dim / kFp4GroupSize;
}

// Bytes of one page (kBlockSize keys) of one layer.
INDEXER_HD constexpr int64_t PageBytes(KeyStorage s, int head_dim) {
  return int64_t{kBlockSize} * KeyBytes(s, head_dim);
}

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

// The range rule of every bf16 range summary (host checks, staging scans, device copies): a
// finite bf16's magnitude bits (b & 0x7fff) order as its magnitude does, and f16 holds exactly
// the bf16 magnitudes from bits 0x3880 (2^-14, f16's least normal) to 0x477F (65280, the largest
// bf16 not above 65504).
inline constexpr int kBf16F16LeastBits = 0x3880;
inline constexpr int kBf16F16GreatestBits = 0x477f;

// Whether one nonzero magnitude lies outside f16's range (zero is inside).
INDEXER_HD constexpr bool Bf16MagnitudeOutsideF16(int magnitude_bits) {
  return magnitude_bits != 0 &&
         (magnitude_bits < kBf16F16LeastBits || magnitude_bits > kBf16F16GreatestBits);
}

// Host scans keep two reductions in 16-bit lanes instead of the per-value test (whose compares
// widen to 32-bit lanes): the greatest magnitude, and the least of Bf16LeastNonzeroKey, the
// magnitude less one with zero mapped to kBf16NoNonzero (above every finite magnitude's; no
// compare, so the loop vectorises).
inline constexpr int kBf16NoNonzero = 0x7fff;
INDEXER_HD constexpr int16_t Bf16LeastNonzeroKey(int16_t magnitude_bits) {
  return static_cast<int16_t>((magnitude_bits - 1) & 0x7fff);
}
// Whether values whose least Bf16LeastNonzeroKey is `least_key` and greatest magnitude
// `greatest_bits` all lie in f16's range (zero is inside).
INDEXER_HD constexpr bool Bf16MagnitudesFitF16(int least_key, int greatest_bits) {
  return least_key >= kBf16F16LeastBits - 1 && greatest_bits <= kBf16F16GreatestBits;
}

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

// e2m1 code (low 4 bits) -> float, exact.
INDEXER_HD float Fp4E2M1ToFloat(uint8_t code) {
  const uint32_t e = (code >> 1) & 0x3u;
  const uint32_t m = code & 0x1u;
  // e == 0: m * 0.5 (subnormal); else 2^(e - 1) * (1 + m / 2), as float bits (bias 1 -> 127).
  const float mag =
      e == 0 ? static_cast<float>(m) * 0.5f : BitsToFloat(((e + 126u) << 23) | (m << 22));
  return (code & 0x8u) ? -mag : mag;
}

// Finite float -> e2m1 code: the nearest of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the code with
// the even mantissa bit, saturating at +-6. The sign is kept, also when the magnitude rounds to 0.
INDEXER_HD uint8_t FloatToFp4E2M1(float f) {
  const uint8_t sign = static_cast<uint8_t>((FloatBits(f) >> 28) & 0x8u);
  const float a = BitsToFloat(FloatBits(f) & 0x7fffffffu);
  // Midpoints between neighbouring magnitudes; a tie goes down to an even code (0, 1, 2, 4) with
  // <=, up to one with <.
  uint8_t mag;
  if (a <= 0.25f) {
    mag = 0;
  } else if (a < 0.75f) {
    mag = 1;
  } else if (a <= 1.25f) {
    mag = 2;
  } else if (a < 1.75f) {
    mag = 3;
  } else if (a <= 2.5f) {
    mag = 4;
  } else if (a < 3.5f) {
    mag = 5;
  } else if (a <= 5.0f) {
    mag = 6;
  } else {
    mag = 7;
  }
  return static_cast<uint8_t>(sign | mag);
}

// fp32 quotient, correctly rounded on every target (also under nvcc's fast-math flags).
INDEXER_HD float DivideRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The e4m3 scale byte of a group whose largest magnitude is `amax`: e4m3(amax / 6).
INDEXER_HD uint8_t Fp4GroupScale(float amax) { return FloatToFp8E4M3(DivideRn(amax, 6.0f)); }

// Quantises one group of kFp4GroupSize bf16 values: value 2i goes to the low nibble of codes[i],
// value 2i + 1 to the high nibble; returns the scale byte. Every code is 0 when the scale is 0.
INDEXER_HD uint8_t QuantizeFp4Group(const uint16_t* bf16, uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < kFp4GroupSize; ++i) {
    const float a = BitsToFloat(FloatBits(Bf16ToFloat(bf16[i])) & 0x7fffffffu);
    amax = a > amax ? a : amax;
  }
  const uint8_t scale = Fp4GroupScale(amax);
  const float sf = Fp8E4M3ToFloat(scale);
  for (int i = 0; i < kFp4GroupSize / 2; ++i) {
    uint8_t lo = 0, hi = 0;
    if (sf != 0.0f) {
      lo = FloatToFp4E2M1(DivideRn(Bf16ToFloat(bf16[2 * i]), sf));
      hi = FloatToFp4E2M1(DivideRn(Bf16ToFloat(bf16[2 * i + 1]), sf));
    }
    codes[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return scale;
}

// Eight e2m1 codes (nibble k of `w` is value k) rewritten as e4m3 bytes, for the GPU's exact
// e4m3 -> f16 conversion: code sign | exponent << 3 | mantissa << 2 is the e4m3 value code * 2^-6
// (the e2m1 subnormal 0.5 is the e4m3 subnormal 2^-7). Byte j of *even is value 2j, byte j of
// *odd value 2j + 1.
INDEXER_HD void Fp4CodesToE4M3(uint32_t w, uint32_t* even, uint32_t* odd) {
  *even = ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u);
  *odd = ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u);
}

// Where keys sit in one layer's pool. bf16 and fp8: page p's key t, value d, is element
// (p * kBlockSize + t) * head_dim + d. fp4: page p's bytes begin at p * PageBytes; its 128 keys'
// codes come first (key t at t * head_dim / 2, value d in byte d / 2, low nibble for even d),
// then their scales (key t at kBlockSize * head_dim / 2 + t * head_dim / 16, one byte per group):
// both are contiguous and 16-byte aligned, for wide copies of either.
INDEXER_HD int64_t Fp4CodesOffset(int64_t page, int slot, int head_dim) {
  return page * PageBytes(KeyStorage::kFp4E2M1, head_dim) + int64_t{slot} * (head_dim / 2);
}
INDEXER_HD int64_t Fp4ScalesOffset(int64_t page, int slot, int head_dim) {
  return page * PageBytes(KeyStorage::kFp4E2M1, head_dim) + int64_t{kBlockSize} * (head_dim / 2) +
         int64_t{slot} * (head_dim / kFp4GroupSize);
}

// Stores one key (head_dim bf16 values) at page `page`, slot `slot` of a layer's pool, rounded to
// the storage type.
INDEXER_HD void StoreKey(void* pool, KeyStorage s, int head_dim, int64_t page, int slot,
                         const uint16_t* key) {
  const int64_t element = (page * kBlockSize + slot) * head_dim;
  if (s == KeyStorage::kBf16) {
    uint16_t* dst = static_cast<uint16_t*>(pool) + element;
    for (int d = 0; d < head_dim; ++d) dst[d] = key[d];
  } else if (s == KeyStorage::kFp8E4M3) {
    uint8_t* dst = static_cast<uint8_t*>(pool) + element;
    for (int d = 0; d < head_dim; ++d) dst[d] = FloatToFp8E4M3(Bf16ToFloat(key[d]));
  } else {
    uint8_t* codes = static_cast<uint8_t*>(pool) + Fp4CodesOffset(page, slot, head_dim);
    uint8_t* scales = static_cast<uint8_t*>(pool) + Fp4ScalesOffset(page, slot, head_dim);
    for (int g = 0; g < head_dim / kFp4GroupSize; ++g) {
      scales[g] = QuantizeFp4Group(key + g * kFp4GroupSize, codes + g * (kFp4GroupSize / 2));
    }
  }
}

// Zeroes the stored bytes of the key at page `page`, slot `slot` (every storage decodes them as
// a key of zeros).
INDEXER_HD void ClearKey(void* pool, KeyStorage s, int head_dim, int64_t page, int slot) {
  uint8_t* bytes = static_cast<uint8_t*>(pool);
  if (s != KeyStorage::kFp4E2M1) {
    const int64_t row = KeyBytes(s, head_dim);
    for (int64_t i = 0; i < row; ++i) bytes[(page * kBlockSize + slot) * row + i] = 0;
    return;
  }
  for (int i = 0; i < head_dim / 2; ++i) bytes[Fp4CodesOffset(page, slot, head_dim) + i] = 0;
  for (int i = 0; i < head_dim / kFp4GroupSize; ++i) {
    bytes[Fp4ScalesOffset(page, slot, head_dim) + i] = 0;
  }
}

// Decoded value d of the key at page `page`, slot `slot`: the value scores use.
INDEXER_HD float StoredKeyValue(const void* pool, KeyStorage s, int head_dim, int64_t page,
                                int slot, int d) {
  const int64_t element = (page * kBlockSize + slot) * head_dim + d;
  if (s == KeyStorage::kBf16) return Bf16ToFloat(static_cast<const uint16_t*>(pool)[element]);
  if (s == KeyStorage::kFp8E4M3) return Fp8E4M3ToFloat(static_cast<const uint8_t*>(pool)[element]);
  const uint8_t* bytes = static_cast<const uint8_t*>(pool);
  const uint8_t code = bytes[Fp4CodesOffset(page, slot, head_dim) + d / 2] >> (4 * (d & 1));
  const uint8_t scale = bytes[Fp4ScalesOffset(page, slot, head_dim) + d / kFp4GroupSize];
  return Fp4E2M1ToFloat(code & 0xfu) * Fp8E4M3ToFloat(scale);
}

// The whole key at page `page`, slot `slot`, decoded into out[0 .. head_dim).
INDEXER_HD void LoadKey(const void* pool, KeyStorage s, int head_dim, int64_t page, int slot,
                        float* out) {
  if (s != KeyStorage::kFp4E2M1) {
    for (int d = 0; d < head_dim; ++d) out[d] = StoredKeyValue(pool, s, head_dim, page, slot, d);
    return;
  }
  const uint8_t* codes = static_cast<const uint8_t*>(pool) + Fp4CodesOffset(page, slot, head_dim);
  const uint8_t* scales = static_cast<const uint8_t*>(pool) + Fp4ScalesOffset(page, slot, head_dim);
  for (int d = 0; d < head_dim; d += 2) {
    const float scale = Fp8E4M3ToFloat(scales[d / kFp4GroupSize]);
    out[d] = Fp4E2M1ToFloat(codes[d / 2] & 0xfu) * scale;
    out[d + 1] = Fp4E2M1ToFloat(codes[d / 2] >> 4) * scale;
  }
}

// False when a stored key byte at `offset` of a page could not have been written by StoreKey's
// rounding of a finite value: a NaN e4m3 byte (S.1111.111), as an fp8 value or an fp4 scale.
// bf16 pages are checked by their values instead (Bf16IsFinite).
INDEXER_HD bool Fp8ByteIsFinite(uint8_t b) { return (b & 0x7fu) != 0x7fu; }

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
