// Hopper warpgroup matrix multiply (wgmma, sm_90a only) for the prefill scorer: shared-memory
// descriptors, fences and one m64n128k16 bf16 instruction with A in registers. Callers compile
// the code that uses these only where INDEXER_HAVE_WGMMA is defined (the sm_90a device pass);
// every other target takes its mma.sync fallback.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define INDEXER_HAVE_WGMMA 1
#endif

namespace indexer::kernels::cuda {

#if defined(INDEXER_HAVE_WGMMA)

// Descriptor of a K-major bf16 tile in shared memory with 128-byte swizzled rows: 8-row atoms of
// 1 KB, one after the other (stride 1024 bytes), the tile's base 1024-aligned; chunk c (16 bytes)
// of row r sits at r * 128 + ((c ^ (r & 7)) << 4). Advancing the start address by 32 bytes moves
// one k-step of 16 elements along the row (add 2 to the descriptor).
__device__ __forceinline__ uint64_t WgmmaDescSw128(uint32_t smem_addr) {
  return uint64_t{(smem_addr & 0x3ffffu) >> 4} | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Orders this warpgroup's earlier register and shared-memory accesses before its next wgmma.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (st.shared, cp.async) visible to the
// async proxy that wgmma reads through; then a CTA barrier publishes them to every warpgroup.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator accesses across an asynchronous wgmma (used on every
// accumulator register before WgmmaFence and after WgmmaWait).
__device__ __forceinline__ void WgmmaFenceOperand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d(64 x 128, fp32, per warp mma.sync's C fragment for each 8 columns: d[4j..4j+3] are columns
// 8j + 2t, +1 of rows g and g + 8) = a(64 x 16 bf16, registers, per warp mma.sync's A fragment of
// its 16 rows) * b(16 x 128, K-major in shared memory, `desc`) + (accumulate ? d : 0).
// Asynchronous: WgmmaFence before, WgmmaCommit and WgmmaWait after.
__device__ __forceinline__ void WgmmaM64N128K16Bf16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc,
                                                    bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %69, p, 1, 1, 0;\n"
      "}\n"
      :
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
      "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
      "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
      "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
      "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
      "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<int>(accumulate)), "l"(desc));
}

#endif  // INDEXER_HAVE_WGMMA

}  // namespace indexer::kernels::cuda
