// A step's copies between pinned host memory and the GPU, done by the SMs: one kernel reads the
// staged inputs out of mapped pinned memory into device memory, another writes the outputs back
// into it, as the first and last nodes of the step's graph. A step then reaches the GPU as one
// graph launch and is waited for once, with no copy engine in it: a copy-engine transfer costs a
// host call to enqueue and takes longer to complete than SMs reading the same few kilobytes
// across PCIe (indexer-launch-probe measures both; docs/PERF.md).
//
// Used by the CUDA backend (engine/cuda) for every step. Thread-safe as the launchers are.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/launchers.h"

namespace indexer::kernels::cuda {

// Appends the launch that copies `bytes` from `src` to `dst`. Each side is device memory or
// pinned host memory mapped at the same address (cudaHostAllocMapped under unified addressing);
// both 16-byte aligned, not overlapping. Nothing for bytes 0; cudaErrorInvalidValue for a
// misaligned pointer or a negative size.
cudaError_t DescribeStepCopy(const void* src, void* dst, int64_t bytes, LaunchList* out);

}  // namespace indexer::kernels::cuda
