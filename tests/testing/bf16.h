// Test values as the wire and the kernels carry them: bf16 bits, the little-endian bytes of a
// request's keys or queries, and random bf16 values drawn from the caller's seeded generator (so
// that a failing test can print its seed and be repeated). Header-only.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/numeric.h"

namespace indexer::testing {

// bf16 bits of `f`, rounded to nearest even (tests build keys from values exact in bf16).
inline uint16_t Bf16(float f) { return kernels::FloatToBf16(f); }

// The bytes of bf16 bits or of floats, in memory order: a request's `keys` or `queries` field.
inline std::string Bytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}
inline std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// Random bf16 values, normal(0, stddev): ties between block scores are then practically
// impossible.
template <typename Rng>
std::vector<uint16_t> RandomBf16(Rng& rng, size_t count, float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<uint16_t> v(count);
  for (auto& x : v) x = kernels::FloatToBf16(normal(rng));
  return v;
}

// Random integers in [lo, hi] as bf16 (rng() % (hi - lo + 1) + lo): dot products of such keys and
// queries are exact in fp32 and bf16, so every backend must give the same answer, ties included.
template <typename Rng>
std::vector<uint16_t> IntegerBf16(Rng& rng, size_t count, int lo, int hi) {
  const auto span = static_cast<decltype(rng())>(hi - lo + 1);
  std::vector<uint16_t> v(count);
  for (auto& x : v) x = kernels::FloatToBf16(static_cast<float>(static_cast<int>(rng() % span) + lo));
  return v;
}

}  // namespace indexer::testing
