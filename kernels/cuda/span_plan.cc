#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/span_plan.h"

#include "kernels/bf16_scan.h"
#include "kernels/cuda/topk_plan.h"
#include "kernels/select_types.h"

namespace indexer::kernels::cuda {

DecodePlan PlanDecode(std::span<SpanDesc> spans, int num_sms, int max_chunk_blocks) {
  DecodePlan plan;
  int64_t total_blocks = 0;
  for (SpanDesc& s : spans) {
    s.visible_blocks = static_cast<int32_t>(VisibleBlocks(s.start_pos + s.num_tokens - 1));
    total_blocks += s.visible_blocks;
  }
  // One wave of CTAs (two per multiprocessor) when the batch is small, so one long span spreads
  // over the whole GPU; fatter CTAs (up to max_chunk_blocks) when it is large, so per-CTA set-up
  // and the final atomics are amortised.
  const int64_t slots = int64_t{2} * std::max(1, num_sms);
  const int32_t chunk = static_cast<int32_t>(
      std::clamp<int64_t>((total_blocks + slots - 1) / slots, 1, std::max(1, max_chunk_blocks)));
  plan.max_chunk_blocks = chunk;
  for (SpanDesc& s : spans) {
    s.row_tiles = 1;
    s.chunk_blocks = chunk;
    s.block_chunks = (s.visible_blocks + chunk - 1) / chunk;
    s.unit_begin = plan.total_units;
    s.score_offset = plan.score_floats;
    plan.total_units += s.block_chunks;
    plan.score_floats += int64_t{s.Rows()} * s.visible_blocks;
    plan.max_rows = std::max(plan.max_rows, s.Rows());
    plan.max_visible_blocks = std::max(plan.max_visible_blocks, s.visible_blocks);
  }
  return plan;
}

void WriteDecodeIndex(std::span<const SpanDesc> planned, void* out) {
  const size_t n = planned.size();
  auto* base = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    const SpanDesc& s = planned[i];
    std::memcpy(base + 8 * i, &s.block_table, 8);
    std::memcpy(base + 8 * n + 4 * i, &s.unit_begin, 4);
    std::memcpy(base + 12 * n + 4 * i, &s.visible_blocks, 4);
  }
}

PrefillPlan PlanPrefill(std::span<SpanDesc> spans, int row_tile) {
  PrefillPlan plan;
  for (SpanDesc& s : spans) {
    s.visible_blocks = static_cast<int32_t>(VisibleBlocks(s.start_pos + s.num_tokens - 1));
    s.row_tiles = (s.Rows() + row_tile - 1) / row_tile;
    // 16 blocks (2 MB of bf16 keys) per CTA: enough to amortise loading the query tile, small
    // enough that causal triangles and long prefixes split into many CTAs.
    s.chunk_blocks = 16;
    s.block_chunks = (s.visible_blocks + s.chunk_blocks - 1) / s.chunk_blocks;
    s.unit_begin = plan.total_units;
    s.score_offset = plan.score_floats;
    s.topk_group_begin = plan.total_topk_groups;
    plan.total_units += s.row_tiles * s.block_chunks;
    const int rows_per_group = TopkRowsPerGroup(s.visible_blocks);
    plan.total_topk_groups += (s.Rows() + rows_per_group - 1) / rows_per_group;
    plan.score_floats += int64_t{s.Rows()} * s.visible_blocks;
    plan.max_visible_blocks = std::max(plan.max_visible_blocks, s.visible_blocks);
  }
  return plan;
}

Bf16Range ScanBf16(const uint16_t* values, int64_t n) {
  // Values are finite (the engine refuses others).
  const Bf16Scan scan = ScanBf16Bits(values, n);
  Bf16Range r;
  r.max_abs = Bf16ToFloat(scan.max_magnitude);
  r.fits_f16 = scan.fits_f16;
  return r;
}

SpanPath ChoosePath(int rows, int head_dim, KeyStorage storage, const Bf16Range& queries,
                    float max_abs_key) {
  // Bound on any partial sum's magnitude; past 2^126 fp32 overflow (Inf, NaN) becomes possible
  // and the tensor cores, which keep products exact, could answer differently.
  // fp4 stores at most 6 * 448 and, below that, at most amax * (1 + 2^-4) (the scale rounds up
  // by at most half an e4m3 step) plus the absolute error of a subnormal scale.
  const double key_bound = storage == KeyStorage::kFp4E2M1
                               ? std::min(2688.0, max_abs_key * 1.0625 + 0.01)
                               : static_cast<double>(max_abs_key);
  const double bound = static_cast<double>(head_dim) * queries.max_abs * key_bound;
  if (bound >= 0x1p126) return SpanPath::kExact;
  if (rows > MaxDecodeRows(head_dim)) return SpanPath::kPrefill;
  if (storage != KeyStorage::kBf16 && !queries.fits_f16) return SpanPath::kExact;
  return SpanPath::kDecode;
}

}  // namespace indexer::kernels::cuda
