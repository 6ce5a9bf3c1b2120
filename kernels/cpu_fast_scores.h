// The CPU backend's block scorer: ScoreBlocks (cpu_reference.h) with exactly its results -- the
// same products and sums in the same order, so every bit agrees -- but written for speed: each
// key row is decoded once per token straight into registers' worth of floats, the span's query
// rows are converted once, nothing is allocated per call, and on processors with AVX2 the dot
// products run eight lanes wide (chosen once, at run time). The reference stays the plain
// definition every backend is tested against; tests/kernels compares the two bit for bit.
//
// Pure and thread-safe, like the reference; the same preconditions.
#pragma once

#include <cstdint>

#include "kernels/select_types.h"

namespace indexer::kernels {

void ScoreBlocksFast(const KeyPoolView& keys, const SpanSelect& span, int64_t block_begin,
                     int64_t block_end, float* raw, int64_t raw_stride);

}  // namespace indexer::kernels
