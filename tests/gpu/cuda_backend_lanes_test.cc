// The CUDA backend's lanes, graphs and device slots, through KeyCacheBackend only, against the CPU
// reference on fresh random inputs every run:
//  - many threads selecting at once on two lanes (keys written, pages read and copied meanwhile);
//  - graph replay over many different and repeated shapes, equal to direct launches bit for bit;
//  - a decode loop (one token appended per step, so plans change every step) equal to the CPU
//    backend, with and without graphs;
//  - a slot whose first page is not 0: global ids work, ids outside the slot are refused;
//  - a backend on device 1 (and one on device 0 beside it) when two GPUs are visible.
// Keys reach the backend through WriteKeys (bf16, converted on the device), so the paths the
// engine uses are the paths tested. Skips (with a message) where no GPU is usable.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/key_cache_backend.h"
#include "kernels/numeric.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testing/gpu_test.h"

namespace indexer::testing {
namespace {

using engine::CudaBackendCounters;
using engine::CudaBackendOptions;
using engine::DeviceSlot;
using engine::EngineConfig;
using engine::KeyCacheBackend;
using engine::KeyWrite;
using engine::SelectTask;
using kernels::KeyStorage;
using kernels::kBlockSize;

constexpr int32_t kPoison = 0x7f7f7f7f;

#define ASSERT_OK(expr)                                       \
  do {                                                        \
    const absl::Status status_ = (expr);                      \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << status_;    \
  } while (0)

// A PoolCase placed in a backend: span i's block b is global page page_offset + block_table[b]
// of layer `layer`.
struct LoadedCase {
  PoolCase c;
  int64_t page_offset = 0;
  int layer = 0;
  std::vector<std::vector<int32_t>> global_bt;
};

struct SpanOutput {
  std::vector<int32_t> ids, table, ctx;
};

std::string Describe(const PoolCase& c, const SpanCase& s) {
  return "(length " + std::to_string(s.length) + ", n " + std::to_string(s.num_tokens) + ", H " +
         std::to_string(s.num_heads) + ", topk " + std::to_string(s.params.topk) + ", init " +
         std::to_string(s.params.init_blocks) + ", local " + std::to_string(s.params.local_blocks) +
         ", head_dim " + std::to_string(c.head_dim) +
         ", " + kernels::KeyStorageName(c.storage) + ")";
}

// The bf16 key of token t of span s, as the case's pool holds it (fp8 and fp4 values are exact
// in bf16, and storing a stored fp4 key again gives the same bytes unless its scale is subnormal,
// which the cases' values never make).
uint16_t KeyBits(const PoolCase& c, const SpanCase& s, int64_t t, int i) {
  return kernels::FloatToBf16(kernels::StoredKeyValue(c.pool.data(), c.storage, c.head_dim,
                                                      s.block_table[t / kBlockSize],
                                                      static_cast<int>(t % kBlockSize), i));
}

// Writes every span's keys through WriteKeys in random-sized chunks.
absl::Status LoadCase(KeyCacheBackend& backend, LoadedCase& lc, std::mt19937_64& rng) {
  const PoolCase& c = lc.c;
  const int d = c.head_dim;
  lc.global_bt.clear();
  for (const SpanCase& s : c.spans) {
    std::vector<int32_t> bt(s.block_table);
    for (int32_t& p : bt) p = static_cast<int32_t>(p + lc.page_offset);
    lc.global_bt.push_back(bt);
    std::vector<uint16_t> keys(static_cast<size_t>(s.length) * d);
    for (int64_t t = 0; t < s.length; ++t) {
      for (int i = 0; i < d; ++i) keys[t * d + i] = KeyBits(c, s, t, i);
    }
    for (int64_t start = 0; start < s.length;) {
      const int64_t n = std::min<int64_t>(s.length - start, 1 + static_cast<int64_t>(rng() % 3000));
      const KeyWrite w{lc.global_bt.back().data(), n, lc.layer, 1, &start, keys.data() + start * d};
      const absl::Status status = backend.WriteKeys(w);
      if (!status.ok()) return status;
      start += n;
    }
  }
  return absl::OkStatus();
}

// Builds the tasks of spans `which` (in that order), with poisoned outputs.
std::vector<SelectTask> MakeTasks(const LoadedCase& lc, const std::vector<int>& which,
                                  std::vector<SpanOutput>* outs) {
  const PoolCase& c = lc.c;
  std::vector<SelectTask> tasks(which.size());
  outs->assign(which.size(), SpanOutput{});
  for (size_t k = 0; k < which.size(); ++k) {
    const SpanCase& s = c.spans[which[k]];
    const size_t rows = static_cast<size_t>(s.num_tokens) * s.num_heads;
    SpanOutput& o = (*outs)[k];
    o.ids.assign(rows * s.params.topk, kPoison);
    if (s.attn) {
      o.table.assign(rows * s.params.topk * c.pt.pages_per_block, kPoison);
      o.ctx.assign(rows, kPoison);
    }
    SelectTask& t = tasks[k];
    t.layer = lc.layer;
    t.span.block_table = lc.global_bt[which[k]].data();
    t.span.attn_pages = s.attn ? s.attn_pages.data() : nullptr;
    t.span.start_pos = s.start_pos;
    t.span.num_tokens = s.num_tokens;
    t.span.num_heads = s.num_heads;
    t.span.queries = s.queries.data();
    t.span.params = s.params;
    t.span.block_ids = o.ids.data();
    t.span.page_table = s.attn ? o.table.data() : nullptr;
    t.span.context_lens = s.attn ? o.ctx.data() : nullptr;
  }
  return tasks;
}

// Selects spans `which` in one call and checks each against the reference: "" when all agree.
std::string SelectAndCheck(KeyCacheBackend& backend, const LoadedCase& lc, const std::vector<int>& which,
                           std::vector<SpanOutput>* outs_keep = nullptr) {
  std::vector<SpanOutput> outs;
  const std::vector<SelectTask> tasks = MakeTasks(lc, which, &outs);
  const absl::Status status = backend.Select(tasks, lc.c.pt);
  if (!status.ok()) return "Select failed: " + status.ToString();
  for (size_t k = 0; k < which.size(); ++k) {
    const SpanCase& s = lc.c.spans[which[k]];
    const std::string why = CheckSpan(lc.c, s, outs[k].ids.data(), outs[k].table.data(), outs[k].ctx.data());
    if (!why.empty()) {
      return "span " + std::to_string(which[k]) + " (task " + std::to_string(k) + " of " +
             std::to_string(which.size()) + ") " + Describe(lc.c, s) + ": " + why;
    }
  }
  if (outs_keep != nullptr) *outs_keep = std::move(outs);
  return "";
}

std::vector<int> RandomSubset(int num_spans, int max_size, std::mt19937_64& rng) {
  std::vector<int> all(num_spans);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(1 + rng() % std::min(max_size, num_spans));
  return all;
}

std::vector<int> AllSpans(const LoadedCase& lc) {
  std::vector<int> all(lc.c.spans.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
}

CudaBackendCounters Counters(const KeyCacheBackend& backend) {
  const std::optional<CudaBackendCounters> c = engine::GetCudaBackendCounters(backend);
  EXPECT_TRUE(c.has_value());
  return c.value_or(CudaBackendCounters{});
}

class CudaLanesTest : public GpuTest {
 protected:
  SpanCase RandomSpan(int64_t max_len, int max_n, int max_rows) {
    return ::indexer::testing::RandomSpan(rng_, max_len, max_n, max_rows);
  }

  // Decode-shaped spans of many lengths plus a few prefill-shaped ones.
  PoolCase MixedCase(KeyStorage storage, Values values, int decode_spans, int prefill_spans,
                     double huge_token_fraction = 0.0) {
    PoolCase c;
    c.storage = storage;
    c.values = values;
    c.huge_token_fraction = huge_token_fraction;
    c.pt.pages_per_block = 1 + static_cast<int>(rng_() % 16);
    c.pt.block_page_stride = c.pt.pages_per_block + static_cast<int>(rng_() % 8);
    for (int i = 0; i < decode_spans; ++i) c.spans.push_back(RandomSpan(12000, 8, 32));
    for (int i = 0; i < prefill_spans; ++i) c.spans.push_back(RandomSpan(3000, 300, 600));
    BuildCase(c, rng_);
    return c;
  }

  static EngineConfig Config(const PoolCase& c, int layers) {
    EngineConfig config;
    config.head_dim = c.head_dim;
    config.layers = layers;
    config.key_storage = c.storage;
    return config;
  }

  std::unique_ptr<KeyCacheBackend> Backend(const EngineConfig& config, const DeviceSlot& slot,
                                           int lanes, bool graphs) {
    CudaBackendOptions options;
    options.lanes = lanes;
    options.use_graphs = graphs;
    auto backend = engine::MakeCudaBackend(config, slot, options);
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? std::move(*backend) : nullptr;
  }

  // Many threads select random subsets of case A on `lanes` lanes while one thread writes case B
  // into other pages and another reads and copies pages of A; then B is checked too.
  void ConcurrentRun(KeyStorage storage, Values values, int lanes, bool graphs) {
    SCOPED_TRACE("seed " + std::to_string(seed_) + ", lanes " + std::to_string(lanes) +
                 (graphs ? ", graphs" : ", no graphs"));
    LoadedCase a, b;
    a.c = MixedCase(storage, values, 40, 3);
    b.c = MixedCase(storage, values, 12, 1);
    a.layer = b.layer = 1;
    a.page_offset = 0;
    b.page_offset = a.c.num_pages;
    const int64_t scratch_page = b.page_offset + b.c.num_pages;
    const EngineConfig config = Config(a.c, 2);
    std::unique_ptr<KeyCacheBackend> backend =
        Backend(config, DeviceSlot{0, 0, scratch_page + 1}, lanes, graphs);
    ASSERT_NE(backend, nullptr);
    ASSERT_OK(LoadCase(*backend, a, rng_));

    // Pages of A as written, read back before the storm.
    const int64_t page_bytes = 2 * kernels::PageBytes(storage, config.head_dim);
    std::vector<int32_t> probe;
    for (int i = 0; i < 4; ++i) probe.push_back(a.global_bt[rng_() % a.global_bt.size()][0]);
    std::vector<uint8_t> expected(probe.size() * page_bytes);
    ASSERT_OK(backend->ReadPages(probe, expected.data()));

    constexpr int kThreads = 8;
    constexpr int kIterations = 40;
    std::mutex mu;
    std::string first_failure;
    const auto fail = [&](const std::string& why) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_failure.empty()) first_failure = why;
    };
    std::atomic<bool> selecting{true};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(seed_ * 31 + t);
        for (int it = 0; it < kIterations; ++it) {
          const std::string why = SelectAndCheck(*backend, a, RandomSubset(static_cast<int>(a.c.spans.size()), 12, rng));
          if (!why.empty()) return fail("selector " + std::to_string(t) + " iteration " + std::to_string(it) + ": " + why);
        }
      });
    }
    std::thread writer([&] {
      std::mt19937_64 rng(seed_ * 31 + 100);
      const absl::Status status = LoadCase(*backend, b, rng);
      if (!status.ok()) fail("writer: " + status.ToString());
    });
    std::thread reader([&] {
      std::vector<uint8_t> got(expected.size()), copied(page_bytes);
      int rounds = 0;
      while (selecting.load() || rounds < 3) {
        ++rounds;
        const absl::Status read = backend->ReadPages(probe, got.data());
        if (!read.ok()) return fail("reader: " + read.ToString());
        if (got != expected) return fail("reader: pages of A changed while selections ran");
        const size_t i = static_cast<size_t>(rounds) % probe.size();
        const absl::Status copy = backend->CopyPage(probe[i], static_cast<int32_t>(scratch_page));
        if (!copy.ok()) return fail("reader: " + copy.ToString());
        const int32_t scratch = static_cast<int32_t>(scratch_page);
        const absl::Status back = backend->ReadPages(std::span<const int32_t>(&scratch, 1), copied.data());
        if (!back.ok()) return fail("reader: " + back.ToString());
        if (!std::equal(copied.begin(), copied.end(), expected.begin() + i * page_bytes)) {
          return fail("reader: a copied page differs from its source");
        }
      }
    });
    for (std::thread& t : threads) t.join();
    selecting.store(false);
    writer.join();
    reader.join();
    ASSERT_EQ(first_failure, "");
    // B, written while A was being selected from, and A once more, all spans in one call.
    ASSERT_EQ(SelectAndCheck(*backend, b, AllSpans(b)), "");
    ASSERT_EQ(SelectAndCheck(*backend, a, AllSpans(a)), "");

    const CudaBackendCounters n = Counters(*backend);
    EXPECT_EQ(n.lanes, lanes);
    EXPECT_EQ(n.peak_busy_lanes, lanes) << "the selectors never held every lane at once";
    EXPECT_EQ(n.selects, kThreads * kIterations + 2);
    EXPECT_EQ(n.graph_fallbacks, 0);
    EXPECT_EQ(n.graph_launches, graphs ? n.steps : 0);  // key writes too
  }
};

TEST(CudaBackendOptionsTest, EnvironmentValues) {
  const CudaBackendOptions defaults = engine::ParseCudaBackendOptions(nullptr, nullptr);
  EXPECT_EQ(defaults.lanes, 2);
  EXPECT_TRUE(defaults.use_graphs);
  EXPECT_EQ(defaults.graphs_per_lane, 64);
  const CudaBackendOptions off = engine::ParseCudaBackendOptions("0", "1");
  EXPECT_FALSE(off.use_graphs);
  EXPECT_EQ(off.lanes, 1);
  const CudaBackendOptions on = engine::ParseCudaBackendOptions("1", "8");
  EXPECT_TRUE(on.use_graphs);
  EXPECT_EQ(on.lanes, 8);
  for (const char* bad_lanes : {"0", "9", "-1", "two", ""}) {
    EXPECT_EQ(engine::ParseCudaBackendOptions("yes", bad_lanes).lanes, 2) << bad_lanes;
    EXPECT_TRUE(engine::ParseCudaBackendOptions("yes", bad_lanes).use_graphs);
  }
}

TEST_F(CudaLanesTest, ConcurrentSelectsOnTwoLanesWithGraphs) {
  ConcurrentRun(KeyStorage::kBf16, Values::kReal, 2, true);
  if (HasFatalFailure()) return;
  ConcurrentRun(KeyStorage::kFp8E4M3, Values::kIntegers, 2, true);
  ConcurrentRun(KeyStorage::kFp4E2M1, Values::kIntegers, 2, true);
}

TEST_F(CudaLanesTest, ConcurrentSelectsOnThreeLanesWithoutGraphs) {
  ConcurrentRun(KeyStorage::kBf16, Values::kIntegers, 3, false);
}

TEST_F(CudaLanesTest, GraphReplayMatchesDirectLaunches) {
  struct Variant {
    KeyStorage storage;
    Values values;
    double huge;  // keys of +-3e38: every span takes the exact path
  };
  for (const Variant& v : {Variant{KeyStorage::kBf16, Values::kReal, 0.0},
                           Variant{KeyStorage::kFp8E4M3, Values::kIntegers, 0.0},
                           Variant{KeyStorage::kFp4E2M1, Values::kReal, 0.0},
                           Variant{KeyStorage::kBf16, Values::kIntegers, 0.2}}) {
    SCOPED_TRACE("seed " + std::to_string(seed_) + ", " + kernels::KeyStorageName(v.storage) +
                 (v.huge > 0 ? ", exact path" : ""));
    LoadedCase lc;
    lc.c = MixedCase(v.storage, v.values, 30, 3, v.huge);
    lc.layer = 0;
    lc.page_offset = 0;
    const EngineConfig config = Config(lc.c, 1);
    std::unique_ptr<KeyCacheBackend> graphs = Backend(config, DeviceSlot{0, 0, lc.c.num_pages}, 2, true);
    std::unique_ptr<KeyCacheBackend> direct = Backend(config, DeviceSlot{0, 0, lc.c.num_pages}, 2, false);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(direct, nullptr);
    ASSERT_OK(LoadCase(*graphs, lc, rng_));
    ASSERT_OK(LoadCase(*direct, lc, rng_));
    // Warm-up: every span at once needs the most staging and scratch any subset needs.
    ASSERT_EQ(SelectAndCheck(*graphs, lc, AllSpans(lc)), "");
    ASSERT_EQ(SelectAndCheck(*direct, lc, AllSpans(lc)), "");
    const int64_t growths_after_warmup = Counters(*graphs).buffer_growths;

    // Shapes that come back (replays) and fresh ones (updates of a cached topology, or builds),
    // single-threaded so that every step lands on the same lane.
    const int num_spans = static_cast<int>(lc.c.spans.size());
    std::vector<std::vector<int>> shapes;
    for (int i = 0; i < 12; ++i) shapes.push_back(RandomSubset(num_spans, 16, rng_));
    shapes.push_back({num_spans - 1});  // a prefill-shaped span alone
    shapes.push_back({0});              // a decode-shaped span alone
    int graph_steps = 1, direct_steps = 1;
    for (int step = 0; step < 150; ++step) {
      const std::vector<int> which =
          step % 3 == 2 ? RandomSubset(num_spans, 24, rng_) : shapes[rng_() % shapes.size()];
      std::vector<SpanOutput> g, dr;
      ASSERT_EQ(SelectAndCheck(*graphs, lc, which, &g), "") << "graph step " << step;
      ASSERT_EQ(SelectAndCheck(*direct, lc, which, &dr), "") << "direct step " << step;
      ++graph_steps;
      ++direct_steps;
      for (size_t k = 0; k < which.size(); ++k) {
        ASSERT_EQ(g[k].ids, dr[k].ids) << "step " << step << " span " << which[k];
        ASSERT_EQ(g[k].table, dr[k].table) << "step " << step << " span " << which[k];
        ASSERT_EQ(g[k].ctx, dr[k].ctx) << "step " << step << " span " << which[k];
      }
      // The same step again at once: the cached graph as it is, no node updated, no build.
      if (step % 10 == 0) {
        const CudaBackendCounters before = Counters(*graphs);
        std::vector<SpanOutput> again;
        ASSERT_EQ(SelectAndCheck(*graphs, lc, which, &again), "") << "repeat of step " << step;
        ++graph_steps;
        const CudaBackendCounters after = Counters(*graphs);
        for (size_t k = 0; k < which.size(); ++k) ASSERT_EQ(again[k].ids, g[k].ids);
        EXPECT_EQ(after.graph_builds, before.graph_builds) << "step " << step;
        EXPECT_EQ(after.graph_node_updates, before.graph_node_updates) << "step " << step;
      }
    }
    const CudaBackendCounters ng = Counters(*graphs);
    EXPECT_EQ(ng.selects, graph_steps);
    EXPECT_EQ(ng.graph_launches, ng.steps);  // the selections and the key writes before them
    EXPECT_EQ(ng.graph_fallbacks, 0);
    EXPECT_EQ(ng.peak_busy_lanes, 1);
    // No buffer grew after the warm-up; one build per topology met, every other step a replay.
    EXPECT_EQ(ng.buffer_growths, growths_after_warmup);
    EXPECT_LE(ng.graph_builds, 1 + 16);
    EXPECT_GT(ng.graph_node_updates, 0);
    const CudaBackendCounters nd = Counters(*direct);
    EXPECT_EQ(nd.selects, direct_steps);
    EXPECT_EQ(nd.graph_launches, 0);
    EXPECT_EQ(nd.graph_builds, 0);
  }
}

// Sequences grow by one token per step (plans, grids and copy sizes change as blocks fill),
// with a prefill chunk now and then; the CUDA backends (graphs on and off) on a slot starting
// at page 300 answer exactly as the CPU backend does (integer keys: sums are exact).
TEST_F(CudaLanesTest, DecodeLoopMatchesCpuBackend) {
  for (KeyStorage storage : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    SCOPED_TRACE("seed " + std::to_string(seed_) + ", " + kernels::KeyStorageName(storage));
    constexpr int64_t kFirst = 300;
    constexpr int64_t kPages = 1024;
    EngineConfig config;
    config.head_dim = 128;
    config.layers = 1;
    config.key_storage = storage;
    EngineConfig cpu_config = config;
    cpu_config.capacity_pages = kFirst + kPages;  // global ids index the CPU pool directly
    engine::CpuBackend cpu(cpu_config);
    std::unique_ptr<KeyCacheBackend> graphs = Backend(config, DeviceSlot{0, kFirst, kPages}, 2, true);
    std::unique_ptr<KeyCacheBackend> direct = Backend(config, DeviceSlot{0, kFirst, kPages}, 2, false);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(direct, nullptr);
    std::vector<KeyCacheBackend*> backends = {&cpu, graphs.get(), direct.get()};

    const int d = config.head_dim;
    const auto integers = [&](size_t n) {
      std::vector<uint16_t> v(n);
      for (auto& x : v) x = kernels::FloatToBf16(static_cast<float>(static_cast<int>(rng_() % 9) - 4));
      return v;
    };
    struct Seq {
      std::vector<int32_t> pages;
      int64_t length = 0;
      int heads = 1, tokens = 1;
      kernels::SelectParams params;
    };
    int64_t next_page = kFirst;
    std::vector<Seq> seqs(7);
    const auto append = [&](Seq& s, int64_t n) {
      while (static_cast<int64_t>(s.pages.size()) * kBlockSize < s.length + n) {
        s.pages.push_back(static_cast<int32_t>(next_page++));
      }
      const std::vector<uint16_t> keys = integers(static_cast<size_t>(n) * d);
      const int64_t start = s.length;
      for (KeyCacheBackend* b : backends) {
        const absl::Status status = b->WriteKeys(KeyWrite{s.pages.data(), n, 0, 1, &start, keys.data()});
        ASSERT_TRUE(status.ok()) << b->name() << ": " << status;
      }
      s.length += n;
    };
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      s.heads = 1 + static_cast<int>(rng_() % 8);
      s.tokens = i == 0 ? 4 : 1;  // one speculative span
      s.params.topk = 1 + static_cast<int>(rng_() % 40);
      s.params.init_blocks = static_cast<int>(rng_() % 2);
      s.params.local_blocks = static_cast<int>(rng_() % 3);
      // Near a block boundary, so blocks fill during the loop.
      append(s, 4 + static_cast<int64_t>(rng_() % 40) * kBlockSize + kBlockSize - 1 - static_cast<int64_t>(rng_() % 20));
      if (HasFatalFailure()) return;
    }
    const kernels::PageTableParams pt;
    for (int step = 0; step < 200; ++step) {
      for (Seq& s : seqs) append(s, 1);
      if (HasFatalFailure()) return;
      // Per backend: tasks over every sequence (and a prefill chunk of sequence 1 every 25 steps).
      std::vector<std::vector<std::vector<int32_t>>> ids(backends.size());
      std::vector<std::vector<uint16_t>> queries;
      for (const Seq& s : seqs) queries.push_back(integers(static_cast<size_t>(s.tokens) * s.heads * d));
      const bool prefill = step % 25 == 7;
      const int prefill_tokens = static_cast<int>(std::min<int64_t>(seqs[1].length, 200));
      if (prefill) queries.push_back(integers(static_cast<size_t>(prefill_tokens) * 2 * d));
      for (size_t bi = 0; bi < backends.size(); ++bi) {
        std::vector<SelectTask> tasks;
        ids[bi].resize(queries.size());
        for (size_t i = 0; i < queries.size(); ++i) {
          const bool chunk = i == seqs.size();
          const Seq& s = chunk ? seqs[1] : seqs[i];
          SelectTask t;
          t.span.block_table = s.pages.data();
          t.span.num_tokens = chunk ? prefill_tokens : s.tokens;
          t.span.num_heads = chunk ? 2 : s.heads;
          t.span.start_pos = s.length - t.span.num_tokens;
          t.span.queries = queries[i].data();
          t.span.params = s.params;
          ids[bi][i].assign(static_cast<size_t>(t.span.num_tokens) * t.span.num_heads * s.params.topk, kPoison);
          t.span.block_ids = ids[bi][i].data();
          tasks.push_back(t);
        }
        const absl::Status status = backends[bi]->Select(tasks, pt);
        ASSERT_TRUE(status.ok()) << backends[bi]->name() << " step " << step << ": " << status;
      }
      ASSERT_EQ(ids[1], ids[0]) << "graphs vs CPU, step " << step;
      ASSERT_EQ(ids[2], ids[0]) << "direct vs CPU, step " << step;
    }
    const CudaBackendCounters n = Counters(*graphs);
    EXPECT_EQ(n.selects, 200);
    EXPECT_EQ(n.graph_launches, n.steps);  // the selections and the prefill's key writes
    EXPECT_EQ(n.graph_fallbacks, 0);
    // Two topologies (decode alone; decode with prefill), rebuilt only after buffer growth.
    EXPECT_LE(n.graph_builds, 2 * (n.buffer_growths + 1));
  }
}

TEST_F(CudaLanesTest, SlotWithFirstPageTakesGlobalIdsAndRefusesOthers) {
  for (KeyStorage storage : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    SCOPED_TRACE("seed " + std::to_string(seed_) + ", " + kernels::KeyStorageName(storage));
    LoadedCase lc;
    lc.c = MixedCase(storage, Values::kReal, 10, 1);
    lc.layer = 1;
    lc.page_offset = 5000;
    const int64_t first = lc.page_offset;
    const int64_t pages = lc.c.num_pages + 8;  // spare pages past the case's
    const EngineConfig config = Config(lc.c, 2);
    std::unique_ptr<KeyCacheBackend> backend = Backend(config, DeviceSlot{0, first, pages}, 2, true);
    ASSERT_NE(backend, nullptr);
    EXPECT_NE(backend->device().find("pages [5000, "), std::string::npos) << backend->device();
    ASSERT_OK(LoadCase(*backend, lc, rng_));
    ASSERT_EQ(SelectAndCheck(*backend, lc, AllSpans(lc)), "");

    const int32_t below = static_cast<int32_t>(first - 1);
    const int32_t above = static_cast<int32_t>(first + pages);
    const int32_t last = static_cast<int32_t>(first + pages - 1);
    for (int32_t bad : {below, above, int32_t{-1}, int32_t{0}}) {
      SCOPED_TRACE("page id " + std::to_string(bad));
      // A key write whose block table holds the id.
      std::vector<int32_t> bt = {static_cast<int32_t>(first), bad};
      const std::vector<uint16_t> keys(static_cast<size_t>(200) * config.head_dim, kernels::FloatToBf16(1.0f));
      const int64_t start = 0;
      EXPECT_EQ(backend->WriteKeys(KeyWrite{bt.data(), 200, 0, 1, &start, keys.data()}).code(),
                absl::StatusCode::kInternal);
      // A selection whose block table holds it, among good spans: refused, outputs untouched.
      LoadedCase broken = lc;
      broken.global_bt[0].back() = bad;
      std::vector<SpanOutput> outs;
      const std::vector<int> which = {1, 0};
      const std::vector<SelectTask> tasks = MakeTasks(broken, which, &outs);
      EXPECT_EQ(backend->Select(tasks, lc.c.pt).code(), absl::StatusCode::kInternal);
      for (const SpanOutput& o : outs) {
        EXPECT_TRUE(std::all_of(o.ids.begin(), o.ids.end(), [](int32_t v) { return v == kPoison; }));
      }
      EXPECT_EQ(backend->CopyPage(bad, static_cast<int32_t>(first)).code(), absl::StatusCode::kInternal);
      EXPECT_EQ(backend->CopyPage(static_cast<int32_t>(first), bad).code(), absl::StatusCode::kInternal);
      std::vector<uint8_t> bytes(static_cast<size_t>(2 * 2 * kernels::PageBytes(storage, config.head_dim)));
      const std::vector<int32_t> two = {static_cast<int32_t>(first), bad};
      EXPECT_EQ(backend->ReadPages(two, bytes.data()).code(), absl::StatusCode::kInternal);
      EXPECT_EQ(backend->WritePages(two, bytes.data()).code(), absl::StatusCode::kInternal);
    }
    // Nothing above touched the cache: every span still answers as the reference does.
    ASSERT_EQ(SelectAndCheck(*backend, lc, AllSpans(lc)), "");

    // Pages through global ids: copy a case page to the last page of the slot, read both back.
    const int32_t src = lc.global_bt[0][0];
    ASSERT_OK(backend->CopyPage(src, last));
    const size_t page_bytes = static_cast<size_t>(2 * kernels::PageBytes(storage, config.head_dim));
    std::vector<uint8_t> both(2 * page_bytes);
    const std::vector<int32_t> pair = {src, last};
    ASSERT_OK(backend->ReadPages(pair, both.data()));
    EXPECT_TRUE(std::equal(both.begin(), both.begin() + page_bytes, both.begin() + page_bytes));
    // WritePages at the slot's last id, then read back.
    std::vector<uint8_t> pattern(page_bytes);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>((i * 7) & 0x3f);
    const std::vector<int32_t> one = {last};
    ASSERT_OK(backend->WritePages(one, pattern.data()));
    std::vector<uint8_t> back(page_bytes);
    ASSERT_OK(backend->ReadPages(one, back.data()));
    EXPECT_EQ(back, pattern);
  }
}

TEST_F(CudaLanesTest, UnusableSlotsAreRefused) {
  EngineConfig config;
  const int count = engine::CudaDeviceCount();
  ASSERT_GE(count, 1);
  for (const DeviceSlot& slot : {DeviceSlot{count, 0, 16}, DeviceSlot{-1, 0, 16}, DeviceSlot{0, -1, 16},
                                 DeviceSlot{0, (int64_t{1} << 31) - 8, 16}}) {
    auto backend = engine::MakeCudaBackend(config, slot);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument)
        << slot.ordinal << " " << slot.first_page << " " << slot.num_pages;
  }
  // num_pages 0: config.capacity_pages pages.
  config.capacity_pages = 64;
  auto whole = engine::MakeCudaBackend(config, DeviceSlot{0, 0, 0});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NE((*whole)->device().find("pages [0, 64)"), std::string::npos) << (*whole)->device();

  // Unrelated code may leave an error in this thread's CUDA error state (as the refused slots
  // above once did): the backend's calls report their own errors only.
  EXPECT_NE(cudaSetDevice(-1), cudaSuccess);
  const std::vector<int32_t> bt = {63};
  const std::vector<uint16_t> keys(static_cast<size_t>(5) * config.head_dim, kernels::FloatToBf16(1.0f));
  const int64_t start = 0;
  ASSERT_OK((*whole)->WriteKeys(KeyWrite{bt.data(), 5, 0, 1, &start, keys.data()}));
  std::vector<uint16_t> query(config.head_dim, kernels::FloatToBf16(1.0f));
  std::vector<int32_t> ids(4, kPoison);
  SelectTask task;
  task.span.block_table = bt.data();
  task.span.start_pos = 4;
  task.span.queries = query.data();
  task.span.params.topk = 4;
  task.span.block_ids = ids.data();
  ASSERT_OK((*whole)->Select(std::span<const SelectTask>(&task, 1), kernels::PageTableParams{}));
  EXPECT_EQ(ids, (std::vector<int32_t>{0, -1, -1, -1}));
  (void)cudaGetLastError();
}

TEST_F(CudaLanesTest, SecondDevice) {
  if (engine::CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs two visible CUDA devices; " << engine::CudaDeviceCount() << " visible";
  }
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::vector<LoadedCase> cases(2);
  std::vector<std::unique_ptr<KeyCacheBackend>> backends;
  for (int dev = 0; dev < 2; ++dev) {
    LoadedCase& lc = cases[dev];
    lc.c = MixedCase(dev == 0 ? KeyStorage::kBf16 : KeyStorage::kFp8E4M3, Values::kReal, 20, 2);
    lc.layer = 0;
    lc.page_offset = dev == 0 ? 0 : 7000;
    SCOPED_TRACE("device " + std::to_string(dev));
    backends.push_back(Backend(Config(lc.c, 1), DeviceSlot{dev, lc.page_offset, lc.c.num_pages}, 2, true));
    ASSERT_NE(backends.back(), nullptr);
    ASSERT_OK(LoadCase(*backends.back(), lc, rng_));
  }
  EXPECT_NE(backends[1]->device().find("device 1"), std::string::npos) << backends[1]->device();
  // Every thread uses both devices, in random order: each call must make its own device current.
  std::mutex mu;
  std::string first_failure;
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed_ * 17 + t);
      for (int it = 0; it < 30; ++it) {
        const int dev = static_cast<int>(rng() % 2);
        const LoadedCase& lc = cases[dev];
        const std::string why =
            SelectAndCheck(*backends[dev], lc, RandomSubset(static_cast<int>(lc.c.spans.size()), 10, rng));
        if (!why.empty()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first_failure.empty()) first_failure = "device " + std::to_string(dev) + ": " + why;
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(first_failure, "");
  for (int dev = 0; dev < 2; ++dev) {
    const CudaBackendCounters n = Counters(*backends[dev]);
    EXPECT_EQ(n.graph_fallbacks, 0) << "device " << dev;
    EXPECT_EQ(n.graph_launches, n.steps) << "device " << dev;
  }
}


// A key write is a step of its own and takes any free lane: on a backend of two lanes, a write
// made while a long selection holds one lane (and its kernel runs) returns before the selection
// does.
TEST_F(CudaLanesTest, KeyWritesDoNotWaitForALaneASelectionHolds) {
  EngineConfig config;
  config.head_dim = 128;
  config.layers = 1;
  constexpr int kBlocks = 2048;  // every span reads the same 2048 pages (64 MiB of zero keys)
  constexpr int kSpans = 2048;   // 137 GB of key reads: tens of milliseconds on an H200
  std::unique_ptr<KeyCacheBackend> backend = Backend(config, DeviceSlot{0, 0, kBlocks + 1}, 2, true);
  ASSERT_NE(backend, nullptr);
  std::vector<int32_t> table(kBlocks);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<uint16_t> queries(config.head_dim, kernels::FloatToBf16(1.0f));
  std::vector<int32_t> ids(int64_t{kSpans} * 16);
  std::vector<SelectTask> tasks(kSpans);
  for (int i = 0; i < kSpans; ++i) {
    kernels::SpanSelect& s = tasks[i].span;
    s.block_table = table.data();
    s.start_pos = int64_t{kBlocks} * kBlockSize - 1;
    s.queries = queries.data();
    s.params.topk = 16;
    s.block_ids = ids.data() + int64_t{i} * 16;
  }
  const kernels::PageTableParams pt;
  ASSERT_OK(backend->Select(std::span<const SelectTask>(tasks.data(), 1), pt));  // warm: graphs, buffers
  const int32_t write_page = kBlocks;
  const int64_t start = 0;
  const std::vector<uint16_t> key(config.head_dim, kernels::FloatToBf16(2.0f));
  const KeyWrite write{&write_page, 1, 0, 1, &start, key.data()};
  ASSERT_OK(backend->WriteKeys(write));  // warm the other lane

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::fill(ids.begin(), ids.end(), -7);
    const int64_t before = Counters(*backend).selects;
    std::atomic<bool> started{false}, select_done{false};
    absl::Status select_status;
    std::thread selector([&] {
      started.store(true);
      select_status = backend->Select(tasks, pt);
      select_done.store(true);
    });
    // The selector takes the lane as Select starts; then it stages 2048 spans and runs for tens
    // of milliseconds. Wait until it has started, then long enough for it to hold the lane.
    while (!started.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const bool lane_held = !select_done.load();
    const absl::Status written = backend->WriteKeys(write);
    const bool returned_first = !select_done.load();
    selector.join();
    ASSERT_OK(written);
    ASSERT_OK(select_status);
    ASSERT_EQ(Counters(*backend).selects, before + 1);
    ASSERT_TRUE(lane_held) << "the selection ended within 5 ms: too short for this GPU";
    EXPECT_TRUE(returned_first) << "the key write returned only after the selection holding the lane";
    // Zero keys everywhere it read: the forced local block first, then ties to the lowest ids.
    for (int i = 0; i < kSpans; i += 97) {
      EXPECT_EQ(ids[int64_t{i} * 16], kBlocks - 1) << "span " << i;
      for (int j = 1; j < 16; ++j) EXPECT_EQ(ids[int64_t{i} * 16 + j], j - 1) << "span " << i;
    }
  }
}

}  // namespace
}  // namespace indexer::testing
