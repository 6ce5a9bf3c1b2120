// Device-resident inputs of a step: keys and queries a client left in a CUDA region, which the
// step reads without any host copy. One kernel copies them into the step's device staging (where
// the append and select kernels read them, as they read inputs that came from the host) and
// does on the way what the host does for host inputs: it replaces NaN and Inf by 0 (the engine
// then fails the item, as it refuses such values from the host) and finds the largest magnitude
// and whether every value fits f16, which choose a span's path (ChoosePath).
//
// StepStaging plans the chunks and reads the scans back; the CUDA backend runs the launch first
// in its step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/launchers.h"

namespace indexer::kernels::cuda {

// One piece of a device input: `values` bf16 values (a multiple of 8, both pointers 16-byte
// aligned) from `src` to `dst`.
struct InputChunk {
  const uint16_t* src = nullptr;
  uint16_t* dst = nullptr;
  int64_t values = 0;
};

// What the copy of one chunk found.
struct InputScan {
  uint32_t max_bits = 0;   // the largest finite magnitude's bf16 bits (sign cleared)
  int32_t nonfinite = 0;   // 1 when a value was NaN or Inf (stored as 0)
  int32_t outside_f16 = 0; // 1 when a finite non-zero magnitude lies outside [2^-14, 65504]
  int32_t unused = 0;
};

// Values per chunk: one CTA copies one chunk.
inline constexpr int64_t kInputChunkValues = int64_t{1} << 15;

// Appends the launch that copies `count` chunks (device array `chunks`) and writes one InputScan
// per chunk to `scans` (device). Nothing for count 0.
cudaError_t DescribeCopyInputs(const InputChunk* chunks, int count, InputScan* scans,
                               LaunchList* out);

}  // namespace indexer::kernels::cuda
