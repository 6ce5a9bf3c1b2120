// kernels/numeric.h: bf16 and fp8 e4m3 rounding, bf16 ranges (and kernels/bf16_scan.h's scan of
// them), and the selection order key.
//
// Expected values are worked out by hand in the comments (e4m3: 1 sign, 4 exponent bits with
// bias 7, 3 mantissa bits; code = sign << 7 | exponent << 3 | mantissa; exponent 0 is subnormal,
// value mantissa * 2^-9), and checked exhaustively against brute-force nearest-value rounding
// written here, independent of numeric.h.
#include "kernels/bf16_scan.h"
#include "kernels/numeric.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#if defined(INDEXER_TEST_HAVE_CUDA_FP8) && __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define INDEXER_COMPARE_WITH_CUDA_FP8 1
#else
#define INDEXER_COMPARE_WITH_CUDA_FP8 0
#endif

namespace indexer::kernels {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Value of an e4m3 code, from the format's definition (not from numeric.h).
double Fp8Value(uint8_t code) {
  const int e = (code >> 3) & 0xf;
  const int m = code & 0x7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// Brute force: the finite e4m3 code nearest to finite x, ties to the even code (codes of one sign
// are ordered by value, so "even mantissa" is "even code"), saturating at +-448 by construction
// (448 = code 0x7e is the nearest finite code to anything larger).
uint8_t NearestFp8(float x) {
  const double a = std::fabs(static_cast<double>(x));
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double err = std::fabs(Fp8Value(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

// Brute force fp32 -> bf16 for finite f: of the two bf16 values around f, the nearer one, ties
// to the even one. The value past the largest finite bf16 is 2^128, as if the exponent went on;
// landing there means overflow to Inf, as IEEE rounding does.
uint16_t NearestBf16(float f) {
  const uint32_t u = ToBits(f);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t mag = u & 0x7fffffffu;
  const uint32_t lo = mag & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u;
  const double v = std::fabs(static_cast<double>(f));
  const double vlo = static_cast<double>(FromBits(lo));
  const double vhi = hi == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(FromBits(hi));
  uint32_t pick;
  if (v - vlo < vhi - v) {
    pick = lo;
  } else if (v - vlo > vhi - v) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1u) == 0 ? lo : hi;
  }
  return static_cast<uint16_t>((pick | sign) >> 16);
}

// ---------------------------------------------------------------------------------------------
// fp8 e4m3

TEST(Fp8E4M3, EveryFiniteCodeRoundTripsExactly) {
  int checked = 0;
  for (int c = 0; c < 256; ++c) {
    if (c == 0x7f || c == 0xff) continue;  // the NaN codes never occur in the cache
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = Fp8E4M3ToFloat(code);
    EXPECT_EQ(static_cast<double>(v), Fp8Value(code)) << "code 0x" << std::hex << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << "code 0x" << std::hex << c;
    EXPECT_EQ(FloatToFp8E4M3(v), code) << "code 0x" << std::hex << c << " value " << v;
    ++checked;
  }
  EXPECT_EQ(checked, 254);
}

TEST(Fp8E4M3, KnownCodes) {
  EXPECT_EQ(FloatToFp8E4M3(1.0f), 0x38);     // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(FloatToFp8E4M3(-2.0f), 0xc0);    // sign, exponent 8
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7e);   // exponent 15, mantissa 6: the largest finite
  EXPECT_EQ(FloatToFp8E4M3(0x1p-6f), 0x08);  // smallest normal
  EXPECT_EQ(FloatToFp8E4M3(0x1p-9f), 0x01);  // smallest subnormal
  EXPECT_EQ(FloatToFp8E4M3(7 * 0x1p-9f), 0x07);  // largest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xb9), -1.125f);
}

TEST(Fp8E4M3, TiesGoToEvenAtSeveralExponents) {
  // [1, 2): step 2^-3. 1.0625 is halfway between 1.0 (mantissa 0, even) and 1.125 (1): -> 1.0.
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);
  // 1.1875 is halfway between 1.125 (mantissa 1) and 1.25 (mantissa 2, even): -> 1.25.
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);
  // 1.9375 is halfway between 1.875 (mantissa 7, odd) and 2.0 (next exponent, mantissa 0): -> 2.
  EXPECT_EQ(FloatToFp8E4M3(1.9375f), 0x40);
  // [256, 448]: step 32. 272: 256 (even) vs 288 -> 256. 304: 288 vs 320 (even) -> 320.
  EXPECT_EQ(FloatToFp8E4M3(272.0f), 0x78);
  EXPECT_EQ(FloatToFp8E4M3(304.0f), 0x7a);
  // 432: 416 (mantissa 5) vs 448 (mantissa 6, even) -> 448.
  EXPECT_EQ(FloatToFp8E4M3(432.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-432.0f), 0xfe);
  // [2^-6, 2^-5): step 2^-9. 2^-6 + 2^-10: mantissa 0 (even) vs 1 -> 2^-6.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-6f + 0x1p-10f), 0x08);
  // 2^-6 + 3 * 2^-10 = 2^-6 + 1.5 * 2^-9: mantissa 1 vs 2 (even) -> code 0x0a.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-6f + 3 * 0x1p-10f), 0x0a);
  // Subnormals, multiples of 2^-9: 2^-10 = 0.5 * 2^-9: 0 (even) vs 1 -> 0.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-10f), 0x00);
  // 3 * 2^-10 = 1.5 * 2^-9: 1 vs 2 (even) -> 2 * 2^-9 = 2^-8.
  EXPECT_EQ(FloatToFp8E4M3(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(3 * 0x1p-10f)), 0x1p-8f);
  // 5 * 2^-10 = 2.5 * 2^-9 -> 2 (even) = 2^-8.
  EXPECT_EQ(FloatToFp8E4M3(5 * 0x1p-10f), 0x02);
  // 7 * 2^-10 = 3.5 * 2^-9 -> 4 (even) = 2^-7.
  EXPECT_EQ(FloatToFp8E4M3(7 * 0x1p-10f), 0x04);
  // 13 * 2^-10 = 6.5 * 2^-9 -> 6 (even).
  EXPECT_EQ(FloatToFp8E4M3(13 * 0x1p-10f), 0x06);
  // 15 * 2^-10 = 7.5 * 2^-9: 7 vs 8 (even) -> 8 * 2^-9 = 2^-6, the smallest normal.
  EXPECT_EQ(FloatToFp8E4M3(15 * 0x1p-10f), 0x08);
  EXPECT_EQ(FloatToFp8E4M3(-3 * 0x1p-10f), 0x82);
  // Just past a tie rounds away from it.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-10f + 0x1p-24f), 0x01);
  EXPECT_EQ(FloatToFp8E4M3(1.0625f + 0x1p-20f), 0x39);
  EXPECT_EQ(FloatToFp8E4M3(272.0f - 0.001f), 0x78);
  EXPECT_EQ(FloatToFp8E4M3(1.07f), 0x39);   // nearer 1.125 than 1.0
  EXPECT_EQ(FloatToFp8E4M3(420.0f), 0x7d);  // nearer 416 than 448
  EXPECT_EQ(FloatToFp8E4M3(440.0f), 0x7e);  // nearer 448 than 416
}

TEST(Fp8E4M3, SaturatesAt448) {
  for (float x : {448.0f, 449.0f, 464.0f, 480.0f, 1000.0f, 1e6f, 3e38f, FLT_MAX}) {
    EXPECT_EQ(FloatToFp8E4M3(x), 0x7e) << x;
    EXPECT_EQ(FloatToFp8E4M3(-x), 0xfe) << -x;
  }
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(3e38f)), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(-1e6f)), -448.0f);
}

TEST(Fp8E4M3, SignOfZero) {
  EXPECT_EQ(FloatToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  // Below half the smallest subnormal: rounds to a zero of the same sign.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-11f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0x1p-11f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(-0x1p-10f), 0x80);  // tie to even: -0
  EXPECT_EQ(FloatToFp8E4M3(FromBits(0x80000001u)), 0x80);  // negative fp32 denormal
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
  EXPECT_EQ(Fp8E4M3ToFloat(0x80), 0.0f);
  EXPECT_FALSE(std::signbit(Fp8E4M3ToFloat(0x00)));
}

TEST(Fp8E4M3, EveryFiniteBf16MatchesBruteForceNearest) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if (!Bf16IsFinite(bits)) continue;
    const float x = Bf16ToFloat(bits);
    ASSERT_EQ(FloatToFp8E4M3(x), NearestFp8(x)) << "bf16 0x" << std::hex << b << " = " << x;
  }
}

TEST(Fp8E4M3, RandomFloatsMatchBruteForceNearest) {
  std::mt19937_64 rng(12345);
  // Uniform over exponents that cover subnormal-fp8 .. saturation, with random mantissas.
  std::uniform_int_distribution<int> exp(-14, 12);
  std::uniform_int_distribution<uint32_t> man(0, (1u << 23) - 1);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t u = (static_cast<uint32_t>(exp(rng) + 127) << 23) | man(rng) |
                       ((i & 1) ? 0x80000000u : 0u);
    const float x = FromBits(u);
    ASSERT_EQ(FloatToFp8E4M3(x), NearestFp8(x)) << "fp32 0x" << std::hex << u << " = " << x;
  }
}

TEST(Fp8E4M3, MatchesCudaSatfiniteConversion) {
#if INDEXER_COMPARE_WITH_CUDA_FP8
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if (!Bf16IsFinite(bits)) continue;
    const float x = Bf16ToFloat(bits);
    const __nv_fp8_storage_t nv = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    ASSERT_EQ(FloatToFp8E4M3(x), static_cast<uint8_t>(nv))
        << "bf16 0x" << std::hex << b << " = " << x;
  }
#else
  GTEST_SKIP() << "cuda_fp8.h is not usable with this host compiler; comparison skipped";
#endif
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(Bf16, RangeRuleMatchesF16NormalRangeByValue) {
  // Every finite bf16, against f16's normal range stated in floats: zero, or 2^-14 <= |x| <= 65504.
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if (!Bf16IsFinite(bits)) continue;
    const float mag = std::fabs(Bf16ToFloat(bits));
    const bool in_f16 = mag == 0.0f || (mag >= std::ldexp(1.0f, -14) && mag <= 65504.0f);
    ASSERT_EQ(Bf16MagnitudeOutsideF16(bits & 0x7fff), !in_f16) << "bf16 0x" << std::hex << b;
  }
}

// The form host scans take (least key, greatest magnitude) agrees with testing every value.
TEST(Bf16, RangeOfAScanMatchesEveryValueInF16) {
  const auto in_f16 = [](uint16_t bits) {
    const float mag = std::fabs(Bf16ToFloat(bits));
    return mag == 0.0f || (mag >= std::ldexp(1.0f, -14) && mag <= 65504.0f);
  };
  const auto scan_fits = [](const std::vector<uint16_t>& values) {
    int16_t least = kBf16NoNonzero, greatest = 0;
    for (uint16_t v : values) {
      const int16_t mag = static_cast<int16_t>(v & 0x7fff);
      least = std::min(least, Bf16LeastNonzeroKey(mag));
      greatest = std::max(greatest, mag);
    }
    return Bf16MagnitudesFitF16(least, greatest);
  };
  EXPECT_TRUE(scan_fits({}));
  EXPECT_TRUE(scan_fits({0x0000, 0x8000}));  // zeros of either sign
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if (!Bf16IsFinite(bits)) continue;
    ASSERT_EQ(scan_fits({bits}), in_f16(bits)) << "bf16 0x" << std::hex << b;
    ASSERT_EQ(scan_fits({0x0000, bits, 0x3f80}), in_f16(bits)) << "bf16 0x" << std::hex << b;
  }
  std::mt19937 rng(7);
  // Magnitudes around both ends of f16's range, where one value decides.
  std::uniform_int_distribution<int> near(0, 3);
  std::uniform_int_distribution<int> step(-3, 3);
  std::uniform_int_distribution<int> size(1, 8);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint16_t> values(size(rng));
    bool all = true;
    for (uint16_t& v : values) {
      const int kind = near(rng);
      const int base = kind == 0 ? 0 : kind == 1 ? 0x3880 : kind == 2 ? 0x477f : 0x3f80;
      const int mag = kind == 0 ? 0 : base + step(rng);
      v = static_cast<uint16_t>(mag | ((rng() & 1) ? 0x8000 : 0));
      all = all && in_f16(v);
    }
    ASSERT_EQ(scan_fits(values), all) << "set " << i;
  }
}

// The one-pass scan against each value tested on its own, at every length around the vector
// widths (the tails), with non-finite values anywhere.
TEST(Bf16, ScanMatchesEveryValueOnItsOwn) {
  std::mt19937 rng(11);
  const uint16_t specials[] = {0x0000, 0x8000, 0x3880, 0x387f, 0x477f, 0x4780, 0x0001,
                               0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x3f80, 0xbf80};
  for (int n = 0; n <= 140; ++n) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<uint16_t> v(static_cast<size_t>(n));
      for (uint16_t& x : v) {
        const uint32_t pick = rng() % 8;
        x = pick < 2 ? specials[rng() % std::size(specials)]
                     : static_cast<uint16_t>(pick < 5 ? 0x3000 + rng() % 0x2000 : rng());
      }
      bool finite = true, fits = true;
      uint16_t greatest = 0;
      for (uint16_t x : v) {
        finite = finite && Bf16IsFinite(x);
        greatest = std::max<uint16_t>(greatest, x & 0x7fff);
        fits = fits && !Bf16MagnitudeOutsideF16(x & 0x7fff);
      }
      const Bf16Scan scan = ScanBf16Bits(v.data(), n);
      ASSERT_EQ(scan.all_finite, finite) << "n " << n << " trial " << trial;
      if (!finite) continue;
      ASSERT_EQ(scan.max_magnitude, greatest) << "n " << n << " trial " << trial;
      ASSERT_EQ(scan.fits_f16, fits) << "n " << n << " trial " << trial;
    }
  }
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 is halfway between 1.0 (0x3f80, even) and 1 + 2^-7 (0x3f81): -> 0x3f80.
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8: halfway between 0x3f81 and 0x3f82 (even) -> 0x3f82.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // past the tie: up
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f - 0x1p-23f), 0x3f80);  // short of it: down
  EXPECT_EQ(FloatToBf16(-(1.0f + 3 * 0x1p-8f)), 0xbf82);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  // fp32 denormals: 0x00008000 is a tie between 0 (even) and 0x0001 -> 0; 0x00018000 -> 0x0002.
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000u)), 0x0000);
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)), 0x0002);
  // Carry into the exponent: 0x3fffffff rounds up to 2.0.
  EXPECT_EQ(FloatToBf16(FromBits(0x3fffffffu)), 0x4000);
}

TEST(Bf16, OverflowBecomesInfinity) {
  EXPECT_EQ(FloatToBf16(FLT_MAX), 0x7f80);
  EXPECT_EQ(FloatToBf16(-FLT_MAX), 0xff80);
  EXPECT_EQ(FloatToBf16(3.4e38f), 0x7f80);
  // 0x7f7f8000 is the tie between the largest bf16 (0x7f7f, odd) and 2^128: -> Inf.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f8000u)), 0x7f80);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f7fffu)), 0x7f7f);  // just below: stays finite
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_FALSE(Bf16IsFinite(0x7f80));
  EXPECT_FALSE(Bf16IsFinite(0xff80));
  EXPECT_TRUE(Bf16IsFinite(0x7f7f));
}

TEST(Bf16, NanStaysNan) {
  // Including NaNs whose payload lies only in the 16 bits that are dropped.
  for (uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7f80ffffu, 0x7fffffffu,
                     0x7fbfffffu}) {
    const uint16_t b = FloatToBf16(FromBits(u));
    EXPECT_TRUE(std::isnan(Bf16ToFloat(b))) << std::hex << u << " -> " << b;
    EXPECT_FALSE(Bf16IsFinite(b));
    EXPECT_EQ(b & 0x8000u, (u >> 16) & 0x8000u) << "sign of NaN";
  }
}

TEST(Bf16, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f = Bf16ToFloat(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), bits) << std::hex << b;
  }
}

TEST(Bf16, RandomFloatsMatchBruteForceNearest) {
  std::mt19937_64 rng(777);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties are rare by chance: force them
    const float f = FromBits(u);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(FloatToBf16(f), NearestBf16(f)) << std::hex << u;
  }
}

// ---------------------------------------------------------------------------------------------
// Selection order

// The order SPEC.md step 4 defines, written out: larger score first, ties to the lower id.
bool Better(float sa, int32_t a, float sb, int32_t b) {
  if (sa != sb) return sa > sb;  // -0.0 == +0.0 here
  return a < b;
}

TEST(SelectionKey, LargerScoreWinsWhateverTheIds) {
  EXPECT_GT(SelectionKey(2.0f, 1000), SelectionKey(1.0f, 0));
  EXPECT_GT(SelectionKey(-1.0f, 9), SelectionKey(-2.0f, 1));
  EXPECT_GT(SelectionKey(0x1p-149f, 5), SelectionKey(0.0f, 0));  // denormal > 0
  EXPECT_GT(SelectionKey(0.0f, 5), SelectionKey(-0x1p-149f, 0));
  // The ladder of SPEC.md's special scores against ordinary ones, ids adversarial (higher id
  // for higher score, so that an id-dominated key would get it backwards).
  const float ladder[] = {kEmptyScore, -1e29f, -1e20f, -1.0f, 0.0f, 1.0f, 1e20f, kLocalScore,
                          kInitScore};
  for (int i = 0; i + 1 < 9; ++i) {
    EXPECT_LT(SelectionKey(ladder[i], 0), SelectionKey(ladder[i + 1], 100 + i)) << i;
  }
  EXPECT_LT(SelectionKey(-std::numeric_limits<float>::infinity(), 0), SelectionKey(kEmptyScore, 9));
  EXPECT_GT(SelectionKey(std::numeric_limits<float>::infinity(), 9), SelectionKey(kInitScore, 0));
}

TEST(SelectionKey, TiesGoToTheLowerId) {
  EXPECT_GT(SelectionKey(1.0f, 3), SelectionKey(1.0f, 4));
  EXPECT_GT(SelectionKey(kEmptyScore, 0), SelectionKey(kEmptyScore, 1));
  EXPECT_GT(SelectionKey(kInitScore, 0), SelectionKey(kInitScore, 2147483647));
}

TEST(SelectionKey, NegativeZeroEqualsPositiveZero) {
  EXPECT_EQ(SelectionKey(-0.0f, 7), SelectionKey(0.0f, 7));
  EXPECT_GT(SelectionKey(-0.0f, 1), SelectionKey(0.0f, 2));
  EXPECT_GT(SelectionKey(0.0f, 1), SelectionKey(-0.0f, 2));
}

TEST(SelectionKey, BlockIdRoundTrips) {
  for (int32_t b : {0, 1, 5, 127, 4096, 1 << 28, 2147483647}) {
    EXPECT_EQ(SelectionKeyBlock(SelectionKey(3.5f, b)), b);
    EXPECT_EQ(SelectionKeyBlock(SelectionKey(-0.0f, b)), b);
    EXPECT_EQ(SelectionKeyBlock(SelectionKey(kEmptyScore, b)), b);
  }
}

TEST(SelectionKey, RandomPairsAgreeWithTheExplicitOrder) {
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<int32_t> id(0, 1 << 20);
  const auto random_score = [&]() {
    switch (rng() % 5) {
      case 0: return static_cast<float>(static_cast<int>(rng() % 7) - 3);  // frequent ties
      case 1: return (rng() & 1) ? 0.0f : -0.0f;
      default: {
        float f;
        do f = FromBits(static_cast<uint32_t>(rng())); while (!std::isfinite(f));
        return f;
      }
    }
  };
  for (int i = 0; i < 200000; ++i) {
    const float sa = random_score(), sb = random_score();
    const int32_t a = id(rng), b = (rng() % 4 == 0) ? a : id(rng);
    if (a == b && sa == sb) continue;
    ASSERT_EQ(SelectionKey(sa, a) > SelectionKey(sb, b), Better(sa, a, sb, b))
        << sa << "/" << a << " vs " << sb << "/" << b;
  }
}

// Value of an e2m1 code, from the format's definition (1 sign, 2 exponent bits with bias 1,
// 1 mantissa bit; exponent 0 is subnormal, value mantissa * 0.5).
double Fp4Value(uint8_t code) {
  const int e = (code >> 1) & 3;
  const int m = code & 1;
  const double mag = e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  return (code & 8) ? -mag : mag;
}

// Brute force: the e2m1 code nearest to x, ties to the even code (codes of one sign are ordered
// by value, so the even mantissa bit is the even code), saturating at +-6 by construction.
uint8_t NearestFp4(float x) {
  const double a = std::fabs(static_cast<double>(x));
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 8; ++c) {
    const double err = std::fabs(Fp4Value(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 8 : 0));
}

TEST(Fp4E2M1, DecodesEveryCode) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(ToBits(Fp4E2M1ToFloat(static_cast<uint8_t>(c))), ToBits(want[c])) << c;
    EXPECT_EQ(Fp4E2M1ToFloat(static_cast<uint8_t>(c)), static_cast<float>(Fp4Value(c))) << c;
    // Exact values round to themselves.
    EXPECT_EQ(FloatToFp4E2M1(want[c]), c) << c;
  }
}

TEST(Fp4E2M1, TiesGoToTheEvenMantissa) {
  // SPEC.md's list: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  EXPECT_EQ(FloatToFp4E2M1(0.25f), 0x0);
  EXPECT_EQ(FloatToFp4E2M1(0.75f), 0x2);
  EXPECT_EQ(FloatToFp4E2M1(1.25f), 0x2);
  EXPECT_EQ(FloatToFp4E2M1(1.75f), 0x4);
  EXPECT_EQ(FloatToFp4E2M1(2.5f), 0x4);
  EXPECT_EQ(FloatToFp4E2M1(3.5f), 0x6);
  EXPECT_EQ(FloatToFp4E2M1(5.0f), 0x6);
  EXPECT_EQ(FloatToFp4E2M1(-5.0f), 0xe);
  EXPECT_EQ(FloatToFp4E2M1(-0.25f), 0x8);  // the sign stays on a zero code
  // Just past each midpoint goes up.
  EXPECT_EQ(FloatToFp4E2M1(std::nextafter(0.25f, 1.0f)), 0x1);
  EXPECT_EQ(FloatToFp4E2M1(std::nextafter(0.75f, 0.0f)), 0x1);
  EXPECT_EQ(FloatToFp4E2M1(std::nextafter(1.25f, 2.0f)), 0x3);
  EXPECT_EQ(FloatToFp4E2M1(std::nextafter(5.0f, 6.0f)), 0x7);
}

TEST(Fp4E2M1, SaturatesAtSix) {
  EXPECT_EQ(FloatToFp4E2M1(6.0f), 0x7);
  EXPECT_EQ(FloatToFp4E2M1(6.5f), 0x7);
  EXPECT_EQ(FloatToFp4E2M1(1e30f), 0x7);
  EXPECT_EQ(FloatToFp4E2M1(-3e38f), 0xf);
}

TEST(Fp4E2M1, MatchesNearestValueOnEveryQuarterAndAtRandom) {
  for (int i = -64; i <= 64; ++i) {
    const float x = static_cast<float>(i) * 0.125f;
    EXPECT_EQ(FloatToFp4E2M1(x), NearestFp4(x)) << x;
  }
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = u(rng);
    ASSERT_EQ(FloatToFp4E2M1(x), NearestFp4(x)) << x;
  }
}

// The scale of a group: e4m3(amax / 6), with the quotient rounded in fp32.
TEST(Fp4Group, ScaleRoundsTheQuotientToE4M3) {
  EXPECT_EQ(Fp4GroupScale(6.0f), FloatToFp8E4M3(1.0f));
  EXPECT_EQ(Fp8E4M3ToFloat(Fp4GroupScale(7.0f)), 1.125f);  // 1.1667 -> 1.125
  EXPECT_EQ(Fp4GroupScale(0.0f), 0x00);
  // Saturation: amax / 6 past 448.
  EXPECT_EQ(Fp4GroupScale(6.0f * 448.0f), 0x7e);
  EXPECT_EQ(Fp4GroupScale(3e38f), 0x7e);
  // Subnormal scales: amax / 6 = 2^-9 is the smallest subnormal; half of it ties to 0.
  EXPECT_EQ(Fp4GroupScale(6.0f * 0x1p-9f), 0x01);
  EXPECT_EQ(Fp4GroupScale(6.0f * 0x1p-10f), 0x00);
  EXPECT_EQ(Fp4GroupScale(std::nextafter(6.0f * 0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(Fp4GroupScale(6.0f * 3 * 0x1p-10f), 0x02);  // 1.5 * 2^-9 -> 2 * 2^-9 (even)
  for (int i = 0; i < 4096; ++i) {
    const float amax = Bf16ToFloat(static_cast<uint16_t>(i * 8));  // positive bf16 values
    if (!std::isfinite(amax)) break;
    EXPECT_EQ(Fp4GroupScale(amax), NearestFp8(amax / 6.0f)) << amax;
  }
}

std::vector<uint16_t> Group(std::initializer_list<float> values) {
  std::vector<uint16_t> g(kFp4GroupSize, FloatToBf16(0.0f));
  int i = 0;
  for (float v : values) g[i++] = FloatToBf16(v);
  return g;
}

float Decoded(const uint8_t* codes, uint8_t scale, int i) {
  return Fp4E2M1ToFloat(static_cast<uint8_t>((codes[i / 2] >> (4 * (i % 2))) & 0xf)) *
         Fp8E4M3ToFloat(scale);
}

TEST(Fp4Group, QuantisesAgainstTheGroupsScale) {
  // amax 6: scale 1, codes are the values rounded to e2m1; nibble order low = even index.
  const std::vector<uint16_t> g = Group({6, -1.25f, 0.75f, 5, -6, 2.5f, 0.1f, -0.3f});
  uint8_t codes[8];
  const uint8_t scale = QuantizeFp4Group(g.data(), codes);
  EXPECT_EQ(Fp8E4M3ToFloat(scale), 1.0f);
  EXPECT_EQ(codes[0], 0x7 | (0xa << 4));  // 6, -1
  EXPECT_EQ(codes[1], 0x2 | (0x6 << 4));  // 1, 4
  EXPECT_EQ(codes[2], 0xf | (0x4 << 4));  // -6, 2
  EXPECT_EQ(codes[3], 0x0 | (0x9 << 4));  // 0, -0.5
  for (int i = 8; i < 16; ++i) EXPECT_EQ(Decoded(codes, scale, i), 0.0f);
}

TEST(Fp4Group, RoundedScaleCanSaturateCodes) {
  // amax 7: scale 1.125 (7/6 rounded down), 7 / 1.125 = 6.22 saturates at 6: stored 6.75.
  const std::vector<uint16_t> g = Group({7, -7, 1});
  uint8_t codes[8];
  const uint8_t scale = QuantizeFp4Group(g.data(), codes);
  EXPECT_EQ(Decoded(codes, scale, 0), 6.75f);
  EXPECT_EQ(Decoded(codes, scale, 1), -6.75f);
  EXPECT_EQ(Decoded(codes, scale, 2), 1.125f);  // 1 / 1.125 = 0.89 -> 1
}

TEST(Fp4Group, ZeroAndUnderflowingGroupsStoreZeroCodes) {
  uint8_t codes[8];
  std::vector<uint16_t> zeros = Group({0.0f, -0.0f});
  EXPECT_EQ(QuantizeFp4Group(zeros.data(), codes), 0x00);
  for (uint8_t c : codes) EXPECT_EQ(c, 0x00);
  // amax 2^-12: amax / 6 rounds to scale 0, so every code is 0 (not -0).
  std::vector<uint16_t> tiny = Group({0x1p-12f, -0x1p-12f});
  EXPECT_EQ(QuantizeFp4Group(tiny.data(), codes), 0x00);
  for (uint8_t c : codes) EXPECT_EQ(c, 0x00);
  // amax 6 * 2^-9: the smallest subnormal scale; values are whole codes of it.
  std::vector<uint16_t> sub = Group({6 * 0x1p-9f, -3 * 0x1p-9f, 0x1p-10f});
  const uint8_t scale = QuantizeFp4Group(sub.data(), codes);
  EXPECT_EQ(scale, 0x01);
  EXPECT_EQ(Decoded(codes, scale, 0), 6 * 0x1p-9f);
  EXPECT_EQ(Decoded(codes, scale, 1), -3 * 0x1p-9f);
  EXPECT_EQ(Decoded(codes, scale, 2), 0x1p-10f);  // 0.5 * 2^-9, the smallest stored magnitude
}

TEST(Fp4Group, LargeValuesUseTheSaturatedScale) {
  const std::vector<uint16_t> g = Group({1e6f, 3000.0f, -2688.0f});
  uint8_t codes[8];
  const uint8_t scale = QuantizeFp4Group(g.data(), codes);
  EXPECT_EQ(Fp8E4M3ToFloat(scale), 448.0f);
  EXPECT_EQ(Decoded(codes, scale, 0), 2688.0f);
  EXPECT_EQ(Decoded(codes, scale, 1), 2688.0f);
  EXPECT_EQ(Decoded(codes, scale, 2), -2688.0f);
}

// Every stored value is exactly a code times its scale, and its code is the brute-force nearest
// to the value over the scale, on random groups of many magnitudes.
TEST(Fp4Group, RandomGroupsMatchTheDefinition) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint16_t> g(kFp4GroupSize);
    const float mag = std::ldexp(1.0f, exponent(rng));
    for (uint16_t& v : g) v = FloatToBf16(normal(rng) * mag);
    uint8_t codes[8];
    const uint8_t scale = QuantizeFp4Group(g.data(), codes);
    float amax = 0.0f;
    for (uint16_t v : g) amax = std::max(amax, std::fabs(Bf16ToFloat(v)));
    ASSERT_EQ(scale, NearestFp8(amax / 6.0f));
    const float sf = Fp8E4M3ToFloat(scale);
    for (int k = 0; k < kFp4GroupSize; ++k) {
      const uint8_t code = static_cast<uint8_t>((codes[k / 2] >> (4 * (k % 2))) & 0xf);
      const uint8_t want = sf == 0.0f ? 0 : NearestFp4(Bf16ToFloat(g[k]) / sf);
      ASSERT_EQ(code, want) << Bf16ToFloat(g[k]) << " / " << sf;
    }
  }
}

// The GPU decoder's rewrite of e2m1 codes as e4m3 bytes: every code, in every nibble of a word,
// becomes an e4m3 byte of exactly code * 2^-6, and code * 2^-6 times scale * 2^6 is code * scale
// for every scale (the products the decode selector forms in f16; all of them exact there too:
// at most 6 significant bits, magnitudes in [2^-10, 2688]).
TEST(Fp4E2M1, CodesRewrittenAsE4M3BytesKeepTheirValues) {
  for (int pos = 0; pos < 8; ++pos) {
    for (uint32_t code = 0; code < 16; ++code) {
      // Nibble k holds k, but nibble pos holds `code`.
      const uint32_t w = (0x76543210u & ~(0xfu << (4 * pos))) | (code << (4 * pos));
      uint32_t even, odd;
      Fp4CodesToE4M3(w, &even, &odd);
      for (int k = 0; k < 8; ++k) {
        const uint32_t bytes = k % 2 == 0 ? even : odd;
        const uint8_t byte = static_cast<uint8_t>((bytes >> (8 * (k / 2))) & 0xffu);
        const uint8_t c = static_cast<uint8_t>((w >> (4 * k)) & 0xfu);
        ASSERT_EQ(ToBits(Fp8E4M3ToFloat(byte)), ToBits(Fp4E2M1ToFloat(c) * 0x1p-6f))
            << pos << " " << k;
      }
    }
  }
  for (int s = 0; s < 0x7f; ++s) {
    const float scale = Fp8E4M3ToFloat(static_cast<uint8_t>(s));
    for (int c = 0; c < 16; ++c) {
      const double exact = Fp4Value(static_cast<uint8_t>(c)) * scale;
      const float code = Fp4E2M1ToFloat(static_cast<uint8_t>(c));
      EXPECT_EQ(static_cast<double>(code * 0x1p-6f * (scale * 64.0f)), exact);
      // Representable in f16: 11 significant bits, normal from 2^-14 (or zero).
      if (exact != 0.0) {
        const double a = std::fabs(exact);
        EXPECT_GE(a, 0x1p-14);
        EXPECT_LE(a, 65504.0);
        const double ulp = std::ldexp(1.0, std::ilogb(a) - 10);
        EXPECT_EQ(std::fmod(a, ulp), 0.0) << exact;
      }
    }
  }
}

TEST(StoredKey, DecodesEveryStorage) {
  constexpr int kD = 32;
  std::vector<uint16_t> key(kD);
  for (int d = 0; d < kD; ++d) key[d] = FloatToBf16(static_cast<float>(d % 7) - 3.0f);
  for (KeyStorage s : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    std::vector<uint8_t> pool(static_cast<size_t>(2 * PageBytes(s, kD)), 0xff);
    StoreKey(pool.data(), s, kD, 1, 5, key.data());
    float row[kD];
    LoadKey(pool.data(), s, kD, 1, 5, row);
    for (int d = 0; d < kD; ++d) {
      // |values| <= 3 in groups whose amax is 3: scale 0.5, all values exact in every storage.
      EXPECT_EQ(row[d], Bf16ToFloat(key[d])) << static_cast<int>(s) << " " << d;
      EXPECT_EQ(StoredKeyValue(pool.data(), s, kD, 1, 5, d), row[d]);
    }
    ClearKey(pool.data(), s, kD, 1, 5);
    LoadKey(pool.data(), s, kD, 1, 5, row);
    for (int d = 0; d < kD; ++d) EXPECT_EQ(row[d], 0.0f);
  }
  EXPECT_EQ(KeyBytes(KeyStorage::kBf16, 128), 256);
  EXPECT_EQ(KeyBytes(KeyStorage::kFp8E4M3, 128), 128);
  EXPECT_EQ(KeyBytes(KeyStorage::kFp4E2M1, 128), 72);
  EXPECT_EQ(PageBytes(KeyStorage::kFp4E2M1, 64), 128 * 36);
  EXPECT_EQ(Fp4ScalesOffset(0, 0, 128), 128 * 64);
}

}  // namespace
}  // namespace indexer::kernels
