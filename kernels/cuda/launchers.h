// Host launchers of the CUDA kernels. Each picks its grid, block and shared memory, launches on
// `stream` and returns the launch's cudaError_t (it does not synchronize). Callers (the CUDA
// backend, GPU tests, the benchmark) own every buffer; all pointers are device pointers except
// where a parameter says host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/span_desc.h"

namespace indexer::kernels::cuda {

// Scatters keys into the pool, converting bf16 to the storage type. `keys` is bf16 bits
// [num_tokens][layer_count][head_dim]; layer layer_begin + l starts at position layer_start[l].
struct AppendArgs {
  void* pool = nullptr;             // layer 0's pool; layer l is at pool + l * layer_bytes
  int64_t layer_bytes = 0;
  const int32_t* block_table = nullptr;
  const int64_t* layer_start = nullptr;  // [layer_count]
  int layer_begin = 0;
  int layer_count = 1;
  int64_t num_tokens = 0;
  const uint16_t* keys = nullptr;
};
cudaError_t LaunchAppendKeys(const AppendArgs& args, KeyStorage storage, int head_dim,
                             cudaStream_t stream);

// Fused decode selection for spans with at most MaxDecodeRows(head_dim) rows each: scores and top-k (and
// page tables) in one launch. `spans` (device) was planned by PlanDecode; `plan` is its host
// result. `scores` holds plan.score_floats floats; `counters` holds num_spans ints, zero before
// the first launch (each launch leaves them zero).
cudaError_t LaunchDecodeSelect(const SpanDesc* spans, int num_spans, const DecodePlan& plan,
                               KeyStorage storage, int head_dim, PageTableParams pt,
                               float* scores, int* counters, cudaStream_t stream);

// Prefill selection (any number of rows): tensor-core block scores into `scores`
// (plan.score_floats floats), then top-k and page tables.
cudaError_t LaunchPrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, cudaStream_t stream);

// Exact selection (the CPU reference's arithmetic) for spans planned by PlanPrefill; see
// exact_select.cuh for when the backend uses it.
cudaError_t LaunchExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                              KeyStorage storage, int head_dim, PageTableParams pt, float* scores,
                              cudaStream_t stream);

// Shared memory the selectors need for spans whose longest sees `max_visible_blocks` blocks,
// and the prefill scorer's; the backend refuses configurations past what the device offers.
int64_t TopkSharedBytes(int32_t max_visible_blocks);
int64_t PrefillSharedBytes(int head_dim, KeyStorage storage);

}  // namespace indexer::kernels::cuda
