// Host launchers for the CUDA kernels (launchers.h): grid, block and shared memory are chosen
// here, runtime shapes become template arguments through dispatch.h.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cuda/append_keys.cuh"
#include "kernels/cuda/decode_select.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/exact_select.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/prefill_select.cuh"
#include "kernels/cuda/topk_plan.h"

namespace indexer::kernels::cuda {
namespace {

// Raises `kernel`'s dynamic shared memory limit to everything the current device offers, once
// per (device, kernel). The limit is a cap, not a reservation: occupancy follows each launch's
// own size. One fixed value per device means concurrent launches on several streams can never
// lower it under one another.
cudaError_t AllowSharedMemory(const void* kernel) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::mutex mu;
  static std::vector<std::pair<int, const void*>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(done.begin(), done.end(), std::make_pair(device, kernel)) != done.end()) {
    return cudaSuccess;
  }
  int optin = 0;
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr{};
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  const int limit = std::max(0, optin - static_cast<int>(attr.sharedSizeBytes));
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
  if (err != cudaSuccess) return err;
  done.emplace_back(device, kernel);
  return cudaSuccess;
}

template <typename Kernel>
const void* FuncPtr(Kernel kernel) {
  return reinterpret_cast<const void*>(kernel);
}

// Appends one launch of `kernel` with `args` (the kernel's parameter types exactly).
template <typename... Params, typename... Args>
cudaError_t Describe(void (*kernel)(Params...), dim3 grid, dim3 block, int64_t shared_bytes,
                     LaunchList* out, const Args&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "argument count");
  // Any dynamic shared memory: the default 48 KB limit counts static shared memory too.
  if (shared_bytes > 0) {
    const cudaError_t err = AllowSharedMemory(FuncPtr(kernel));
    if (err != cudaSuccess) return err;
  }
  if (shared_bytes < 0 || shared_bytes > 0x7fffffff) return cudaErrorInvalidValue;
  KernelLaunch* l = out->Add();
  if (l == nullptr) return cudaErrorInvalidValue;
  l->func = FuncPtr(kernel);
  l->grid = grid;
  l->block = block;
  l->shared_bytes = static_cast<unsigned>(shared_bytes);
  // Each value converted to the parameter's own type, so the bytes match the kernel's layout.
  const bool fit = (l->AddArg(static_cast<std::remove_cv_t<Params>>(args)) && ...);
  if (!fit) {
    --out->size;
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t DescribeTopk(const SpanDesc* spans, int num_spans, int32_t topk_groups,
                         int32_t max_visible_blocks, PageTableParams pt, const float* scores,
                         LaunchList* out) {
  return Describe(PrefillTopkKernel, dim3(static_cast<unsigned>(topk_groups)), dim3(256),
                  TopkSharedBytes(max_visible_blocks), out, spans, num_spans, scores, pt);
}

}  // namespace

cudaError_t LaunchList::Enqueue(cudaStream_t stream) const {
  for (int i = 0; i < size; ++i) {
    const KernelLaunch& l = items[i];
    void* args[KernelLaunch::kMaxArgs];
    l.ArgPointers(args);
    const cudaError_t err = cudaLaunchKernel(l.func, l.grid, l.block, args, l.shared_bytes, stream);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return err;
    }
  }
  return cudaSuccess;
}

int64_t TopkSharedBytes(int32_t max_visible_blocks) {
  const int64_t keys = std::max(kTopkSmemKeys, NextPow2(std::max(max_visible_blocks, 1)));
  return (keys + kTopkWarps * kWarpCandidates) * 8;
}

int64_t PrefillSharedBytes(int head_dim, KeyStorage storage) {
  int64_t bytes = 0;
  (void)INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&] {
      bytes = PrefillShape<D, S>::kSmemBytes;
      return cudaSuccess;
    });
  });
  return bytes;
}

cudaError_t LaunchAppendKeys(const AppendArgs& args, KeyStorage storage, int head_dim,
                             cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  LaunchList list;
  const cudaError_t err = INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&] {
      const int64_t threads = args.num_tokens * args.layer_count * (D / AppendValuesPerThread(S));
      const int block = 256;
      return Describe(AppendKeysKernel<D, S>, dim3(static_cast<unsigned>((threads + block - 1) / block)),
                      dim3(block), 0, &list, args);
    });
  });
  // cudaLaunchKernel returns this launch's own error; reading cudaGetLastError() after <<<>>>
  // would also return whatever an earlier, unrelated call left on this thread.
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

cudaError_t DescribeAppendKeysBatch(const AppendArgs* d_writes, int count, int64_t max_tokens_x_layers,
                                    KeyStorage storage, int head_dim, LaunchList* out) {
  if (count <= 0 || max_tokens_x_layers <= 0) return cudaSuccess;
  return INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      const int block = 128;
      // Grid-stride in x: at most 64 blocks per write, enough for a prefill chunk to spread.
      const int64_t threads = max_tokens_x_layers * (D / AppendValuesPerThread(S));
      const unsigned x = static_cast<unsigned>(std::min<int64_t>((threads + block - 1) / block, 64));
      for (int first = 0; first < count; first += 65535) {
        const unsigned y = static_cast<unsigned>(std::min(count - first, 65535));
        const cudaError_t err =
            Describe(AppendKeysBatchKernel<D, S>, dim3(x, y), dim3(block), 0, out, d_writes, first);
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    });
  });
}

cudaError_t LaunchAppendKeysBatch(const AppendArgs* d_writes, int count, int64_t max_tokens_x_layers,
                                  KeyStorage storage, int head_dim, cudaStream_t stream) {
  LaunchList list;
  const cudaError_t err =
      DescribeAppendKeysBatch(d_writes, count, max_tokens_x_layers, storage, head_dim, &list);
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

namespace {

// DescribeDecodeSelect for one head_dim, storage and number of warps per block.
template <int D, KeyStorage S, int WPB>
cudaError_t DescribeDecodeWith(const DecodeParams& params, const DecodePlan& plan, int64_t topk_bytes,
                               LaunchList* out) {
  // Shared memory: the stage ring, the unit's page ids and the per-warp maxima of two rounds,
  // reused for the top-k keys of the final selection.
  const int64_t stream_bytes = DecodeRing<D, S, WPB>::kStageBytes + DecodePageIdBytes(plan.max_chunk_blocks) +
                               int64_t{2} * kDecodeWarps * plan.max_rows * 4;
  const int64_t smem = std::max<int64_t>(stream_bytes, topk_bytes);
  DecodeParams sized;
  std::memcpy(static_cast<void*>(&sized), &params, sizeof(sized));  // padding bytes too
  sized.smem_keys = static_cast<int>(smem / 8 - kTopkWarps * kWarpCandidates);
  const auto describe = [&](auto kernel) -> cudaError_t {
    return Describe(kernel, dim3(static_cast<unsigned>(plan.total_units)), dim3(kDecodeWarps * 32), smem, out,
                    sized);
  };
  const int n_tiles = (plan.max_rows + 7) / 8;
  if (n_tiles <= 1) return describe(DecodeSelectKernel<D, S, 1, WPB>);
  if (n_tiles <= 2) return describe(DecodeSelectKernel<D, S, 2, WPB>);
  // head_dim 256 holds at most two n-tiles (MaxDecodeRows); the planner never sends more.
  return describe(DecodeSelectKernel<D, S, (D == 256 ? 2 : 4), WPB>);
}

// The variants DecodeWarpsSupported names.
template <int D, KeyStorage S>
cudaError_t DescribeDecodeFor(const DecodeParams& params, const DecodePlan& plan, int64_t topk_bytes,
                              LaunchList* out) {
  if constexpr (S == KeyStorage::kFp4E2M1) {
    if (plan.warps_per_block == 2) return DescribeDecodeWith<D, S, 2>(params, plan, topk_bytes, out);
  }
  if (plan.warps_per_block != kDecodeWarps) return cudaErrorInvalidValue;
  return DescribeDecodeWith<D, S, kDecodeWarps>(params, plan, topk_bytes, out);
}

}  // namespace

cudaError_t DescribeDecodeSelect(const SpanDesc* spans, const void* index, int num_spans, const DecodePlan& plan,
                                 KeyStorage storage, int head_dim, PageTableParams pt,
                                 float* scores, int* counters, LaunchList* out,
                                 unsigned long long* timeline) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  if (plan.max_rows > MaxDecodeRows(head_dim)) return cudaErrorInvalidValue;
  const int64_t topk_bytes = TopkSharedBytes(plan.max_visible_blocks);
  // Zeroed first: padding bytes too, so that equal launches have equal argument bytes.
  DecodeParams params;
  std::memset(static_cast<void*>(&params), 0, sizeof(params));
  params.spans = spans;
  params.index = static_cast<const unsigned char*>(index);
  params.num_spans = num_spans;
  params.chunk_blocks = plan.max_chunk_blocks;
  params.scores = scores;
  params.counters = counters;
  params.pt = pt;
  params.timeline = timeline;
  return INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      return DescribeDecodeFor<D, S>(params, plan, topk_bytes, out);
    });
  });
}

cudaError_t DescribePrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                  KeyStorage storage, int head_dim, PageTableParams pt,
                                  float* scores, LaunchList* out) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  const cudaError_t err = INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      using Shape = PrefillShape<D, S>;
      return Describe(PrefillScoreKernel<D, S>, dim3(static_cast<unsigned>(plan.total_units)),
                      dim3(Shape::kThreads), Shape::kSmemBytes, out, spans, num_spans, scores);
    });
  });
  if (err != cudaSuccess) return err;
  return DescribeTopk(spans, num_spans, plan.total_topk_groups, plan.max_visible_blocks, pt, scores, out);
}

cudaError_t DescribeExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, LaunchList* out) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  const cudaError_t err = INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      return Describe(ExactScoreKernel<D, S>, dim3(static_cast<unsigned>(plan.total_units)), dim3(128),
                      0, out, spans, num_spans, scores);
    });
  });
  if (err != cudaSuccess) return err;
  return DescribeTopk(spans, num_spans, plan.total_topk_groups, plan.max_visible_blocks, pt, scores, out);
}

cudaError_t LaunchDecodeSelect(const SpanDesc* spans, const void* index, int num_spans, const DecodePlan& plan,
                               KeyStorage storage, int head_dim, PageTableParams pt,
                               float* scores, int* counters, cudaStream_t stream,
                               unsigned long long* timeline) {
  LaunchList list;
  const cudaError_t err = DescribeDecodeSelect(spans, index, num_spans, plan, storage, head_dim, pt, scores,
                                               counters, &list, timeline);
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

cudaError_t LaunchPrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, cudaStream_t stream) {
  LaunchList list;
  const cudaError_t err =
      DescribePrefillSelect(spans, num_spans, plan, storage, head_dim, pt, scores, &list);
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

cudaError_t LaunchExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                              KeyStorage storage, int head_dim, PageTableParams pt, float* scores,
                              cudaStream_t stream) {
  LaunchList list;
  const cudaError_t err =
      DescribeExactSelect(spans, num_spans, plan, storage, head_dim, pt, scores, &list);
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

}  // namespace indexer::kernels::cuda
