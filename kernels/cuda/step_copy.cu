#include "kernels/cuda/step_copy.h"

#include <algorithm>

namespace indexer::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Enough CTAs for every 16-byte word of a step's staging (a few hundred KB) to be in flight
// across PCIe at once; larger copies stride.
constexpr int64_t kMaxBlocks = 512;

// 16-byte words by every thread of the grid, then the last bytes by one thread.
__global__ void __launch_bounds__(kThreads) StepCopyKernel(const uint4* src, uint4* dst,
                                                           int64_t bytes) {
  const int64_t words = bytes / 16;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < words; i += stride) {
    dst[i] = src[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    for (int64_t b = words * 16; b < bytes; ++b) d[b] = s[b];
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

cudaError_t DescribeStepCopy(const void* src, void* dst, int64_t bytes, LaunchList* out) {
  if (bytes < 0 || !Aligned16(src) || !Aligned16(dst)) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  KernelLaunch* l = out->Add();
  if (l == nullptr) return cudaErrorInvalidValue;
  const int64_t words = std::max<int64_t>(bytes / 16, 1);
  l->func = reinterpret_cast<const void*>(StepCopyKernel);
  l->grid = dim3(static_cast<unsigned>(std::min((words + kThreads - 1) / kThreads, kMaxBlocks)));
  l->block = dim3(kThreads);
  const bool fit = l->AddArg(static_cast<const uint4*>(src)) &&
                   l->AddArg(static_cast<uint4*>(dst)) && l->AddArg(bytes);
  if (!fit) {
    --out->size;
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace indexer::kernels::cuda
