// Append: scatters incoming bf16 keys into their pages, storing bf16, fp8 e4m3 or fp4 with the
// same rounding as the CPU backend (kernels/numeric.h). One thread per 8 values (bf16, fp8) or
// per fp4 group of 16 (its scale needs the whole group's largest magnitude).
#pragma once

#include "kernels/cuda/launchers.h"
#include "kernels/numeric.h"

namespace indexer::kernels::cuda {

// Values one thread stores.
INDEXER_HD constexpr int AppendValuesPerThread(KeyStorage s) {
  return s == KeyStorage::kFp4E2M1 ? kFp4GroupSize : 8;
}

// Stores the i-th run of AppendValuesPerThread(S) values of write `a`.
template <int D, KeyStorage S>
__device__ __forceinline__ void AppendKeyVector(const AppendArgs& a, int64_t i) {
  constexpr int kVecs = D / AppendValuesPerThread(S);
  const int64_t total = a.num_tokens * a.layer_count * kVecs;
  if (i >= total) return;
  const int v = static_cast<int>(i % kVecs);
  const int64_t tl = i / kVecs;  // token * layer_count + layer
  const int l = static_cast<int>(tl % a.layer_count);
  const int64_t j = tl / a.layer_count;
  const int64_t pos = a.layer_start[l] + j;
  const int64_t page = a.block_table[pos / kBlockSize];
  const int64_t slot = page * kBlockSize + pos % kBlockSize;
  char* layer = static_cast<char*>(a.pool) + (a.layer_begin + l) * a.layer_bytes;
  if constexpr (S == KeyStorage::kFp4E2M1) {
    const uint4* src = reinterpret_cast<const uint4*>(a.keys) + 2 * i;
    const uint4 lo = src[0], hi = src[1];
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint16_t values[kFp4GroupSize];
#pragma unroll
    for (int k = 0; k < kFp4GroupSize; ++k) {
      values[k] = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
    }
    uint32_t codes[2];
    const int t = static_cast<int>(pos % kBlockSize);
    unsigned char* scales = reinterpret_cast<unsigned char*>(layer) + Fp4ScalesOffset(page, t, D);
    scales[v] = QuantizeFp4Group(values, reinterpret_cast<uint8_t*>(codes));
    uint2* row = reinterpret_cast<uint2*>(layer + Fp4CodesOffset(page, t, D));
    row[v] = make_uint2(codes[0], codes[1]);
    return;
  }
  const uint4 in = reinterpret_cast<const uint4*>(a.keys)[i];
  if constexpr (S == KeyStorage::kBf16) {
    reinterpret_cast<uint4*>(layer + slot * D * 2)[v] = in;
  } else {
    const uint32_t w[4] = {in.x, in.y, in.z, in.w};
    uint32_t out[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t b = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
      out[k / 4] |= uint32_t{FloatToFp8E4M3(Bf16ToFloat(b))} << (8 * (k % 4));
    }
    reinterpret_cast<uint2*>(layer + slot * D)[v] = make_uint2(out[0], out[1]);
  }
}

template <int D, KeyStorage S>
__global__ void AppendKeysKernel(const AppendArgs a) {
  AppendKeyVector<D, S>(a, int64_t{blockIdx.x} * blockDim.x + threadIdx.x);
}

// Many writes in one launch: write `first + blockIdx.y` of `writes` (device memory); the grid's
// x dimension covers the largest of them.
template <int D, KeyStorage S>
__global__ void AppendKeysBatchKernel(const AppendArgs* writes, int first) {
  const AppendArgs a = writes[first + blockIdx.y];
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
       i < a.num_tokens * a.layer_count * (D / AppendValuesPerThread(S));
       i += int64_t{gridDim.x} * blockDim.x) {
    AppendKeyVector<D, S>(a, i);
  }
}

}  // namespace indexer::kernels::cuda
