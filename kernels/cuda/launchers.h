// Host launchers of the CUDA kernels. Each picks its grid, block and shared memory and returns a
// cudaError_t (it does not synchronize). Callers (the CUDA backend, GPU tests, the benchmark) own
// every buffer; all pointers are device pointers except where a parameter says host.
//
// The selectors are described before they are launched: Describe* appends KernelLaunch values
// (function, grid, block, shared memory, argument bytes) to a LaunchList, and Launch* is
// Describe* then LaunchList::Enqueue. The CUDA backend turns the same descriptions into the
// kernel nodes of a CUDA graph, or updates a cached graph's nodes with them.
//
// Thread-safe: launchers may run on several host threads and streams at once (the backend's
// lanes), on any device (the current one). A kernel launched with dynamic shared memory gets the
// device's whole opt-in limit once per device, never a per-launch value that a concurrent launch
// could lower under another. Launches go through cudaLaunchKernel, whose return value is that
// launch's own error (never one an unrelated earlier call left in the thread's error state).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/span_plan.h"
#include "kernels/numeric.h"
#include "kernels/select_types.h"

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
// `count` writes whose AppendArgs (pointing at device memory) are at `d_writes`, in one launch
// (or a few, past 65535 writes). `max_tokens_x_layers`: the largest num_tokens * layer_count.
// Describe* appends the launches to *out (in stream order); Launch* enqueues them.
struct LaunchList;
cudaError_t DescribeAppendKeysBatch(const AppendArgs* d_writes, int count, int64_t max_tokens_x_layers,
                                    KeyStorage storage, int head_dim, LaunchList* out);
cudaError_t LaunchAppendKeysBatch(const AppendArgs* d_writes, int count, int64_t max_tokens_x_layers,
                                  KeyStorage storage, int head_dim, cudaStream_t stream);

// One kernel launch as data. Argument values are copied in, each at its type's alignment, in
// the kernel's parameter order; the types must be exactly the kernel's parameter types.
struct KernelLaunch {
  static constexpr int kMaxArgs = 6;
  static constexpr int kMaxArgBytes = 128;

  const void* func = nullptr;
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  unsigned shared_bytes = 0;
  int num_args = 0;
  int used_bytes = 0;
  int arg_offset[kMaxArgs] = {};
  alignas(16) unsigned char arg_bytes[kMaxArgBytes] = {};

  // False (and nothing added) when the argument does not fit.
  template <typename T>
  bool AddArg(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel arguments are copied bytewise");
    static_assert(alignof(T) <= 16, "argument alignment above 16");
    const int at = (used_bytes + static_cast<int>(alignof(T)) - 1) / static_cast<int>(alignof(T)) *
                   static_cast<int>(alignof(T));
    if (num_args == kMaxArgs || at + static_cast<int>(sizeof(T)) > kMaxArgBytes) return false;
    std::memcpy(arg_bytes + at, &value, sizeof(T));
    arg_offset[num_args++] = at;
    used_bytes = at + static_cast<int>(sizeof(T));
    return true;
  }
  // Fills args[0, num_args) with pointers to the argument values, as cudaLaunchKernel and
  // cudaKernelNodeParams::kernelParams take them (they copy the values; they never write).
  void ArgPointers(void** args) const {
    for (int i = 0; i < num_args; ++i) args[i] = const_cast<unsigned char*>(arg_bytes + arg_offset[i]);
  }
  // Same function, shape and argument bytes: a graph node holding `other` needs no update.
  bool SameAs(const KernelLaunch& other) const {
    return func == other.func && grid.x == other.grid.x && grid.y == other.grid.y &&
           grid.z == other.grid.z && block.x == other.block.x && block.y == other.block.y &&
           block.z == other.block.z && shared_bytes == other.shared_bytes &&
           num_args == other.num_args && used_bytes == other.used_bytes &&
           std::memcmp(arg_offset, other.arg_offset, sizeof(arg_offset)) == 0 &&
           std::memcmp(arg_bytes, other.arg_bytes, static_cast<size_t>(used_bytes)) == 0;
  }
};

// The launches of one step, in stream order: the input copy, the copy of device inputs, the key
// writes (one launch per 65535), the selectors (at most five: decode, prefill score and top-k,
// exact score and top-k), the output copy.
struct LaunchList {
  static constexpr int kMaxLaunches = 12;
  std::array<KernelLaunch, kMaxLaunches> items;
  int size = 0;

  // A fresh launch at the end, or nullptr when the list is full.
  KernelLaunch* Add() {
    if (size == kMaxLaunches) return nullptr;
    items[size] = KernelLaunch{};
    return &items[size++];
  }
  // Launches every item on `stream`, in order; stops at the first error and returns it (the
  // thread's last-error state is cleared).
  cudaError_t Enqueue(cudaStream_t stream) const;
};

// Fused decode selection for spans with at most MaxDecodeRows(head_dim) rows each: scores and
// top-k (and page tables) in one launch. `spans` (device) was planned by PlanDecode; `plan` is
// its host result; `index` (device) is WriteDecodeIndex's image of the same spans. `scores` holds plan.score_floats floats; `counters` holds num_spans ints, zero
// before the first launch (each launch leaves them zero). Describes nothing when there is no work.
// `timeline`, for the kernel benchmark only (nullptr elsewhere), receives kDecodeTimelineSlots
// %globaltimer stamps (decode_select.cuh says which); slot 0 must start at ~0ull, the rest at 0.
cudaError_t DescribeDecodeSelect(const SpanDesc* spans, const void* index, int num_spans, const DecodePlan& plan,
                                 KeyStorage storage, int head_dim, PageTableParams pt,
                                 float* scores, int* counters, LaunchList* out,
                                 unsigned long long* timeline = nullptr);
cudaError_t LaunchDecodeSelect(const SpanDesc* spans, const void* index, int num_spans, const DecodePlan& plan,
                               KeyStorage storage, int head_dim, PageTableParams pt,
                               float* scores, int* counters, cudaStream_t stream,
                               unsigned long long* timeline = nullptr);

// Prefill selection (any number of rows): tensor-core block scores into `scores`
// (plan.score_floats floats), then top-k and page tables. Two launches.
cudaError_t DescribePrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                  KeyStorage storage, int head_dim, PageTableParams pt,
                                  float* scores, LaunchList* out);
cudaError_t LaunchPrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, cudaStream_t stream);

// Exact selection (the CPU reference's arithmetic) for spans planned by PlanPrefill; see
// exact_select.cuh for when the backend uses it. Two launches.
cudaError_t DescribeExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, LaunchList* out);
cudaError_t LaunchExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                              KeyStorage storage, int head_dim, PageTableParams pt, float* scores,
                              cudaStream_t stream);

// Shared memory the selectors need for spans whose longest sees `max_visible_blocks` blocks,
// and the prefill scorer's; the backend refuses configurations past what the device offers.
int64_t TopkSharedBytes(int32_t max_visible_blocks);
int64_t PrefillSharedBytes(int head_dim, KeyStorage storage);

}  // namespace indexer::kernels::cuda
