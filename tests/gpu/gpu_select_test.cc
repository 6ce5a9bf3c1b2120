// The CUDA selectors against the CPU reference (kernels/cpu_reference.h) on fresh random inputs
// every run: odd shapes, ragged batches of 1 to 733 spans, lengths from 1 to 262144 with partial
// pages, ties, NaN, forced blocks, n > 1, prefill chunks, bf16, fp8 and fp4, head_dim 64/128/256,
// and each top-k path (whole-row sorts, warp thresholds, registers, the threshold pass and its
// fallback). Outputs are poisoned before each launch. Skips (with a message) where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_resources.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/span_plan.h"
#include "kernels/cuda/step_copy.h"
#include "kernels/cuda/step_staging.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testing/gpu_test.h"

namespace indexer::testing {
namespace {

using kernels::KeyStorage;

enum class Path { kAuto, kPrefillOnly, kExactOnly };

#define CUDA_OK(expr)                                                           \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    ASSERT_EQ(cudaSuccess, err_) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

class GpuSelectTest : public GpuTest {
 protected:
  // Stages the case as the CUDA backend does (kernels/cuda/step_staging.h: decode-shaped spans
  // through the fused decode selector, the rest through prefill; or everything through prefill,
  // or through the exact path), runs it `repeats` times with poisoned outputs, and checks every
  // span every time.
  void Run(PoolCase& c, Path path = Path::kAuto, int repeats = 2) {
    SCOPED_TRACE("seed " + std::to_string(seed_));
    BuildCase(c, rng_);
    const int d = c.head_dim;
    engine::DeviceBuffer pool, in, out, scores, counters;
    ASSERT_TRUE(pool.Allocate(c.pool.size()).ok());
    CUDA_OK(cudaMemcpy(pool.get(), c.pool.data(), c.pool.size(), cudaMemcpyHostToDevice));
    // Every span's outputs in host vectors, where StepStaging::Scatter puts them.
    std::vector<int64_t> ids_off, table_off, ctx_off;
    int64_t n_ids = 0, n_table = 0, n_rows = 0;
    for (const SpanCase& s : c.spans) {
      const int rows = s.num_tokens * s.num_heads;
      ids_off.push_back(n_ids);
      n_ids += int64_t{rows} * s.params.topk;
      table_off.push_back(n_table);
      n_table += s.attn ? int64_t{rows} * s.params.topk * c.pt.pages_per_block : 0;
      ctx_off.push_back(n_rows);
      n_rows += rows;
    }
    std::vector<int32_t> got_ids(n_ids), got_table(n_table), got_ctx(n_rows);
    std::vector<kernels::cuda::StagedSpan> staged(c.spans.size());
    for (size_t i = 0; i < c.spans.size(); ++i) {
      const SpanCase& s = c.spans[i];
      const int rows = s.num_tokens * s.num_heads;
      kernels::SpanSelect& h = staged[i].host;
      h = SpanInputs(s);
      h.block_ids = got_ids.data() + ids_off[i];
      h.page_table = s.attn ? got_table.data() + table_off[i] : nullptr;
      h.context_lens = s.attn ? got_ctx.data() + ctx_off[i] : nullptr;
      staged[i].keys = pool.get();
      // Paths as the backend chooses them (or prefill for every span the exact path need not
      // take, or exact for all).
      kernels::cuda::SpanPath& p = staged[i].path;
      p = kernels::cuda::ChoosePath(rows, d, c.storage,
                                    kernels::cuda::ScanBf16(s.queries.data(), int64_t{rows} * d),
                                    c.max_abs_key);
      if (path == Path::kPrefillOnly && p == kernels::cuda::SpanPath::kDecode) {
        p = kernels::cuda::SpanPath::kPrefill;
      }
      if (path == Path::kExactOnly) p = kernels::cuda::SpanPath::kExact;
    }
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    kernels::cuda::StepStaging staging;
    staging.Plan({}, staged, d, c.storage, c.pt);
    // Mapped pinned staging and the copy kernels around the selectors, as the backend runs a step.
    engine::PinnedBuffer host_in, host_out;
    const size_t out_bytes = static_cast<size_t>(std::max<int64_t>(staging.output_bytes(), 4));
    ASSERT_TRUE(host_in.Allocate(std::max<size_t>(staging.input_bytes(), 16)).ok());
    ASSERT_TRUE(host_out.Allocate(out_bytes).ok());
    ASSERT_TRUE(in.Allocate(std::max<size_t>(staging.input_bytes(), 16)).ok());
    ASSERT_TRUE(out.Allocate(out_bytes).ok());
    ASSERT_EQ(staging.WriteInputs(host_in.get<char>(), in.get<char>(), out.get<char>(),
                                  kernels::cuda::PageRange{0, c.num_pages}, {}, sms,
                                  kernels::cuda::DecodeTuning{0, c.decode_warps}),
              std::nullopt);
    ASSERT_TRUE(scores.Allocate(staging.ScoreFloats() * 4).ok());
    ASSERT_TRUE(counters.Allocate(staging.DecodeCounters() * 4).ok());
    CUDA_OK(cudaMemset(counters.get(), 0, counters.bytes()));
    kernels::cuda::LaunchList launches;
    CUDA_OK(kernels::cuda::DescribeStepCopy(host_in.get(), in.get(), staging.input_bytes(),
                                            &launches));
    CUDA_OK(staging.Describe(in.get<char>(), out.get<char>(), scores.get<float>(), counters.get<int>(),
                             &launches));
    CUDA_OK(kernels::cuda::DescribeStepCopy(out.get(), host_out.get(), staging.output_bytes(),
                                            &launches));

    for (int rep = 0; rep < repeats; ++rep) {
      CUDA_OK(cudaMemset(in.get(), 0xff, in.bytes()));          // the copy kernel must fill it
      CUDA_OK(cudaMemset(out.get(), 0x7f, out.bytes()));        // poison: 0x7f7f7f7f
      std::memset(host_out.get(), 0x7f, out_bytes);
      CUDA_OK(cudaMemset(scores.get(), 0xff, scores.bytes()));  // NaN: unwritten scores show
      CUDA_OK(launches.Enqueue(nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      staging.Scatter(host_out.get<char>());
      if (c.values == Values::kIntegers && rep == 0) {
        ASSERT_NO_FATAL_FAILURE(CheckRawScores(c, staging.batch(), scores));
      }
      for (size_t i = 0; i < c.spans.size(); ++i) {
        const SpanCase& s = c.spans[i];
        const std::string why = CheckSpan(c, s, got_ids.data() + ids_off[i],
                                          got_table.data() + table_off[i], got_ctx.data() + ctx_off[i]);
        ASSERT_EQ(why, "") << "span " << i << " of " << c.spans.size() << " (length " << s.length
                           << ", n " << s.num_tokens << ", H " << s.num_heads << ", topk " << s.params.topk
                           << ", init " << s.params.init_blocks << ", local " << s.params.local_blocks
                           << ", head_dim " << d << ", " << kernels::KeyStorageName(c.storage)
                           << ", repeat " << rep << ")";
      }
    }
  }

  // Integer inputs make every raw block score exact: the scores the last group of selectors
  // (decode, prefill, exact run in that order and share the scratch) left there are the
  // reference's, blocks a selector forces aside. Catches a scaling of every score (say a
  // storage's decode factor), which leaves the selections alone. The batch orders its
  // descriptors its own way; staging lays the spans' queries out in input order, so the
  // descriptors by query address are the spans in order.
  void CheckRawScores(const PoolCase& c, const kernels::cuda::SelectBatch& batch,
                      const engine::DeviceBuffer& scores) {
    std::vector<float> got(static_cast<size_t>(batch.ScoreFloats()));
    CUDA_OK(cudaMemcpy(got.data(), scores.get(), got.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<const kernels::cuda::SpanDesc*> by_input;
    for (const kernels::cuda::SpanDesc& d : batch.descs) by_input.push_back(&d);
    std::sort(by_input.begin(), by_input.end(),
              [](const auto* a, const auto* b) { return a->queries < b->queries; });
    ASSERT_EQ(by_input.size(), c.spans.size());
    const size_t last_group = batch.n_exact > 0 ? batch.n_decode + batch.n_prefill
                              : batch.n_prefill > 0 ? batch.n_decode
                                                    : 0;
    for (size_t i = 0; i < c.spans.size(); ++i) {
      const SpanCase& s = c.spans[i];
      const kernels::cuda::SpanDesc& d = *by_input[i];
      if (static_cast<size_t>(&d - batch.descs.data()) < last_group) continue;
      ASSERT_EQ(d.start_pos, s.start_pos);
      ASSERT_EQ(d.Rows(), s.num_tokens * s.num_heads);
      for (int row = 0; row < d.Rows(); ++row) {
        const int64_t v = kernels::VisibleBlocks(s.start_pos + row / s.num_heads);
        for (int64_t b = s.params.init_blocks; b < v - s.params.local_blocks; ++b) {
          const int64_t at = row * int64_t{d.visible_blocks} + b;
          ASSERT_EQ(got[static_cast<size_t>(d.score_offset + at)], s.ref_raw[static_cast<size_t>(at)])
              << "span " << i << " row " << row << " block " << b << " of " << v << ", "
              << kernels::KeyStorageName(c.storage);
        }
      }
    }
  }

  // 0 to 2 forced initial and local blocks, and a page table or none, at random.
  void RandomForcingAndTable(SpanCase& s) {
    s.params.init_blocks = static_cast<int>(rng_() % 3);
    s.params.local_blocks = static_cast<int>(rng_() % 3);
    s.attn = (rng_() % 2) == 0;
  }

  SpanCase RandomSpan(int64_t max_len, int max_n, int max_rows) {
    return ::indexer::testing::RandomSpan(rng_, max_len, max_n, max_rows);
  }
};

TEST_F(GpuSelectTest, SmallBoundaryLengthsEveryFormat) {
  for (int d : {64, 128, 256}) {
    for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
      for (Values v : {Values::kIntegers, Values::kReal}) {
        PoolCase c;
        c.head_dim = d;
        c.storage = st;
        c.values = v;
        for (int64_t len : {1, 2, 127, 128, 129, 255, 256, 257, 1000, 4096}) {
          SpanCase s;
          s.length = len;
          s.params.topk = 16;
          s.attn = true;
          c.spans.push_back(s);
        }
        Run(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(GpuSelectTest, RaggedDecodeBatches) {
  for (int batch : {1, 3, 7, 19, 733}) {
    for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
      PoolCase c;
      c.storage = st;
      c.values = (batch % 2) ? Values::kIntegers : Values::kReal;
      c.pt.pages_per_block = 1 + static_cast<int>(rng_() % 16);
      c.pt.block_page_stride = c.pt.pages_per_block + static_cast<int>(rng_() % 8);
      for (int i = 0; i < batch; ++i) c.spans.push_back(RandomSpan(batch > 100 ? 3000 : 20000, 8, 32));
      Run(c);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(GpuSelectTest, OneShortAndOneLongInOneBatch) {
  PoolCase c;
  c.values = Values::kIntegers;
  SpanCase shortest;
  shortest.length = 5;
  SpanCase longest;
  longest.length = 262144;
  longest.num_heads = 4;
  c.spans = {shortest, longest, shortest};
  Run(c);
}

TEST_F(GpuSelectTest, LongContexts) {
  for (int64_t len : {131072, 262144 - 77}) {
    for (int heads : {1, 4}) {
      PoolCase c;
      c.values = Values::kReal;
      SpanCase s;
      s.length = len;
      s.num_heads = heads;
      s.params.topk = 16;
      s.params.init_blocks = 1;
      s.attn = true;
      c.spans = {s, s};
      Run(c);
      if (HasFatalFailure()) return;
    }
  }
}

// Single rows of 513 to 2048 blocks (one warp's threshold selection over 1024 or 2048 keys, half
// of them padding at 513 and 1025 blocks): integer scores, whose ties can overflow the candidate
// list into the CTA-wide sort, top-k of 5 to 32, forced blocks, both key formats.
TEST_F(GpuSelectTest, OneLongRowWithTies) {
  for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    PoolCase c;
    c.storage = st;
    c.values = Values::kIntegers;
    int topk_index = 0;
    for (int64_t len : {65537, 100000, 131073, 200000, 262144}) {
      SpanCase s;
      s.length = len;
      s.params.topk = std::array<int, 3>{16, 32, 5}[topk_index++ % 3];
      s.params.init_blocks = static_cast<int>(rng_() % 3);
      s.params.local_blocks = 1 + static_cast<int>(rng_() % 2);
      s.attn = true;
      c.spans.push_back(s);
    }
    Run(c);
    if (HasFatalFailure()) return;
  }
}

TEST_F(GpuSelectTest, SpeculativeSpansAndManyHeads) {
  for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    PoolCase c;
    c.storage = st;
    c.values = Values::kIntegers;
    for (int n = 1; n <= 8; ++n) {
      SpanCase s;
      s.length = 300 + 129 * n;
      s.num_tokens = n;
      s.num_heads = 32 / n;
      s.params.topk = 8;
      s.params.local_blocks = 2;
      s.attn = true;
      c.spans.push_back(s);
    }
    Run(c);
    if (HasFatalFailure()) return;
  }
}

TEST_F(GpuSelectTest, ExactTiesGoToTheLowerBlock) {
  // Keys and queries in {-1, 0, 1}-ish integers: many blocks tie exactly.
  PoolCase c;
  c.values = Values::kIntegers;
  for (int i = 0; i < 40; ++i) {
    SpanCase s = RandomSpan(5000, 4, 16);
    s.params.topk = 32;
    c.spans.push_back(s);
  }
  Run(c);
}

TEST_F(GpuSelectTest, InfAndNaNDotProducts) {
  PoolCase c;
  c.values = Values::kIntegers;
  c.huge_token_fraction = 0.3;
  for (int i = 0; i < 20; ++i) c.spans.push_back(RandomSpan(3000, 4, 16));
  Run(c);
  if (HasFatalFailure()) return;
  PoolCase every;  // every token NaN or Inf: whole blocks score -1e30 or +-Inf
  every.values = Values::kIntegers;
  every.huge_token_fraction = 1.0;
  for (int i = 0; i < 5; ++i) every.spans.push_back(RandomSpan(2000, 2, 4));
  Run(every);
}

TEST_F(GpuSelectTest, PrefillChunks) {
  for (int d : {64, 128, 256}) {
    for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
      PoolCase c;
      c.head_dim = d;
      c.storage = st;
      c.values = (d == 128) ? Values::kReal : Values::kIntegers;
      SpanCase fresh;  // a first chunk: causal from position 0
      fresh.length = 1500;
      fresh.num_tokens = 1500;
      fresh.num_heads = 2;
      fresh.params.topk = 12;
      fresh.params.init_blocks = 1;
      fresh.attn = true;
      SpanCase later;  // a chunk after a prefix, ending before the sequence's end
      later.length = 9000;
      later.num_tokens = 777;
      later.start_pos = 5000;
      later.num_heads = 3;
      later.params.topk = 40;
      c.spans = {fresh, later};
      Run(c);
      if (HasFatalFailure()) return;
    }
  }
}

// Rows that see 33 to 64 blocks (n = 64) with topk <= 32 are ordered in registers, two keys per
// lane (WarpTop32Of64); topk 33 and more still sort in shared memory. Decode spans and a prefill
// chunk whose rows start below 33 blocks and end at 64, integers (ties) and real values, forced
// blocks, page tables.
TEST_F(GpuSelectTest, RowsOf33To64Blocks) {
  for (Values v : {Values::kIntegers, Values::kReal}) {
    for (int topk : {1, 7, 16, 32, 33}) {
      PoolCase c;
      c.values = v;
      for (int i = 0; i < 6; ++i) {
        SpanCase d = RandomSpan(8192, 4, 8);
        d.length = 4097 + static_cast<int64_t>(rng_() % 4096);
        d.start_pos = -1;
        d.params.topk = topk;
        c.spans.push_back(d);
      }
      for (int64_t start : {3968, 7900}) {  // rows of 32 to 35, and of 62 to 64 visible blocks
        SpanCase chunk;
        chunk.start_pos = start;
        chunk.num_tokens = static_cast<int>(std::min<int64_t>(300, 8192 - start));
        chunk.length = start + chunk.num_tokens;
        chunk.num_heads = 2;
        chunk.params.topk = topk;
        chunk.params.init_blocks = static_cast<int>(rng_() % 3);
        chunk.params.local_blocks = static_cast<int>(rng_() % 3);
        chunk.attn = true;
        c.spans.push_back(chunk);
      }
      Run(c);
      if (HasFatalFailure()) return;
      Run(c, Path::kPrefillOnly, 1);
      if (HasFatalFailure()) return;
    }
  }
}

// Up to 8 rows with NextPow2(rows) * n <= 4096 and topk <= 16 select in registers
// (register_topk.cuh): one warp per row and 1 to 16 key vectors (a threshold and its fallback from
// 4 on), or two to eight warps per row merged through shared memory. Rows of 1 to 4097 blocks
// around every power of two, 1 to 8 rows (tokens of one span end in different blocks), topk on
// both sides of 16, and shapes one step past the path's bound (which take the threshold pass or
// the shared-memory selection).
TEST_F(GpuSelectTest, RegisterTopKRowsAroundItsBounds) {
  const int64_t lengths[] = {1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025};
  for (Values v : {Values::kIntegers, Values::kReal}) {
    for (int topk : {1, 5, 16, 17}) {
      PoolCase c;
      c.values = v;
      for (int rows : {1, 2, 3, 4, 5, 8}) {
        const int rows_pow2 = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
        for (int i = 0; i < 3; ++i) {
          int64_t blocks = 0;
          do {
            blocks = lengths[rng_() % std::size(lengths)];
          } while (rows_pow2 * blocks > 8192);
          SpanCase s;
          // Whole rows as heads of one token, or as tokens (up to 8) that straddle a block end.
          s.num_tokens = (i % 2) == 0 ? 1 : rows;
          s.num_heads = rows / s.num_tokens;
          s.length = std::max<int64_t>(s.num_tokens, 128 * (blocks - 1) + 1 + static_cast<int64_t>(rng_() % 128));
          s.params.topk = topk;
          RandomForcingAndTable(s);
          c.spans.push_back(s);
        }
      }
      Run(c);
      if (HasFatalFailure()) return;
    }
    // Longer rows at head_dim 64 (smaller pages): one row of up to 4096 blocks and one past it,
    // two rows of up to 2048 blocks, and two of up to 4096 without page tables, which the decode
    // selector's last CTA takes in two passes of one row (its shared memory holds one such row).
    PoolCase c;
    c.head_dim = 64;
    c.values = v;
    for (const auto& [rows, blocks] : {std::pair{1, 2049 + static_cast<int64_t>(rng_() % 2048)}, std::pair{1, int64_t{4097}},
                                      std::pair{2, 1025 + static_cast<int64_t>(rng_() % 1024)},
                                      std::pair{-2, 2049 + static_cast<int64_t>(rng_() % 2048)}}) {
      SpanCase s;
      s.num_tokens = rows > 0 ? rows : 1;
      s.num_heads = rows > 0 ? 1 : -rows;  // -2: two heads of one token
      s.length = 128 * (blocks - 1) + 1 + static_cast<int64_t>(rng_() % 128);
      s.params.topk = 1 + static_cast<int>(rng_() % 16);
      RandomForcingAndTable(s);
      if (rows < 0) s.attn = false;  // no page-table barrier between the passes
      c.spans.push_back(s);
    }
    Run(c);
    if (HasFatalFailure()) return;
  }
}

// Several rows of 257 to 1024 visible blocks (n = 512 or 1024) take the decode selector's
// threshold pass (topk <= 32): two warps per row for up to four rows, one warp per row and several
// passes for more, speculative tokens whose rows end in different blocks. Integer values tie
// often enough that some rows' candidate lists overflow and fall back to the shared-memory
// selection.
TEST_F(GpuSelectTest, ThresholdPassLongRowsAndTies) {
  for (Values v : {Values::kIntegers, Values::kReal}) {
    PoolCase c;
    c.values = v;
    for (int i = 0; i < 8; ++i) {
      SpanCase s;
      const int64_t base = (i % 2) == 0 ? 32768 : 65536;  // n = 512, then n = 1024
      s.length = base + 1 + static_cast<int64_t>(rng_() % base);
      s.num_tokens = 1 + static_cast<int>(rng_() % 8);
      s.num_heads = 1 + static_cast<int>(rng_() % std::max(1, 32 / s.num_tokens));
      if (s.num_tokens * s.num_heads < 2) s.num_heads = 2;
      if (i == 2) {
        // Tokens on both sides of a block boundary: their rows see different block counts.
        s.length = 128 * (300 + static_cast<int64_t>(rng_() % 100)) + 2;
        s.num_tokens = 6;
        s.num_heads = 4;
      }
      const int topks[] = {1, 5, 16, 32};
      s.params.topk = topks[rng_() % 4];
      RandomForcingAndTable(s);
      c.spans.push_back(s);
    }
    Run(c);
    if (HasFatalFailure()) return;
  }
}

TEST_F(GpuSelectTest, PrefillPathOnDecodeShapes) {
  PoolCase c;
  c.values = Values::kIntegers;
  for (int i = 0; i < 19; ++i) c.spans.push_back(RandomSpan(6000, 8, 32));
  Run(c, Path::kPrefillOnly);
}

TEST_F(GpuSelectTest, ExactPathOnOrdinaryInputs) {
  for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
    PoolCase c;
    c.storage = st;
    c.values = Values::kReal;  // the exact path matches the reference bit for bit: still exact
    for (int i = 0; i < 7; ++i) c.spans.push_back(RandomSpan(3000, 8, 32));
    Run(c, Path::kExactOnly);
    if (HasFatalFailure()) return;
  }
}

TEST_F(GpuSelectTest, MixedDecodeAndPrefillInOneBatch) {
  PoolCase c;
  c.values = Values::kReal;
  for (int i = 0; i < 30; ++i) c.spans.push_back(RandomSpan(8000, 8, 32));
  for (int i = 0; i < 3; ++i) c.spans.push_back(RandomSpan(4000, 600, 1200));
  Run(c);
}

// fp4 keys on every path: exact ties on integer inputs (stored values are short binary fractions,
// so sums stay exact), and real values next to prefill spans in one batch.
TEST_F(GpuSelectTest, Fp4TiesAndMixedBatchesOnEveryPath) {
  for (Path path : {Path::kAuto, Path::kPrefillOnly, Path::kExactOnly}) {
    PoolCase ties;
    ties.storage = KeyStorage::kFp4E2M1;
    ties.values = Values::kIntegers;
    for (int i = 0; i < 24; ++i) {
      SpanCase s = RandomSpan(5000, 4, 16);
      s.params.topk = 32;
      ties.spans.push_back(s);
    }
    Run(ties, path, 1);
    if (HasFatalFailure()) return;
  }
  for (int d : {64, 256}) {
    PoolCase mixed;
    mixed.storage = KeyStorage::kFp4E2M1;
    mixed.head_dim = d;
    mixed.values = Values::kReal;
    for (int i = 0; i < 20; ++i) mixed.spans.push_back(RandomSpan(8000, 8, d == 256 ? 16 : 32));
    for (int i = 0; i < 2; ++i) mixed.spans.push_back(RandomSpan(4000, 300, 600));
    Run(mixed);
    if (HasFatalFailure()) return;
  }
}

// fp4 decode with both numbers of warps per block (DecodeWarpsSupported) on units of many blocks:
// rounds cut short by units and spans, rows masked within a tile, one to four n-tiles, ties on
// integer inputs and real values, every head_dim.
TEST_F(GpuSelectTest, Fp4DecodeRoundsWithEveryNumberOfWarpsPerBlock) {
  for (int d : {64, 128, 256}) {
    for (int warps : {2, 8}) {
      for (Values values : {Values::kIntegers, Values::kReal}) {
        SCOPED_TRACE("head_dim " + std::to_string(d) + ", " + std::to_string(warps) + " warps per block");
        PoolCase c;
        c.storage = KeyStorage::kFp4E2M1;
        c.head_dim = d;
        c.values = values;
        c.decode_warps = warps;
        for (int i = 0; i < 24; ++i) c.spans.push_back(RandomSpan(16000, 8, d == 256 ? 16 : 32));
        Run(c, Path::kAuto, 1);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The append kernel stores exactly the bytes kernels::StoreKey stores, for every storage: keys of
// many magnitudes (saturated and subnormal fp4 scales), exact ties between fp4 codes, zero groups.
TEST_F(GpuSelectTest, AppendKernelStoresWhatTheCpuStores) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int d : {64, 128, 256}) {
    for (KeyStorage st : {KeyStorage::kBf16, KeyStorage::kFp8E4M3, KeyStorage::kFp4E2M1}) {
      SCOPED_TRACE(std::string(kernels::KeyStorageName(st)) + ", head_dim " + std::to_string(d));
      constexpr int kPages = 5;
      constexpr int64_t kTokens = 3 * kernels::kBlockSize + 77;
      const std::vector<int32_t> table = {3, 0, 4, 1};
      std::vector<uint16_t> keys(static_cast<size_t>(kTokens) * d);
      for (int64_t t = 0; t < kTokens; ++t) {
        const int kind = static_cast<int>(t % 4);
        const float mag = std::ldexp(1.0f, static_cast<int>(rng_() % 40) - 24);
        for (int i = 0; i < d; ++i) {
          float v = normal(rng_) * mag;
          // Ties between codes, a zero group, saturated scales.
          if (kind == 1) v = static_cast<float>(static_cast<int>(rng_() % 13) - 6) * 0.25f;
          if (kind == 2 && i < 16) v = 0.0f;
          if (kind == 3 && i % 16 == 0) v = 1e6f;
          keys[static_cast<size_t>(t) * d + i] = kernels::FloatToBf16(v);
        }
      }
      std::vector<uint8_t> want(static_cast<size_t>(kPages * kernels::PageBytes(st, d)), 0);
      for (int64_t t = 0; t < kTokens; ++t) {
        kernels::StoreKey(want.data(), st, d, table[t / kernels::kBlockSize],
                          static_cast<int>(t % kernels::kBlockSize), keys.data() + t * d);
      }
      engine::DeviceBuffer pool, d_keys, d_table, d_start;
      ASSERT_TRUE(pool.Allocate(want.size()).ok());
      ASSERT_TRUE(d_keys.Allocate(keys.size() * 2).ok());
      ASSERT_TRUE(d_table.Allocate(table.size() * 4).ok());
      ASSERT_TRUE(d_start.Allocate(8).ok());
      const int64_t start = 0;
      CUDA_OK(cudaMemset(pool.get(), 0, want.size()));
      CUDA_OK(cudaMemcpy(d_keys.get(), keys.data(), keys.size() * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_table.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_start.get(), &start, 8, cudaMemcpyHostToDevice));
      kernels::cuda::AppendArgs a;
      a.pool = pool.get();
      a.layer_bytes = static_cast<int64_t>(want.size());
      a.block_table = d_table.get<int32_t>();
      a.layer_start = d_start.get<int64_t>();
      a.num_tokens = kTokens;
      a.keys = d_keys.get<uint16_t>();
      CUDA_OK(kernels::cuda::LaunchAppendKeys(a, st, d, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> got(want.size());
      CUDA_OK(cudaMemcpy(got.data(), pool.get(), got.size(), cudaMemcpyDeviceToHost));
      const auto diff = std::mismatch(got.begin(), got.end(), want.begin());
      ASSERT_TRUE(diff.first == got.end())
          << "byte " << (diff.first - got.begin()) << ": got " << int{*diff.first} << ", want "
          << int{*diff.second};
    }
  }
}

// A short, fixed set run under compute-sanitizer (memcheck and racecheck) by scripts/gpu_check.sh.
TEST_F(GpuSelectTest, SanitizerSmall) {
  for (auto [st, warps] : {std::pair{KeyStorage::kBf16, 8}, std::pair{KeyStorage::kFp8E4M3, 8},
                           std::pair{KeyStorage::kFp4E2M1, 2}, std::pair{KeyStorage::kFp4E2M1, 8}}) {
    PoolCase c;
    c.storage = st;
    c.values = Values::kIntegers;
    c.decode_warps = warps;  // fp4: both decode variants (DecodeWarpsSupported)
    // 65600 tokens: two rows of 513 blocks, the decode selector's threshold pass with two warps
    // per row; 40000 tokens with 6 heads: one warp per row; 70000 tokens with one head: one row
    // of 547 blocks padded to 1024.
    for (int64_t len : {1, 130, 700, 65600, 40000, 70000}) {
      SpanCase s;
      s.length = len;
      s.num_heads = len == 40000 ? 6 : (len == 70000 ? 1 : 2);
      s.attn = true;
      c.spans.push_back(s);
    }
    SpanCase p;
    p.length = 400;
    p.num_tokens = 40;
    p.num_heads = 2;
    p.attn = true;
    c.spans.push_back(p);
    Run(c, Path::kAuto, 1);
    if (HasFatalFailure()) return;
  }
}

// The copy kernels of a step (kernels/cuda/step_copy.h): every byte of odd sizes (a tail shorter
// than a 16-byte word, more words than one pass of the grid covers) from mapped pinned memory to
// the device and back, nothing past the end touched; misaligned pointers refused.
TEST_F(GpuSelectTest, StepCopiesMoveEveryByteAndNoMore) {
  constexpr size_t kSlack = 64;
  for (int64_t bytes : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{4099},
                        int64_t{300001}, int64_t{2500007}}) {
    SCOPED_TRACE("bytes " + std::to_string(bytes));
    const size_t n = static_cast<size_t>(bytes);
    engine::PinnedBuffer src, dst;
    engine::DeviceBuffer dev;
    ASSERT_TRUE(src.Allocate(n + kSlack).ok());
    ASSERT_TRUE(dst.Allocate(n + kSlack).ok());
    ASSERT_TRUE(dev.Allocate(n + kSlack).ok());
    unsigned char* s = src.get<unsigned char>();
    for (size_t i = 0; i < n + kSlack; ++i) s[i] = static_cast<unsigned char>(rng_());
    std::memset(dst.get(), 0xa5, n + kSlack);
    CUDA_OK(cudaMemset(dev.get(), 0x5a, n + kSlack));
    kernels::cuda::LaunchList launches;
    CUDA_OK(kernels::cuda::DescribeStepCopy(src.get(), dev.get(), bytes, &launches));
    CUDA_OK(kernels::cuda::DescribeStepCopy(dev.get(), dst.get(), bytes, &launches));
    ASSERT_EQ(launches.size, 2);
    CUDA_OK(launches.Enqueue(nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(std::memcmp(src.get(), dst.get(), n), 0);
    const unsigned char* d = dst.get<unsigned char>();
    for (size_t i = n; i < n + kSlack; ++i) ASSERT_EQ(d[i], 0xa5) << "byte " << i;
    std::vector<unsigned char> tail(kSlack);
    CUDA_OK(cudaMemcpy(tail.data(), dev.get<char>() + n, kSlack, cudaMemcpyDeviceToHost));
    for (unsigned char b : tail) ASSERT_EQ(b, 0x5a);
  }
  engine::DeviceBuffer a, b;
  ASSERT_TRUE(a.Allocate(64).ok());
  ASSERT_TRUE(b.Allocate(64).ok());
  kernels::cuda::LaunchList launches;
  using kernels::cuda::DescribeStepCopy;
  EXPECT_EQ(DescribeStepCopy(a.get<char>() + 8, b.get(), 16, &launches), cudaErrorInvalidValue);
  EXPECT_EQ(DescribeStepCopy(a.get(), b.get<char>() + 4, 16, &launches), cudaErrorInvalidValue);
  EXPECT_EQ(DescribeStepCopy(a.get(), b.get(), -1, &launches), cudaErrorInvalidValue);
  EXPECT_EQ(DescribeStepCopy(a.get(), b.get(), 0, &launches), cudaSuccess);
  EXPECT_EQ(launches.size, 0);
}

}  // namespace
}  // namespace indexer::testing
