// Small device helpers shared by the CUDA selectors: tensor-core mma, ldmatrix, cp.async,
// fp8 -> bf16 / f16 and fp4 -> f16 conversion, and the forced-score rule of SPEC.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/numeric.h"

namespace indexer::kernels::cuda {

// D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, fp32 accumulate.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A(16x16, row) * B(16x8, col) + D, f16 inputs, fp32 accumulate.
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte global -> shared copy that bypasses L1.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
// 4-byte global -> shared copy (through L1: .cg takes 16 bytes only).
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Two e4m3 bytes (low byte first) -> two bf16 in one register, exactly (every e4m3 value is a
// bf16 value): e4m3 -> f16 in hardware, then f16 -> f32 -> bf16, both exact here.
__device__ __forceinline__ uint32_t Fp8x2ToBf16x2(uint16_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Two e4m3 bytes (low byte first) -> two f16 in one register, exactly, in one instruction.
__device__ __forceinline__ uint32_t Fp8x2ToF16x2(uint16_t v) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(v));
  return h;
}

// The upper two e4m3 bytes of `v` (byte 2 first) -> two f16, exactly. The conversion reads the
// register's upper half itself when given it as a 16-bit half of `v`; a 32-bit shift to form
// the operand would cost an instruction per pair.
__device__ __forceinline__ uint32_t Fp8x2HiToF16x2(uint32_t v) {
  uint32_t h;
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
      : "=r"(h)
      : "r"(v));
  return h;
}

// Two bf16 -> two f16. Exact only for values that f16 represents (the backend routes queries
// outside [2^-14, 65504] elsewhere).
__device__ __forceinline__ uint32_t Bf16x2ToF16x2(uint32_t v) {
  const float lo = __uint_as_float(v << 16);
  const float hi = __uint_as_float(v & 0xffff0000u);
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two f16 products, a * b per half, rounded to nearest (exact where the callers use it).
__device__ __forceinline__ uint32_t MulF16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 2^6: DecodeFp4Word's code bytes are code * 2^-6, so what it decodes with the bare scale, and
// every sum of it, is 2^-6 of the stored value; this, or kF16x2TwoPow6 (f16x2 of 2^6 in both
// halves), takes the factor back.
inline constexpr float kFp4CodeFactor = 64.f;
inline constexpr uint32_t kF16x2TwoPow6 = 0x54005400u;

// One fp4 key's scale bytes (D / 16, one per group) in registers, from a staged page.
template <int D>
struct Fp4ScaleRow {
  static constexpr int kWords = D / 64;
  uint32_t words[kWords];

  // `row`: the key's first scale byte in shared memory (D / 16-byte aligned).
  __device__ __forceinline__ void Load(const unsigned char* row) {
    if constexpr (kWords == 1) {
      words[0] = *reinterpret_cast<const uint32_t*>(row);
    } else if constexpr (kWords == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(row);
      words[0] = v.x;
      words[1] = v.y;
    } else {
      const uint4 v = *reinterpret_cast<const uint4*>(row);
      words[0] = v.x;
      words[1] = v.y;
      words[2] = v.z;
      words[3] = v.w;
    }
  }

  // The scale of group `group_base` + t / 2 in both halves of an f16x2 (exact). group_base is a
  // multiple of 2 known at compile time; t < 4.
  __device__ __forceinline__ uint32_t F16x2(int group_base, int t) const {
    const uint32_t byte = static_cast<uint32_t>((group_base & 3) + (t >> 1));
    const uint32_t pair = __byte_perm(words[group_base >> 2], 0u, byte * 0x11u);
    return Fp8x2ToF16x2(static_cast<uint16_t>(pair & 0xffffu));
  }
};

// Eight e2m1 codes (nibble k = value k of a run of 8 in one group) -> code * 2^-6 * m as f16,
// with `m` in both halves: e4m3 bytes of code * 2^-6 (numeric.h's Fp4CodesToE4M3), converted to
// f16 exactly, times m. Exact for m = scale * 2^6 (code * scale, at most 6 * 448) and for
// m = scale (code * scale * 2^-6: six significant bits at most, from 2^-16 to 42, never an f16
// rounding), which spares a multiply where a power-of-two factor can be applied to the sums.
// out[0] = values (0, 2), out[1] = (4, 6), out[2] = (1, 3), out[3] = (5, 7), the first of each
// pair in the low half.
__device__ __forceinline__ void DecodeFp4Word(uint32_t w, uint32_t m, uint32_t (&out)[4]) {
  uint32_t even, odd;
  Fp4CodesToE4M3(w, &even, &odd);
  out[0] = MulF16x2(Fp8x2ToF16x2(static_cast<uint16_t>(even & 0xffffu)), m);
  out[1] = MulF16x2(Fp8x2HiToF16x2(even), m);
  out[2] = MulF16x2(Fp8x2ToF16x2(static_cast<uint16_t>(odd & 0xffffu)), m);
  out[3] = MulF16x2(Fp8x2HiToF16x2(odd), m);
}

// f16x2 -> two floats, exactly.
__device__ __forceinline__ float2 F16x2ToFloat2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// Two floats that bf16 represents -> bf16x2 (low half first), exactly.
__device__ __forceinline__ uint32_t Float2ToBf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// SPEC.md step 3 for block b of a row that sees v blocks.
__device__ __forceinline__ float ForcedScore(float raw, int64_t b, int64_t v, int init_blocks,
                                             int local_blocks) {
  float s = raw;
  if (b < init_blocks) s = kInitScore;
  if (b >= v - local_blocks) s = kLocalScore;
  return s;
}

// max that leaves NaN out: the running value starts as NaN ("none yet").
__device__ __forceinline__ float MaxSkipNaN(float acc, float x) { return fmaxf(acc, x); }

__device__ __forceinline__ float NaNf() { return __int_as_float(0x7fffffff); }

// Nanoseconds of the GPU's global timer (the kernel benchmark's --timeline).
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0 writes the time into `stamps[slot]` (DecodeTimelineSlot, span_desc.h) when stamps is
// set: the kernel benchmark's --timeline.
__device__ __forceinline__ void Stamp(unsigned long long* stamps, int slot) {
  if (stamps != nullptr && threadIdx.x == 0) stamps[slot] = GlobalTimer();
}

}  // namespace indexer::kernels::cuda
