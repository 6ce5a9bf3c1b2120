// indexer-stream-probe: how fast one GPU streams paged index keys, by access pattern.
//
// A development probe behind the decode selector's design (docs/PERF.md), not part of the
// service: it reads N pages of 32 KB (128 tokens x 128 dims x bf16) in random page order, each
// CTA taking a run of 32 pages as the decode selector does, and folds every word into a checksum
// so that no load is dropped. Patterns:
//   quad    : register loads where lane t of quad g reads 64 contiguous bytes of row g, one tile
//             in flight per warp
//   line    : the same bytes per warp, each warp instruction reading 512 contiguous bytes
//   cpa     : cp.async 16-byte copies of whole pages into 3 shared-memory stages; destination
//             straight, XOR-swizzled in 16-byte chunks, or straight but 16 bytes off a 32-byte
//             boundary (where a 16-byte static shared variable puts an unaligned dynamic block)
//   units   : the decode selector's work-unit shapes on that pipeline (16 pages per CTA): as is,
//             with three dependent loads before the first copy (its span search, descriptor and
//             page ids), and "flowing" (resident CTAs only, the ring never drained between units)
//   bulk    : one cp.async.bulk (TMA) copy per page into 4 stages, on mbarriers; with an L2
//             evict-first policy; and one 256-byte copy per key row into padded rows
// Timing as kernel_bench: L2 flushed (256 MB memset) before each run, CUDA events, median of 15.
//
//   indexer-stream-probe PAGES[/POOL_PAGES]...   (default 262144: 8.6 GB, the B=256 L=128K case)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/bench/check_cuda.h"

namespace {

constexpr int kPageBytes = 32768;
constexpr int kThreads = 256;

__device__ __forceinline__ uint4 Ld(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t Fold(const uint4& v) { return v.x ^ (v.y * 3u) ^ (v.z * 5u) ^ (v.w * 7u); }

// Byte offset of load i (0..7) of lane `lane` within warp w's 4 KB of a page.
template <bool kQuad>
__device__ __forceinline__ int Offset(int i, int lane) {
  if constexpr (kQuad) {
    const int g = lane >> 2, t = lane & 3, h = i >> 2, v = i & 3;
    return (h * 8 + g) * 256 + (4 * v + t) * 16;
  } else {
    return i * 512 + lane * 16;
  }
}

// Register streaming: P tiles (4 KB per warp each) in flight per warp.
template <bool kQuad, int P, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    RegStream(const char* keys, const int* pages, int num_pages, int chunk, uint32_t* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t acc = 0;
  for (int unit = blockIdx.x; unit * chunk < num_pages; unit += gridDim.x) {
    const int b0 = unit * chunk, b1 = min(b0 + chunk, num_pages);
    uint4 tile[P][8];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (b0 + p < b1) {
        const char* base = keys + int64_t{pages[b0 + p]} * kPageBytes + warp * 4096;
#pragma unroll
        for (int i = 0; i < 8; ++i) tile[p][i] = Ld(base + Offset<kQuad>(i, lane));
      }
    }
    for (int b = b0; b < b1; ++b) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += Fold(tile[0][i]);
#pragma unroll
      for (int p = 0; p + 1 < P; ++p) {
#pragma unroll
        for (int i = 0; i < 8; ++i) tile[p][i] = tile[p + 1][i];
      }
      if (b + P < b1) {
        const char* base = keys + int64_t{pages[b + P]} * kPageBytes + warp * 4096;
#pragma unroll
        for (int i = 0; i < 8; ++i) tile[P - 1][i] = Ld(base + Offset<kQuad>(i, lane));
      }
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem));
}

// Destination chunk of global chunk i (16 B) of a page (rows of 256 B = 16 chunks): M = 0
// straight, 1: c ^ (r & 7) (the selector's 16-byte XOR swizzle).
template <int M>
__device__ __forceinline__ int DstChunk(int i) {
  const int r = i >> 4, c = i & 15;
  if constexpr (M == 1) return r * 16 + (c ^ (r & 7));
  return i;
}

// cp.async pipeline: S stages of one page each, starting kOffset bytes into shared memory.
template <int S, int M, int kOffset>
__global__ void __launch_bounds__(kThreads)
    CpaStream(const char* keys, const int* pages, int num_pages, int chunk, uint32_t* out) {
  extern __shared__ uint4 sm[];
  uint32_t acc = 0;
  for (int unit = blockIdx.x; unit * chunk < num_pages; unit += gridDim.x) {
    const int b0 = unit * chunk, b1 = min(b0 + chunk, num_pages);
    const auto issue = [&](int b) {
      if (b < b1) {
        const char* src = keys + int64_t{pages[b]} * kPageBytes;
        char* dst = reinterpret_cast<char*>(sm) + kOffset + ((b - b0) % S) * kPageBytes;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          CpAsync16(dst + DstChunk<M>(i * 256 + threadIdx.x) * 16, src + i * 4096 + threadIdx.x * 16);
        }
      }
      asm volatile("cp.async.commit_group;\n");
    };
    for (int s = 0; s < S - 1; ++s) issue(b0 + s);
    for (int b = b0; b < b1; ++b) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
      __syncthreads();
      const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(sm) + kOffset) +
                         ((b - b0) % S) * (kPageBytes / 16);
      // Read as the fragments would (ldmatrix-like, 16 B per lane, conflict-free order).
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += Fold(src[i * 256 + threadIdx.x]);
      __syncthreads();
      issue(b + S - 1);
    }
    asm volatile("cp.async.wait_group 0;\n");
    __syncthreads();
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

// The decode selector's work-unit shapes on the cp.async pipeline (3 stages, XOR-swizzled):
//   kPrologue: before a unit's first copy, three dependent loads through L2 (what the selector's
//              span search, span descriptor and page ids cost it);
//   kFlow:     grid of resident CTAs only, each walking its units (blockIdx.x + k gridDim.x) as one
//              stream of pages, the ring never drained between units, the next unit's page ids
//              read while the current one streams.
template <bool kPrologue, bool kFlow>
__global__ void __launch_bounds__(kThreads)
    CpaUnits(const char* keys, const int* pages, int num_pages, int chunk, uint32_t* out) {
  constexpr int S = 3;
  extern __shared__ uint4 sm[];
  uint32_t acc = 0;
  // Page j of this CTA's stream, or -1 past its end.
  const auto page_of = [&](int j) -> int {
    const int unit = kFlow ? blockIdx.x + (j / chunk) * gridDim.x : blockIdx.x;
    const int b = unit * chunk + j % chunk;
    if (!kFlow && j >= chunk) return -1;
    return b < min(unit * chunk + chunk, num_pages) ? b : -1;
  };
  if constexpr (kPrologue) {
    int v = __ldcg(pages + blockIdx.x * chunk % num_pages);
    v = __ldcg(pages + (v & 1023) % num_pages);
    v = __ldcg(pages + ((v & 1023) + 1) % num_pages);
    acc += static_cast<uint32_t>(v);
  }
  const auto issue = [&](int j) {
    const int b = page_of(j);
    if (b >= 0) {
      const char* src = keys + int64_t{pages[b]} * kPageBytes;
      char* dst = reinterpret_cast<char*>(sm) + (j % S) * kPageBytes;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        CpAsync16(dst + DstChunk<1>(i * 256 + threadIdx.x) * 16, src + i * 4096 + threadIdx.x * 16);
      }
    }
    asm volatile("cp.async.commit_group;\n");
  };
  for (int s = 0; s < S - 1; ++s) issue(s);
  for (int j = 0; page_of(j) >= 0; ++j) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncthreads();
    issue(j + S - 1);
    const uint4* src = sm + (j % S) * (kPageBytes / 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += Fold(src[i * 256 + threadIdx.x]);
  }
  asm volatile("cp.async.wait_group 0;\n");
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Bulk-copy (TMA) pipeline, S stages on mbarriers: one 32 KB cp.async.bulk per page, or (kRows)
// one 256-byte copy per key row into rows padded to 272 bytes (the layout ldmatrix reads without
// bank conflicts), issued by the 32 lanes of warp 0; kEvictFirst adds an L2 evict-first policy.
template <int S, bool kRows, bool kEvictFirst>
__global__ void __launch_bounds__(kThreads)
    BulkStream(const char* keys, const int* pages, int num_pages, int chunk, uint32_t* out) {
  constexpr int kStageBytes = kRows ? 128 * 272 : kPageBytes;
  extern __shared__ uint4 sm[];
  __shared__ __align__(8) uint64_t full[S];
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SmemAddr(&full[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n");
  }
  __syncthreads();
  const uint64_t policy = 0x12F0000000000000ull;  // evict_first, whole cache
  uint32_t acc = 0;
  uint32_t phase_bits = 0;  // bit s: parity to wait for on stage s
  int seq = 0;              // pages issued so far by this CTA (stage = seq % S)
  int consumed = 0;
  const auto copy = [&](uint32_t dst, const char* src, int bytes, uint32_t bar) {
    if constexpr (kEvictFirst) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
          "l"(src), "r"(bytes), "r"(bar), "l"(policy)
          : "memory");
    } else {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
          "l"(src), "r"(bytes), "r"(bar)
          : "memory");
    }
  };
  for (int unit = blockIdx.x; unit * chunk < num_pages; unit += gridDim.x) {
    const int b0 = unit * chunk, b1 = min(b0 + chunk, num_pages);
    const auto issue = [&](int b) {
      if (b >= b1) return;
      const int s = seq % S;
      ++seq;
      const uint32_t bar = SmemAddr(&full[s]);
      const uint32_t dst = SmemAddr(reinterpret_cast<char*>(sm) + s * kStageBytes);
      const char* src = keys + int64_t{pages[b]} * kPageBytes;
      if constexpr (kRows) {
        if (threadIdx.x < 32) {
          if (threadIdx.x == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kPageBytes));
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = threadIdx.x + 32 * i;
            copy(dst + row * 272, src + row * 256, 256, bar);
          }
        }
      } else if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kPageBytes));
        copy(dst, src, kPageBytes, bar);
      }
    };
    for (int s = 0; s < S - 1; ++s) issue(b0 + s);
    for (int b = b0; b < b1; ++b) {
      issue(b + S - 1);
      const int s = consumed % S;
      ++consumed;
      const uint32_t bar = SmemAddr(&full[s]);
      const uint32_t parity = (phase_bits >> s) & 1u;
      asm volatile(
          "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(bar),
          "r"(parity)
          : "memory");
      phase_bits ^= 1u << s;
      const char* stage = reinterpret_cast<const char*>(sm) + s * kStageBytes;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = i * 256 + threadIdx.x;  // 16-byte chunk of the page
        const int at = kRows ? (c >> 4) * 272 + (c & 15) * 16 : c * 16;
        acc += Fold(*reinterpret_cast<const uint4*>(stage + at));
      }
      __syncthreads();  // stage s free before it is refilled
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__global__ void FillHash(uint32_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    p[i] = static_cast<uint32_t>(x >> 29);
  }
}

struct Runner {
  const char* keys;
  const int* pages;
  int num_pages;
  uint32_t* out;
  char* flush;
  size_t flush_bytes;
  cudaEvent_t e0, e1;

  template <typename K>
  float Time(K kernel, int grid, int chunk, int smem, int reps) {
    if (smem > 48 * 1024) CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<float> ms;
    for (int r = 0; r < reps + 2; ++r) {
      CHECK_CUDA(cudaMemsetAsync(flush, r, flush_bytes));
      CHECK_CUDA(cudaEventRecord(e0));
      kernel<<<grid, kThreads, smem>>>(keys, pages, num_pages, chunk, out);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      if (r >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

template <typename K>
void Report(Runner& r, const char* name, K kernel, int chunk, int smem, bool persistent, int num_sms) {
  int per_sm = 0;
  if (smem > 48 * 1024) CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  if (per_sm == 0) {
    std::printf("%-28s chunk %3d: does not fit\n", name, chunk);
    return;
  }
  const int units = (r.num_pages + chunk - 1) / chunk;
  const int grid = persistent ? std::min(units, per_sm * num_sms) : units;
  const float ms = r.Time(kernel, grid, chunk, smem, 15);
  const double tbs = double(r.num_pages) * kPageBytes / (ms * 1e-3) / 1e12;
  std::printf("%-28s chunk %3d %s CTAs/SM %d: %8.1f us  %.2f TB/s\n", name, chunk,
              persistent ? "persistent" : "grid=units", per_sm, ms * 1e3, tbs);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  uint32_t* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, sizeof(uint32_t) * 1 << 20));
  Runner r{nullptr, nullptr, 0, out, nullptr, size_t{256} << 20, {}, {}};
  CHECK_CUDA(cudaMalloc(&r.flush, r.flush_bytes));
  CHECK_CUDA(cudaEventCreate(&r.e0));
  CHECK_CUDA(cudaEventCreate(&r.e1));
  std::vector<std::string> sizes(argv + 1, argv + argc);
  if (sizes.empty()) sizes.push_back("262144");
  for (const std::string& arg : sizes) {
    if (arg == "--help" || arg == "-h") {
      std::printf("usage: indexer-stream-probe [PAGES[/POOL_PAGES]]...  (32 KB pages; default 262144)\n");
      return 0;
    }
    // PAGES or PAGES/POOL_PAGES: POOL_PAGES (default PAGES + 7) is what the random order spans.
    int num_pages = 0, pool_pages = 0;
    const int got = std::sscanf(arg.c_str(), "%d/%d", &num_pages, &pool_pages);
    if (got < 1 || num_pages <= 0) {
      std::fprintf(stderr, "bad size %s (want PAGES or PAGES/POOL_PAGES)\n", arg.c_str());
      return 2;
    }
    if (got < 2 || pool_pages < num_pages) pool_pages = num_pages + 7;
    char* keys = nullptr;
    CHECK_CUDA(cudaMalloc(&keys, size_t(pool_pages) * kPageBytes));
    FillHash<<<4096, 256>>>(reinterpret_cast<uint32_t*>(keys), int64_t{pool_pages} * kPageBytes / 4);
    CHECK_CUDA(cudaGetLastError());
    std::vector<int> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(perm.begin(), perm.end(), rng);
    perm.resize(num_pages);
    int* pages = nullptr;
    CHECK_CUDA(cudaMalloc(&pages, sizeof(int) * num_pages));
    CHECK_CUDA(cudaMemcpy(pages, perm.data(), sizeof(int) * num_pages, cudaMemcpyHostToDevice));
    r.keys = keys;
    r.pages = pages;
    r.num_pages = num_pages;
    std::printf("%d pages of 32 KB (%.2f GB) from a pool of %d, %d SMs\n", num_pages, num_pages * 32768.0 / 1e9,
                pool_pages, num_sms);
    Report(r, "quad (one tile per warp)", RegStream<true, 1, 2>, 32, 0, false, num_sms);
    Report(r, "line (one tile per warp)", RegStream<false, 1, 2>, 32, 0, false, num_sms);
    Report(r, "cpa 3 stages straight", CpaStream<3, 0, 0>, 32, 3 * kPageBytes, false, num_sms);
    Report(r, "cpa 3 stages xor16", CpaStream<3, 1, 0>, 32, 3 * kPageBytes, false, num_sms);
    Report(r, "cpa 3 stages 16 B off", CpaStream<3, 0, 16>, 32, 3 * kPageBytes + 16, false, num_sms);
    Report(r, "cpa 3 stages xor16", CpaStream<3, 1, 0>, 16, 3 * kPageBytes, false, num_sms);
    Report(r, "cpa units", CpaUnits<false, false>, 16, 3 * kPageBytes, false, num_sms);
    Report(r, "cpa units + 3-load prologue", CpaUnits<true, false>, 16, 3 * kPageBytes, false, num_sms);
    Report(r, "cpa units flowing", CpaUnits<false, true>, 16, 3 * kPageBytes, true, num_sms);
    Report(r, "cpa units flowing", CpaUnits<false, true>, 4, 3 * kPageBytes, true, num_sms);
    Report(r, "bulk 4 stages", BulkStream<4, false, false>, 32, 4 * kPageBytes, false, num_sms);
    Report(r, "bulk 4 stages evict-first", BulkStream<4, false, true>, 32, 4 * kPageBytes, false, num_sms);
    Report(r, "bulk rows 3 stages", BulkStream<3, true, false>, 16, 3 * 128 * 272, false, num_sms);
    Report(r, "bulk rows 3 stages evict-first", BulkStream<3, true, true>, 16, 3 * 128 * 272, false, num_sms);
    CHECK_CUDA(cudaFree(keys));
    CHECK_CUDA(cudaFree(pages));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}
