// Host launchers for the CUDA kernels (launchers.h): grid, block and shared memory are chosen
// here, runtime shapes become template arguments through dispatch.h.
#include <algorithm>

#include "kernels/cuda/append_keys.cuh"
#include "kernels/cuda/decode_select.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/exact_select.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/prefill_select.cuh"

namespace indexer::kernels::cuda {
namespace {

// Raises a kernel's dynamic shared memory limit to `bytes` (always: the default 48 KB limit
// counts static shared memory too).
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, int64_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

cudaError_t LaunchTopk(const SpanDesc* spans, int num_spans, int32_t topk_groups,
                       int32_t max_visible_blocks, PageTableParams pt, const float* scores,
                       cudaStream_t stream) {
  const int64_t smem = TopkSharedBytes(max_visible_blocks);
  cudaError_t err = AllowSharedMemory(PrefillTopkKernel, smem);
  if (err != cudaSuccess) return err;
  PrefillTopkKernel<<<topk_groups, 256, smem, stream>>>(spans, num_spans, scores, pt);
  return cudaGetLastError();
}

}  // namespace

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
  return INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&] {
      const int64_t threads = args.num_tokens * args.layer_count * (D / 8);
      const int block = 256;
      AppendKeysKernel<D, S><<<static_cast<unsigned>((threads + block - 1) / block), block, 0, stream>>>(args);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchDecodeSelect(const SpanDesc* spans, int num_spans, const DecodePlan& plan,
                               KeyStorage storage, int head_dim, PageTableParams pt,
                               float* scores, int* counters, cudaStream_t stream) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  if (plan.max_rows > MaxDecodeRows(head_dim)) return cudaErrorInvalidValue;
  const int n_tiles = (plan.max_rows + 7) / 8;
  const int64_t topk_bytes = TopkSharedBytes(plan.max_visible_blocks);
  return INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      // Shared memory: the per-warp block maxima of a unit, reused for the top-k keys of the
      // final selection.
      const int64_t part_bytes = int64_t{plan.max_chunk_blocks} * kDecodeWarps * plan.max_rows * 4;
      const int64_t smem = std::max<int64_t>(part_bytes, topk_bytes);
      const DecodeParams params{spans, num_spans, scores, counters, pt,
                                static_cast<int>(smem / 8 - kTopkWarps * kWarpCandidates)};
      const auto launch = [&](auto kernel) -> cudaError_t {
        cudaError_t err = AllowSharedMemory(kernel, smem);
        if (err != cudaSuccess) return err;
        kernel<<<plan.total_units, kDecodeWarps * 32, smem, stream>>>(params);
        return cudaGetLastError();
      };
      if (n_tiles <= 1) return launch(DecodeSelectKernel<D, S, 1>);
      if (n_tiles <= 2) return launch(DecodeSelectKernel<D, S, 2>);
      // head_dim 256 holds at most two n-tiles (MaxDecodeRows); the planner never sends more.
      return launch(DecodeSelectKernel<D, S, (D == 256 ? 2 : 4)>);
    });
  });
}

cudaError_t LaunchPrefillSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                                KeyStorage storage, int head_dim, PageTableParams pt,
                                float* scores, cudaStream_t stream) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  cudaError_t err = INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      using Shape = PrefillShape<D, S>;
      auto kernel = PrefillScoreKernel<D, S>;
      cudaError_t e = AllowSharedMemory(kernel, Shape::kSmemBytes);
      if (e != cudaSuccess) return e;
      kernel<<<plan.total_units, Shape::kWarps * 32, Shape::kSmemBytes, stream>>>(spans, num_spans, scores);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return LaunchTopk(spans, num_spans, plan.total_topk_groups, plan.max_visible_blocks, pt, scores, stream);
}

cudaError_t LaunchExactSelect(const SpanDesc* spans, int num_spans, const PrefillPlan& plan,
                              KeyStorage storage, int head_dim, PageTableParams pt, float* scores,
                              cudaStream_t stream) {
  if (num_spans == 0 || plan.total_units == 0) return cudaSuccess;
  cudaError_t err = INDEXER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
    return INDEXER_DISPATCH_STORAGE(storage, S, [&]() -> cudaError_t {
      ExactScoreKernel<D, S><<<plan.total_units, 128, 0, stream>>>(spans, num_spans, scores);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return LaunchTopk(spans, num_spans, plan.total_topk_groups, plan.max_visible_blocks, pt, scores, stream);
}

}  // namespace indexer::kernels::cuda
