// indexer-kernel-bench: times the CUDA selectors on the cases of shared/bench/seed_bench.py
// (same presets, same "ramp" length rule, pages in random order), so that the two can be run
// back to back on one GPU and compared.
//
// Method (as the seed's triton.testing.do_bench): warm-up, then every run timed on its own with
// CUDA events after flushing L2 with a 256 MB memset; the median is reported. Decode cases are
// also captured in a CUDA graph and timed by replay (the seed's headline figure). Prints one
// JSON object per case, then a table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/bench/check_cuda.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/span_plan.h"
#include "kernels/cuda/step_staging.h"
#include "kernels/numeric.h"

namespace {

using indexer::kernels::KeyStorage;
using indexer::kernels::cuda::SpanDesc;
namespace kc = indexer::kernels::cuda;

constexpr int kD = 128;
constexpr int kTopk = 16;

// Pseudo-random bf16 values (roughly uniform in [-2, 2)), stored as bf16 or fp8.
__global__ void FillRandom(uint8_t* out, int64_t n, uint64_t seed, bool fp8) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float f = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 4.0f - 2.0f;
    const uint16_t b = indexer::kernels::FloatToBf16(f);
    if (fp8) {
      out[i] = indexer::kernels::FloatToFp8E4M3(indexer::kernels::Bf16ToFloat(b));
    } else {
      reinterpret_cast<uint16_t*>(out)[i] = b;
    }
  }
}

// The same pseudo-random values for fp4 pools: one thread per group of 16, quantised as the
// append kernel quantises (kernels/numeric.h). `pages` pages of 128 keys of kD values.
__global__ void FillRandomFp4(uint8_t* pool, int64_t pages, uint64_t seed) {
  constexpr int kGroups = kD / indexer::kernels::kFp4GroupSize;
  const int64_t n = pages * 128 * kGroups;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint16_t values[indexer::kernels::kFp4GroupSize];
    for (int k = 0; k < indexer::kernels::kFp4GroupSize; ++k) {
      uint64_t x = (i * indexer::kernels::kFp4GroupSize + k + 1) * 0x9E3779B97F4A7C15ull ^ seed;
      x ^= x >> 31;
      x *= 0xBF58476D1CE4E5B9ull;
      x ^= x >> 29;
      const float f = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 4.0f - 2.0f;
      values[k] = indexer::kernels::FloatToBf16(f);
    }
    const int64_t key = i / kGroups;
    const int g = static_cast<int>(i % kGroups);
    const int64_t page = key / 128;
    const int slot = static_cast<int>(key % 128);
    uint8_t codes[indexer::kernels::kFp4GroupSize / 2];
    pool[indexer::kernels::Fp4ScalesOffset(page, slot, kD) + g] =
        indexer::kernels::QuantizeFp4Group(values, codes);
    for (int k = 0; k < indexer::kernels::kFp4GroupSize / 2; ++k) {
      pool[indexer::kernels::Fp4CodesOffset(page, slot, kD) + g * 8 + k] = codes[k];
    }
  }
}

struct DecodeCase {
  int b;
  int64_t l;
  int h, q;
  std::string dist;
};
struct PrefillCase {
  int b;
  int64_t prefix, chunk;
  int h;
};

const std::vector<DecodeCase> kDecodePreset = {
    {1, 4096, 1, 1, "uniform"},    {1, 131072, 1, 1, "uniform"}, {16, 32768, 1, 1, "uniform"},
    {64, 32768, 1, 1, "uniform"},  {64, 131072, 1, 1, "uniform"}, {256, 131072, 1, 1, "uniform"},
    {1, 4096, 4, 1, "uniform"},    {1, 131072, 4, 1, "uniform"}, {64, 32768, 4, 1, "uniform"},
    {256, 131072, 4, 1, "uniform"}, {16, 32768, 1, 4, "uniform"}, {64, 131072, 1, 4, "uniform"},
    {64, 131072, 1, 1, "ramp"},    {256, 65536, 4, 1, "ramp"},
};
const std::vector<PrefillCase> kPrefillPreset = {
    {1, 0, 8192, 4}, {1, 24576, 8192, 4}, {4, 30720, 2048, 1}, {1, 122880, 8192, 1}};

std::vector<int64_t> Lengths(const DecodeCase& c) {
  std::vector<int64_t> lens(c.b);
  for (int i = 0; i < c.b; ++i) {
    lens[i] = c.dist == "ramp" ? std::max<int64_t>(1, (c.l * (i + 1)) / c.b) : c.l;
  }
  return lens;
}

// Reads n 16-byte words (--flush=read: leaves L2 full of clean lines, where the memset leaves
// dirty ones that the next kernel's misses must write back).
__global__ void ReadAll(const uint4* p, int64_t n, unsigned* sink) {
  unsigned x = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // keeps the loads
}

struct Timer {
  cudaEvent_t start, stop;
  void* flush = nullptr;
  bool flush_enabled = true;
  bool flush_by_reading = false;  // --flush=read
  // Before each timed run: a 256 MB memset (as the seed's do_bench), or a read of 256 MB.
  void Flush(int i, cudaStream_t s) {
    if (!flush_enabled) return;
    if (flush_by_reading) {
      ReadAll<<<1024, 256, 0, s>>>(static_cast<const uint4*>(flush), kFlushBytes / 16,
                                   static_cast<unsigned*>(flush));
      CHECK_CUDA(cudaGetLastError());
    } else {
      CHECK_CUDA(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, s));
    }
  }
  static constexpr size_t kFlushBytes = size_t{256} << 20;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    CHECK_CUDA(cudaMalloc(&flush, kFlushBytes));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaFree(flush);
  }
  // Median microseconds of `reps` runs of fn, each after an L2 flush.
  template <typename Fn>
  double Median(Fn fn, int warmup, int reps, cudaStream_t s) {
    for (int i = 0; i < warmup; ++i) fn();
    CHECK_CUDA(cudaStreamSynchronize(s));
    std::vector<float> ms(reps);
    for (int i = 0; i < reps; ++i) {
      Flush(i, s);
      CHECK_CUDA(cudaEventRecord(start, s));
      fn();
      CHECK_CUDA(cudaEventRecord(stop, s));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaEventElapsedTime(&ms[i], start, stop));
    }
    std::sort(ms.begin(), ms.end());
    return ms[reps / 2] * 1e3;
  }
};

// A key pool with `lens` sequences in random page order, staged as the CUDA backend stages a
// step (kernels/cuda/step_staging.h): descriptors, decode index, block tables and queries in one
// device buffer, outputs in another. Every span takes `path`.
struct Workload {
  int64_t used_pages = 0;
  void* pool = nullptr;
  std::vector<int32_t> perm;         // the block tables of every span, one after the other
  std::vector<uint16_t> queries;     // host copy of the random queries
  std::vector<int32_t> ids;          // every span's block ids, scattered from the outputs
  std::vector<int64_t> starts;
  std::vector<kc::StagedSpan> spans;
  kc::StepStaging staging;
  char* in = nullptr;
  char* out = nullptr;
  float* scores = nullptr;
  int* counters = nullptr;

  Workload(const std::vector<int64_t>& lens, const std::vector<int64_t>& span_starts, int n, int h,
           KeyStorage st, kc::SpanPath path, int num_sms, kc::DecodeTuning tuning, std::mt19937_64& rng)
      : starts(span_starts) {
    std::vector<int64_t> nb(lens.size());
    for (size_t i = 0; i < lens.size(); ++i) nb[i] = (lens[i] + 127) / 128;
    used_pages = std::accumulate(nb.begin(), nb.end(), int64_t{0});
    const int64_t pages = used_pages + 7;
    perm.resize(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const int64_t pool_elems = pages * 128 * kD;
    CHECK_CUDA(cudaMalloc(&pool, pages * indexer::kernels::PageBytes(st, kD)));
    if (st == KeyStorage::kFp4E2M1) {
      FillRandomFp4<<<4096, 256>>>(static_cast<uint8_t*>(pool), pages, rng());
    } else {
      FillRandom<<<4096, 256>>>(static_cast<uint8_t*>(pool), pool_elems, rng(),
                                st != KeyStorage::kBf16);
    }
    CHECK_CUDA(cudaGetLastError());
    const int64_t rows = int64_t{n} * h;
    const int64_t q_elems = static_cast<int64_t>(lens.size()) * rows * kD;
    uint16_t* d_queries = nullptr;
    CHECK_CUDA(cudaMalloc(&d_queries, q_elems * 2));
    FillRandom<<<256, 256>>>(reinterpret_cast<uint8_t*>(d_queries), q_elems, rng(), false);
    CHECK_CUDA(cudaGetLastError());
    queries.resize(q_elems);
    CHECK_CUDA(cudaMemcpy(queries.data(), d_queries, q_elems * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(d_queries));
    ids.resize(static_cast<size_t>(lens.size()) * rows * kTopk);
    spans.resize(lens.size());
    int64_t off = 0;
    for (size_t i = 0; i < lens.size(); ++i) {
      indexer::kernels::SpanSelect& s = spans[i].host;
      s.block_table = perm.data() + off;
      off += nb[i];
      s.queries = queries.data() + static_cast<int64_t>(i) * rows * kD;
      s.block_ids = ids.data() + static_cast<int64_t>(i) * rows * kTopk;
      s.start_pos = starts[i];
      s.num_tokens = n;
      s.num_heads = h;
      s.params = indexer::kernels::SelectParams{kTopk, 0, 1};
      spans[i].keys = pool;
      spans[i].path = path;
    }
    staging.Plan({}, spans, kD, st, indexer::kernels::PageTableParams{});
    std::vector<char> host_in(staging.input_bytes());
    CHECK_CUDA(cudaMalloc(&in, std::max<size_t>(host_in.size(), 16)));
    CHECK_CUDA(cudaMalloc(&out, std::max<int64_t>(staging.output_bytes(), 16)));
    if (staging.WriteInputs(host_in.data(), in, out, kc::PageRange{0, pages}, {}, num_sms, tuning)) {
      std::fprintf(stderr, "bench: a block table names a page outside the pool\n");
      std::exit(1);
    }
    CHECK_CUDA(cudaMemcpy(in, host_in.data(), host_in.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&scores, staging.ScoreFloats() * 4));
    CHECK_CUDA(cudaMalloc(&counters, staging.DecodeCounters() * 4));
    CHECK_CUDA(cudaMemset(counters, 0, staging.DecodeCounters() * 4));
    // The fills and the memset run on the legacy default stream, which the timed stream (created
    // non-blocking) does not wait for: the counters must be zero before the first launch, also
    // when their memory held another case's counters.
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  int num_spans() const { return static_cast<int>(spans.size()); }
  const SpanDesc* d_descs() const { return staging.DeviceDescs(in); }
  const void* d_index() const { return staging.DeviceDecodeIndex(in); }
  const kc::DecodePlan& decode_plan() const { return staging.batch().decode; }
  const kc::PrefillPlan& prefill_plan() const { return staging.batch().prefill; }
  // Every span's first row must hold valid ids (catches a launch that silently did nothing).
  void CheckIds() {
    std::vector<char> host_out(std::max<int64_t>(staging.output_bytes(), 16));
    CHECK_CUDA(cudaMemcpy(host_out.data(), out, host_out.size(), cudaMemcpyDeviceToHost));
    staging.Scatter(host_out.data());
    const int64_t per_span = ids.size() / spans.size();
    for (size_t i = 0; i < spans.size(); i += std::max<size_t>(1, spans.size() / 8)) {
      const int32_t* h = ids.data() + i * per_span;
      const int64_t v = starts[i] / 128 + 1;
      for (int j = 0; j < kTopk; ++j) {
        const bool ok = j < v ? (h[j] >= 0 && h[j] < v) : h[j] == -1;
        if (!ok) {
          std::fprintf(stderr, "bench: span %zu returned an invalid id %d at %d\n", i, h[j], j);
          std::exit(1);
        }
      }
    }
  }
  ~Workload() {
    cudaFree(pool);
    cudaFree(in);
    cudaFree(out);
    cudaFree(scores);
    cudaFree(counters);
  }
};

// 21 eager runs, each after an L2 flush (unless --flush=0), with the kernel's timeline stamps:
// µs from the first CTA's start to each phase, the median per phase (the last span to finish
// sets the top-k phases). One table line.
std::string TimelineLine(Workload& w, const kc::DecodePlan& plan, KeyStorage st,
                         const indexer::kernels::PageTableParams& pt, Timer& timer, cudaStream_t stream) {
  unsigned long long* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, kc::kDecodeTimelineSlots * sizeof(unsigned long long)));
  std::vector<std::vector<double>> at(kc::kDecodeTimelineSlots);
  for (int run = 0; run < 21; ++run) {
    CHECK_CUDA(cudaMemsetAsync(d, 0, kc::kDecodeTimelineSlots * sizeof(unsigned long long), stream));
    CHECK_CUDA(cudaMemsetAsync(d, 0xff, sizeof(unsigned long long), stream));
    timer.Flush(run, stream);
    CHECK_CUDA(kc::LaunchDecodeSelect(w.d_descs(), w.d_index(), w.num_spans(), plan, st, kD, pt,
                                      w.scores, w.counters, stream, d));
    unsigned long long h[kc::kDecodeTimelineSlots];
    CHECK_CUDA(cudaMemcpyAsync(h, d, sizeof(h), cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (int i = 1; i < kc::kDecodeTimelineSlots; ++i) {
      // 0: the phase did not run (say, no threshold pass).
      if (h[i] != 0) at[i].push_back(static_cast<double>(h[i] - h[0]) * 1e-3);
    }
  }
  CHECK_CUDA(cudaFree(d));
  static const char* kNames[] = {"", "streamed", "last CTA", "keys loaded", "thresholds", "selected",
                                 "shared pass", "end"};
  std::string line = "  timeline (us from the first CTA's start, median):";
  for (int i = 1; i < kc::kDecodeTimelineSlots; ++i) {
    if (at[i].empty()) continue;
    std::sort(at[i].begin(), at[i].end());
    char part[64];
    std::snprintf(part, sizeof(part), " %s %.2f", kNames[i], at[i][at[i].size() / 2]);
    line += part;
  }
  return line;
}

int main_impl(int argc, char** argv) {
  std::string preset = "all";
  std::string storage = "both";
  double peak = 4.8;
  int reps = 200;
  int max_chunk = 0;  // 0: DecodeChunkBlocks, as the server
  int decode_warps = 0;  // 0: DecodeWarpsPerBlock, as the server
  bool flush = true;
  bool flush_read = false;
  bool timeline = false;
  std::vector<DecodeCase> custom;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto val = [&](const char* flag) -> std::string {
      const std::string f = std::string(flag) + "=";
      return a.rfind(f, 0) == 0 ? a.substr(f.size()) : "";
    };
    if (a == "--help" || a == "-h") {
      std::printf(
          "indexer-kernel-bench: times the CUDA selectors on seed_bench.py's cases.\n"
          "  --preset=decode|prefill|all   (default all)\n"
          "  --storage=bf16|fp8|fp4|both|all  key cache types: both is bf16 and fp8, all adds fp4\n"
          "                                (default both); prefill runs bf16, and fp4 when asked\n"
          "  --case=B,L,H,Q,DIST           a decode case instead of the preset (repeatable)\n"
          "  --reps=N                      timed runs per case (default 200)\n"
          "  --max-chunk=N                 decode: most blocks per CTA (default: 512 KB of keys, as\n"
          "                                the server)\n"
          "  --decode-warps=2|8            decode: warps that score one block together (default as the\n"
          "                                server: 8, or 2 for fp4 units of 4 blocks or more); only fp4\n"
          "                                has 2, other storages keep the default\n"
          "  --flush=0|1|read              flush L2 before every timed and timeline run: 1 a 256 MB memset\n"
          "                                (the default, as the seed's do_bench), read a 256 MB read\n"
          "  --peak-tbps=X                 memory bandwidth for the floor (default 4.8)\n"
          "  --timeline                    decode: also print where one run's time goes (%%globaltimer\n"
          "                                stamps: streaming, the last CTA's top-k phases)\n");
      return 0;
    } else if (!val("--preset").empty()) {
      preset = val("--preset");
    } else if (!val("--storage").empty()) {
      storage = val("--storage");
    } else if (!val("--reps").empty()) {
      reps = std::max(5, std::atoi(val("--reps").c_str()));
    } else if (!val("--flush").empty()) {
      flush = val("--flush") != "0";
      flush_read = val("--flush") == "read";
    } else if (!val("--max-chunk").empty()) {
      max_chunk = std::max(1, std::atoi(val("--max-chunk").c_str()));
    } else if (!val("--decode-warps").empty()) {
      decode_warps = std::atoi(val("--decode-warps").c_str());
      if (decode_warps != 2 && decode_warps != 8) {
        std::fprintf(stderr, "bad --decode-warps %s (want 2 or 8)\n", val("--decode-warps").c_str());
        return 2;
      }
    } else if (a == "--timeline") {
      timeline = true;
    } else if (!val("--peak-tbps").empty()) {
      peak = std::atof(val("--peak-tbps").c_str());
    } else if (!val("--case").empty()) {
      DecodeCase c;
      char dist[32] = {0};
      long long l = 0;
      if (std::sscanf(val("--case").c_str(), "%d,%lld,%d,%d,%31s", &c.b, &l, &c.h, &c.q, dist) != 5) {
        std::fprintf(stderr, "bad --case %s (want B,L,H,Q,DIST)\n", val("--case").c_str());
        return 2;
      }
      c.l = l;
      c.dist = dist;
      custom.push_back(c);
    } else {
      std::fprintf(stderr, "unknown argument %s (see --help)\n", a.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"device\": \"%s\", \"peak_TBps\": %.2f, \"sms\": %d}\n", prop.name, peak, prop.multiProcessorCount);
  std::mt19937_64 rng(1234);
  Timer timer;
  timer.flush_enabled = flush;
  timer.flush_by_reading = flush_read;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const indexer::kernels::PageTableParams pt;
  std::vector<std::string> table;
  std::vector<KeyStorage> storages;
  const bool every = storage == "all";
  if (storage == "bf16" || storage == "both" || every) storages.push_back(KeyStorage::kBf16);
  if (storage == "fp8" || storage == "both" || every) storages.push_back(KeyStorage::kFp8E4M3);
  if (storage == "fp4" || every) storages.push_back(KeyStorage::kFp4E2M1);
  // Prefill: bf16 (the reference case), and fp4 when asked for.
  std::vector<KeyStorage> prefill_storages = {KeyStorage::kBf16};
  if (storage == "fp4" || every) prefill_storages.push_back(KeyStorage::kFp4E2M1);

  const std::vector<DecodeCase>& decode = custom.empty() ? kDecodePreset : custom;
  if (preset == "decode" || preset == "all" || !custom.empty()) {
    for (KeyStorage st : storages) {
      for (const DecodeCase& c : decode) {
        const std::vector<int64_t> lens = Lengths(c);
        std::vector<int64_t> starts(lens.size());
        for (size_t i = 0; i < lens.size(); ++i) starts[i] = std::max<int64_t>(0, lens[i] - c.q);
        // --decode-warps where this storage has that variant; the planner's choice elsewhere.
        const kc::DecodeTuning tuning{max_chunk, kc::DecodeWarpsSupported(st, decode_warps) ? decode_warps : 0};
        Workload w(lens, starts, c.q, c.h, st, kc::SpanPath::kDecode, prop.multiProcessorCount, tuning, rng);
        const kc::DecodePlan& plan = w.decode_plan();
        const auto launch = [&] {
          CHECK_CUDA(kc::LaunchDecodeSelect(w.d_descs(), w.d_index(), w.num_spans(), plan, st, kD, pt,
                                            w.scores, w.counters, stream));
        };
        const double eager = timer.Median(launch, 20, reps, stream);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        launch();
        CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
        CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        const double replay = timer.Median([&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); }, 20, reps, stream);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        w.CheckIds();
        const std::string timeline_line = timeline ? TimelineLine(w, plan, st, pt, timer, stream) : "";
        CHECK_CUDA(cudaGraphExecDestroy(exec));
        CHECK_CUDA(cudaGraphDestroy(graph));
        const double bytes =
            static_cast<double>(w.used_pages) * indexer::kernels::PageBytes(st, kD);
        const double tbps = bytes / (replay * 1e-6) / 1e12;
        const double floor_us = bytes / (peak * 1e12) * 1e6;
        const char* sname = indexer::kernels::KeyStorageName(st);
        std::printf(
            "{\"kind\": \"decode\", \"storage\": \"%s\", \"B\": %d, \"L\": %lld, \"H\": %d, \"Q\": %d, "
            "\"dist\": \"%s\", \"key_bytes\": %.0f, \"floor_us\": %.2f, \"graph_us\": %.2f, "
            "\"eager_us\": %.2f, \"TBps\": %.3f, \"share_of_peak\": %.3f, \"warps_per_block\": %d}\n",
            sname, c.b, static_cast<long long>(c.l), c.h, c.q, c.dist.c_str(), bytes, floor_us, replay,
            eager, tbps, floor_us / replay, plan.warps_per_block);
        std::fflush(stdout);
        char line[256];
        std::snprintf(line, sizeof(line),
                      "decode  %-4s B=%-4d L=%-7lld H=%d Q=%d %-7s %9.2f us (eager %9.2f)  %5.2f TB/s  %5.1f%% of %.1f  w%d",
                      sname, c.b, static_cast<long long>(c.l), c.h, c.q, c.dist.c_str(), replay, eager, tbps,
                      100 * floor_us / replay, peak, plan.warps_per_block);
        table.push_back(line);
        if (!timeline_line.empty()) table.push_back(timeline_line);
      }
    }
  }
  if (custom.empty() && (preset == "prefill" || preset == "all")) {
    for (KeyStorage st : prefill_storages) {
      for (const PrefillCase& c : kPrefillPreset) {
        const int64_t l = c.prefix + c.chunk;
        std::vector<int64_t> lens(c.b, l), starts(c.b, c.prefix);
        Workload w(lens, starts, static_cast<int>(c.chunk), c.h, st, kc::SpanPath::kPrefill,
                   prop.multiProcessorCount, kc::DecodeTuning{}, rng);
        const kc::PrefillPlan& plan = w.prefill_plan();
        const auto launch = [&] {
          CHECK_CUDA(kc::LaunchPrefillSelect(w.d_descs(), w.num_spans(), plan, st, kD, pt, w.scores, stream));
        };
        const double us = timer.Median(launch, 5, std::max(5, reps / 4), stream);
        // The two launches (scores, then top-k) timed on their own, the same way.
        kc::LaunchList list;
        CHECK_CUDA(kc::DescribePrefillSelect(w.d_descs(), w.num_spans(), plan, st, kD, pt, w.scores, &list));
        double part_us[2] = {0, 0};
        for (int k = 0; k < 2 && k < list.size; ++k) {
          kc::LaunchList one;
          *one.Add() = list.items[k];
          part_us[k] = timer.Median([&] { CHECK_CUDA(one.Enqueue(stream)); }, 5, std::max(5, reps / 4), stream);
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double flops = 2.0 * c.b * c.h * kD *
                             (static_cast<double>(c.chunk) * c.prefix + 0.5 * c.chunk * (c.chunk + 1));
        const char* sname = indexer::kernels::KeyStorageName(st);
        std::printf(
            "{\"kind\": \"prefill\", \"storage\": \"%s\", \"B\": %d, \"prefix\": %lld, \"chunk\": %lld, "
            "\"H\": %d, \"total_us\": %.1f, \"score_us\": %.1f, \"topk_us\": %.1f, \"TFLOPs\": %.1f}\n",
            sname, c.b, static_cast<long long>(c.prefix), static_cast<long long>(c.chunk), c.h, us, part_us[0],
            part_us[1], flops / (us * 1e-6) / 1e12);
        std::fflush(stdout);
        char line[256];
        std::snprintf(line, sizeof(line), "prefill %-4s B=%d prefix=%lld chunk=%lld H=%d  score+topk %9.1f us  (%.0f TFLOP/s "
                      "useful; alone: score %.1f us at %.0f TFLOP/s, topk %.1f us)",
                      sname, c.b, static_cast<long long>(c.prefix), static_cast<long long>(c.chunk), c.h, us,
                      flops / (us * 1e-6) / 1e12, part_us[0], flops / (part_us[0] * 1e-6) / 1e12, part_us[1]);
        table.push_back(line);
      }
    }
  }
  std::printf("\n");
  for (const auto& line : table) std::printf("%s\n", line.c_str());
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return main_impl(argc, argv); }
