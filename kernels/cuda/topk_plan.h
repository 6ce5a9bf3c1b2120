// The top-k's one decision and its shapes, shared by the host (planners, launchers, CPU tests) and
// the device (topk.cuh's SelectRows and the strategies it dispatches to): which strategy selects a
// group of rows and how it lays them out (ChooseTopk), rows rounded up to a power of two, rows per
// top-k CTA, shared-memory sizes. Plain C++, __host__ __device__ under nvcc, so that the CPU tests
// pin every choice.
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

// Keys one thread of the threshold pass holds at most, and rows of one threshold pass at most.
inline constexpr int kThresholdKeys = 16;
inline constexpr int kThresholdRowsPerPass = 8;

// The largest topk the register strategy takes, and the most key vectors (32 keys each) one of
// its warps holds: NextPow2(rows) * n <= 32 * kTopkWarps * kRegisterVectors.
inline constexpr int kRegisterTopK = 16;
inline constexpr int kRegisterVectors = 16;

// The kernel a top-k runs in, which bounds what it may use. The decode selector's last CTA has
// registers to spare: rows in registers and the threshold pass. The prefill top-k kernel runs four
// CTAs per multiprocessor in 64 registers, with many rows per CTA that are too short or too many
// for those to pay: it takes rows of 33 to 64 blocks straight into registers, the rest through
// shared memory.
enum class TopkCaller { kDecodeSelector, kPrefillTopk };

// The strategies, one file each (topk.cuh lists them).
enum class TopkStrategy {
  kShortRows,      // short_rows_topk.cuh: one warp per row of 33 to 64 blocks, in registers
  kRegisters,      // register_topk.cuh: up to 8 rows across the warps' registers
  kThresholdPass,  // threshold_topk.cuh, then the shared-keys selection for the rows it leaves
  kSharedKeys,     // shared_keys_topk.cuh: every row's keys through shared memory
};

// How a warp of the shared-keys strategy selects one row of n keys, `kept` of them.
enum class SharedRowMethod {
  kRankInWarp,      // n <= 32: each lane's key written at its rank
  kTwoKeysPerLane,  // n == 64, kept <= 32: WarpTop32Of64 in registers
  kWarpSort,        // other rows of up to 64 keys, or up to kWarpCandidates with kept > 32: the
                    // warp sorts a copy of the row
  kWarpTopK,        // kept <= 32: WarpTopK's threshold and candidates; the whole-row sort when
                    // they overflow
  kWholeRowSort,    // kept > 32 on rows longer than kWarpCandidates: bitonic_topk.cuh
};

// What ChooseTopk decides for one group of rows; fields outside the chosen strategy are unused.
// `kept` and `row_method` are KeptKeys and ChooseSharedRowMethod, which the device's shared-keys
// code evaluates where it uses them (SelectFromSharedKeys says why); the dispatcher reads the
// rest.
struct TopkChoice {
  TopkStrategy strategy = TopkStrategy::kSharedKeys;
  // kThresholdPass and kSharedKeys: keys kept per row, min(n, NextPow2(topk)); ids past them are
  // -1 (the register and short-row strategies keep 16 and 32).
  int kept = 1;
  // kRegisters: warps per row (1, 2, 4 or 8) and key vectors per warp (1, 2, 4, 8 or 16).
  int warps_per_row = 1;
  int vectors_per_warp = 0;
  // kThresholdPass: threads per row (32 or 64) and the candidate keys each row's list holds after
  // the pass's keys (a power of two). kThresholdPass and kSharedKeys: rows per pass through shared
  // memory, and how a warp selects a row from the shared keys.
  int threads_per_row = 64;
  int candidates_per_row = kWarpCandidates;
  int rows_per_pass = 1;
  SharedRowMethod row_method = SharedRowMethod::kWholeRowSort;
};

// Keys a row of n keys keeps for `topk` ids: topk rounded up to a power of two, at most n.
INDEXER_HD int KeptKeys(int n, int topk) {
  const int topk_pow2 = NextPow2(topk);
  return n < topk_pow2 ? n : topk_pow2;
}

// How the shared-keys strategy selects a row of n keys keeping `kept` (SharedRowMethod).
INDEXER_HD SharedRowMethod ChooseSharedRowMethod(int n, int kept) {
  if (n <= 32) return SharedRowMethod::kRankInWarp;
  if (n == 64 && kept <= 32) return SharedRowMethod::kTwoKeysPerLane;
  if (n <= 64 || (n <= kWarpCandidates && kept > 32)) return SharedRowMethod::kWarpSort;
  if (kept <= 32) return SharedRowMethod::kWarpTopK;
  return SharedRowMethod::kWholeRowSort;
}

// The top-k of `rows` rows (1 <= rows) of n = NextPow2(V) keys each, `topk` ids per row, by a CTA
// of `threads` threads of `caller`:
//  - kShortRows (prefill): rows of 33 to 64 keys, topk <= 32;
//  - kRegisters (decode): up to 8 rows with NextPow2(rows) * n <= 4096, topk <= kRegisterTopK, 256
//    threads; each row on min(8 / NextPow2(rows), n / 32) warps (at least one);
//  - kThresholdPass (decode): 2 or more rows of 512 to 1024 keys, topk <= 32, 256 threads, where
//    it pays (shorter and single rows select as fast from shared memory); two warps per row for up
//    to four rows or rows over 512 keys, else one;
//  - kSharedKeys: everything else, in one pass of every row.
INDEXER_HD TopkChoice ChooseTopk(TopkCaller caller, int rows, int n, int topk, int threads) {
  TopkChoice c;
  const int cta_threads = kTopkWarps * 32;
  if (caller == TopkCaller::kPrefillTopk) {
    if (n > 32 && n <= 64 && topk <= 32) {
      c.strategy = TopkStrategy::kShortRows;
      return c;
    }
  } else if (rows >= 1 && rows <= kTopkWarps && topk <= kRegisterTopK &&
             NextPow2(rows) * n <= 32 * kTopkWarps * kRegisterVectors && threads == cta_threads) {
    const int warps_by_rows = kTopkWarps / NextPow2(rows);
    const int warps_by_keys = n / 32;
    const int warps = warps_by_rows < warps_by_keys ? warps_by_rows : warps_by_keys;
    c.strategy = TopkStrategy::kRegisters;
    c.warps_per_row = warps > 1 ? warps : 1;
    const int vectors = n / (32 * c.warps_per_row);
    c.vectors_per_warp = vectors > 1 ? vectors : 1;
    return c;
  }
  c.kept = KeptKeys(n, topk);
  c.threads_per_row = (rows <= 4 || n > 32 * kThresholdKeys) ? 64 : 32;
  const bool threshold = caller == TopkCaller::kDecodeSelector && rows >= 2 && n >= 512 &&
                         n <= 64 * kThresholdKeys && topk <= 32 && threads == cta_threads;
  c.strategy = threshold ? TopkStrategy::kThresholdPass : TopkStrategy::kSharedKeys;
  c.rows_per_pass = threshold ? threads / c.threads_per_row : rows;
  const int lists = (kTopkWarps * kWarpCandidates) / NextPow2(c.rows_per_pass);
  c.candidates_per_row = kWarpCandidates < lists ? kWarpCandidates : lists;
  c.row_method = ChooseSharedRowMethod(n, c.kept);
  return c;
}

}  // namespace indexer::kernels::cuda
