#include "kernels/cuda/device_inputs.h"

#include "kernels/numeric.h"

namespace indexer::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct Lanes8 {
  uint32_t max_bits = 0;
  int nonfinite = 0;
  int outside = 0;
};

// Eight bf16 values in one 16-byte word: clears the non-finite ones and folds the rest into *acc.
__device__ uint4 CleanWord(uint4 w, Lanes8* acc) {
  uint32_t* parts = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t out = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t v = (parts[i] >> (16 * h)) & 0xffffu;
      const uint32_t mag = v & 0x7fffu;
      const bool finite = mag < 0x7f80u;
      acc->nonfinite |= finite ? 0 : 1;
      const uint32_t kept = finite ? v : 0u;
      const uint32_t kept_mag = finite ? mag : 0u;
      acc->max_bits = max(acc->max_bits, kept_mag);
      acc->outside |= Bf16MagnitudeOutsideF16(static_cast<int>(kept_mag)) ? 1 : 0;
      out |= kept << (16 * h);
    }
    parts[i] = out;
  }
  return w;
}

__global__ void __launch_bounds__(kThreads) CopyInputsKernel(const InputChunk* chunks,
                                                             InputScan* scans) {
  const InputChunk c = chunks[blockIdx.x];
  const uint4* src = reinterpret_cast<const uint4*>(c.src);
  uint4* dst = reinterpret_cast<uint4*>(c.dst);
  const int64_t words = c.values / 8;
  Lanes8 acc;
  for (int64_t i = threadIdx.x; i < words; i += kThreads) dst[i] = CleanWord(src[i], &acc);
  const unsigned warp_max = __reduce_max_sync(0xffffffffu, acc.max_bits);
  __shared__ uint32_t warp_maxima[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_maxima[threadIdx.x / 32] = warp_max;
  const int nonfinite = __syncthreads_or(acc.nonfinite);
  const int outside = __syncthreads_or(acc.outside);
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_maxima[w]);
    scans[blockIdx.x] = InputScan{m, nonfinite, outside, 0};
  }
}

}  // namespace

cudaError_t DescribeCopyInputs(const InputChunk* chunks, int count, InputScan* scans,
                               LaunchList* out) {
  if (count == 0) return cudaSuccess;
  KernelLaunch* l = out->Add();
  if (l == nullptr) return cudaErrorInvalidValue;
  l->func = reinterpret_cast<const void*>(&CopyInputsKernel);
  l->grid = dim3(static_cast<unsigned>(count));
  l->block = dim3(kThreads);
  if (!l->AddArg(chunks) || !l->AddArg(scans)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace indexer::kernels::cuda
