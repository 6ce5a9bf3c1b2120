// The top-k's shapes, shared by the host (planners, launchers, CPU tests) and the device (the
// top-k strategies): rows rounded up to a power of two, rows per top-k CTA, shared-memory sizes.
// Plain C++, __host__ __device__ under nvcc.
#pragma once

#include <bit>
#include <cstdint>

#include "kernels/numeric.h"

namespace indexer::kernels::cuda {

// The smallest power of two >= v, for 0 <= v <= 2^30: one count of leading zeros, the same
// formula on host and device (the decode top-k's set-up calls it on its critical path, where a
// loop of dependent shifts would cost a few hundred cycles).
INDEXER_HD int32_t NextPow2(int32_t v) {
  if (v <= 1) return 1;
#ifdef __CUDA_ARCH__
  const int zeros = __clz(v - 1);
#else
  const int zeros = std::countl_zero(static_cast<uint32_t>(v - 1));
#endif
  return static_cast<int32_t>(1u << (32 - zeros));
}

// x / d for 0 <= x < 2^31 and 1 <= d < 2^31, exactly, with one multiply-high and one
// correction: magic = floor((2^32 - 1) / d) gives a quotient at most one short. The top-k kernels
// divide a row index by the span's head count for every key they load, and the GPU has no integer
// divider: a division there would dominate short passes.
struct RowDivider {
  uint32_t d = 1;
  uint32_t magic = 0xffffffffu;
  INDEXER_HD explicit RowDivider(int divisor)
      : d(static_cast<uint32_t>(divisor)), magic(0xffffffffu / static_cast<uint32_t>(divisor)) {}
  INDEXER_HD int operator()(int x) const {
    const uint32_t u = static_cast<uint32_t>(x);
    uint32_t q = static_cast<uint32_t>((uint64_t{u} * magic) >> 32);
    if ((q + 1) * d <= u) ++q;
    return static_cast<int>(q);
  }
};

// Keys (uint64) one top-k pass holds in shared memory at least, and the candidate keys each of
// the 8 warps of a top-k CTA keeps beside them.
inline constexpr int kTopkSmemKeys = 4096;
inline constexpr int kWarpCandidates = 256;
inline constexpr int kTopkWarps = 8;

// Rows sorted together by one top-k CTA for spans whose last token sees `visible_blocks`.
INDEXER_HD int TopkRowsPerGroup(int32_t visible_blocks) {
  const int n = NextPow2(visible_blocks > 1 ? visible_blocks : 1);
  return n >= kTopkSmemKeys ? 1 : kTopkSmemKeys / n;
}

}  // namespace indexer::kernels::cuda
