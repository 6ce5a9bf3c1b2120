// The workload model (client/bench/workload.h) and the correctness checker (checker.h).
#include "client/bench/workload.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>

#include "client/bench/checker.h"
#include "client/bench/runner.h"
#include "kernels/cpu_reference.h"
#include "kernels/numeric.h"

namespace indexer::bench {
namespace {

TEST(LengthDistributionTest, ParsesEveryForm) {
  EXPECT_EQ(LengthDistribution::Parse("8192")->ForSequence(1, 5), 8192);
  EXPECT_EQ(LengthDistribution::Parse("fixed:100")->ToString(), "fixed:100");
  absl::StatusOr<LengthDistribution> u = LengthDistribution::Parse("uniform:10-20");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->ToString(), "uniform:10-20");
  std::vector<int> seen(21, 0);
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = u->ForSequence(3, i);
    ASSERT_GE(v, 10);
    ASSERT_LE(v, 20);
    ++seen[v];
  }
  for (int v = 10; v <= 20; ++v) EXPECT_GT(seen[v], 100) << v;
  EXPECT_DOUBLE_EQ(u->Mean(), 15);

  absl::StatusOr<LengthDistribution> ln =
      LengthDistribution::Parse("lognormal:median=4096,sigma=0.5,min=128,max=32768");
  ASSERT_TRUE(ln.ok()) << ln.status();
  std::vector<int64_t> v;
  for (int i = 0; i < 4001; ++i) v.push_back(ln->ForSequence(9, i));
  std::sort(v.begin(), v.end());
  EXPECT_NEAR(static_cast<double>(v[2000]), 4096, 300);  // the median
  EXPECT_GE(v.front(), 128);
  EXPECT_LE(v.back(), 32768);
  EXPECT_EQ(ln->Min(), 128);
  EXPECT_EQ(ln->Max(), 32768);

  const std::string path = ::testing::TempDir() + "/lengths.txt";
  {
    std::ofstream out(path);
    out << "# a trace\n100\n\n200  # second\n300\n";
  }
  absl::StatusOr<LengthDistribution> f = LengthDistribution::Parse("file:" + path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->ForSequence(1, 0), 100);
  EXPECT_EQ(f->ForSequence(1, 1), 200);
  EXPECT_EQ(f->ForSequence(1, 2), 300);
  EXPECT_EQ(f->ForSequence(1, 3), 100);  // replayed in order, wrapping
  EXPECT_DOUBLE_EQ(f->Mean(), 200);
  std::remove(path.c_str());
}

TEST(LengthDistributionTest, RefusesMalformedText) {
  for (const char* bad : {"", "x", "-5", "uniform:5", "uniform:9-3", "lognormal:median=0,sigma=1",
                          "lognormal:sigma=1", "lognormal:median=5,sigma=1,bogus=2", "gauss:1",
                          "file:/nonexistent/lengths"}) {
    EXPECT_FALSE(LengthDistribution::Parse(bad).ok()) << bad;
  }
}

TEST(LengthDistributionTest, DeterministicPerSeedAndIndex) {
  absl::StatusOr<LengthDistribution> u = LengthDistribution::Parse("uniform:0-1000000");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->ForSequence(1, 7), u->ForSequence(1, 7));
  int differ = 0;
  for (int i = 0; i < 20; ++i) differ += u->ForSequence(1, i) != u->ForSequence(2, i);
  EXPECT_GT(differ, 15);
}

TEST(WorkloadTest, PlansAndValidation) {
  WorkloadSpec spec;
  spec.prefill = *LengthDistribution::Parse("uniform:100-200");
  spec.decode_steps = LengthDistribution::Fixed(5);
  spec.id_prefix = "t-";
  const SequencePlan p = PlanSequence(spec, 12);
  EXPECT_EQ(p.id, "t-12");
  EXPECT_GE(p.prefill_tokens, 100);
  EXPECT_LE(p.prefill_tokens, 200);
  EXPECT_EQ(p.decode_steps, 5);

  ServerShape shape;
  shape.layers = 3;
  shape.max_heads = 8;
  shape.max_topk = 64;
  shape.max_tokens_per_sequence = 1000;
  WorkloadSpec ok = spec;
  ASSERT_TRUE(Validate(&ok, shape).ok());
  EXPECT_EQ(ok.layers, 3);  // 0 = all of the server's
  WorkloadSpec bad = spec;
  bad.heads = 9;
  EXPECT_EQ(Validate(&bad, shape).code(), absl::StatusCode::kInvalidArgument);
  bad = spec;
  bad.layers = 4;
  EXPECT_FALSE(Validate(&bad, shape).ok());
  bad = spec;
  bad.decode_steps = LengthDistribution::Fixed(0);
  EXPECT_FALSE(Validate(&bad, shape).ok());
  bad = spec;
  bad.decode_steps = LengthDistribution::Fixed(900);  // 200 + 900 > 1000 tokens
  EXPECT_FALSE(Validate(&bad, shape).ok());
  bad.rewind = -1;
  EXPECT_FALSE(Validate(&bad, shape).ok());
}

TEST(WorkloadTest, RewindBoundsTheLongestSequence) {
  WorkloadSpec spec;
  spec.prefill = *LengthDistribution::Parse("uniform:100-200");
  spec.decode_steps = LengthDistribution::Fixed(900);
  EXPECT_EQ(LongestSequence(spec), 200 + 900);
  spec.speculative = 2;
  EXPECT_EQ(LongestSequence(spec), 200 + 900 * 2);
  spec.rewind = 64;  // back to the prefill every 64 steps: at most 64 steps' tokens on top
  EXPECT_EQ(LongestSequence(spec), 200 + 64 * 2);
  spec.rewind = 5000;  // released (after 900 steps) before the first rewind
  EXPECT_EQ(LongestSequence(spec), 200 + 900 * 2);

  ServerShape shape;
  shape.max_tokens_per_sequence = 1000;
  spec.decode_steps = LengthDistribution::Fixed(1000000000);
  spec.rewind = 0;
  EXPECT_FALSE(Validate(&spec, shape).ok());
  spec.rewind = 128;
  EXPECT_TRUE(Validate(&spec, shape).ok()) << Validate(&spec, shape);
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// The stage's first sequences start part-way through their steps, uniformly, so that they do not
// all end (and get prefilled again) at one step; later sequences, and --nostagger, start at 0.
TEST(WorkloadTest, FirstSequencesAreStaggered) {
  WorkloadSpec spec;
  spec.decode_steps = LengthDistribution::Fixed(100);
  std::vector<int> seen(100, 0);
  for (int64_t i = 0; i < 4000; ++i) {
    const SequencePlan p = PlanSequence(spec, i, /*staggered=*/true);
    ASSERT_GE(p.start_step, 0);
    ASSERT_LT(p.start_step, 100);
    ++seen[static_cast<size_t>(p.start_step / 10) * 10];
    EXPECT_EQ(PlanSequence(spec, i, true).start_step, p.start_step);  // deterministic
    EXPECT_EQ(PlanSequence(spec, i, false).start_step, 0);
  }
  for (int d = 0; d < 100; d += 10) EXPECT_NEAR(seen[static_cast<size_t>(d)], 400, 90) << d;
  spec.stagger = false;
  EXPECT_EQ(PlanSequence(spec, 7, true).start_step, 0);
}

TEST(WorkloadTest, ReadsTraces) {
  const std::string path = WriteTemp(
      "trace.txt", "# at prefill steps\n0 1000 5\n0.0,200,1\n\n 0.25\t3000 40  # late\n1.5 0 2\n");
  absl::StatusOr<std::vector<TraceEntry>> trace = ReadTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 4u);
  EXPECT_DOUBLE_EQ((*trace)[2].at_s, 0.25);
  EXPECT_EQ((*trace)[2].prefill, 3000);
  EXPECT_EQ((*trace)[2].decode_steps, 40);
  EXPECT_EQ((*trace)[3].prefill, 0);

  WorkloadSpec spec;
  spec.trace = std::make_shared<const std::vector<TraceEntry>>(*trace);
  const SequencePlan p = PlanSequence(spec, 2, /*staggered=*/true);
  EXPECT_EQ(p.prefill_tokens, 3000);
  EXPECT_EQ(p.decode_steps, 40);
  EXPECT_EQ(p.start_step, 0);  // a trace's lengths are its own: no stagger
  EXPECT_DOUBLE_EQ(p.arrival_s, 0.25);
  EXPECT_EQ(LongestSequence(spec), 3040);
  spec.rewind = 8;
  EXPECT_EQ(LongestSequence(spec), 3008);

  for (const char* bad : {"0 100\n", "x 100 2\n", "0 100 0\n", "-1 100 2\n", "1 100 2\n0.5 1 1\n",
                          "# nothing\n"}) {
    absl::StatusOr<std::vector<TraceEntry>> t = ReadTrace(WriteTemp("bad-trace.txt", bad));
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(t.status().message().find("bad-trace.txt"), std::string::npos) << t.status();
  }
  EXPECT_FALSE(ReadTrace("/no/such/trace").ok());
}

TEST(WorkloadTest, StreamInflightNeedsStreamsAndSequences) {
  ServerShape shape;
  WorkloadSpec spec;
  spec.style = CallStyle::kStream;
  spec.stream_inflight = 4;
  spec.batch = 8;
  EXPECT_TRUE(Validate(&spec, shape).ok());
  spec.batch = 3;  // a micro-batch per request in flight
  EXPECT_FALSE(Validate(&spec, shape).ok());
  spec.batch = 8;
  spec.style = CallStyle::kBatch;
  EXPECT_FALSE(Validate(&spec, shape).ok());
  spec.stream_inflight = 0;
  EXPECT_FALSE(Validate(&spec, shape).ok());
}

TEST(WorkloadTest, ValuePoolIsBf16Exact) {
  for (ValueKind kind : {ValueKind::kNormal, ValueKind::kInteger}) {
    const ValuePool pool(kind, 4096, 5);
    std::mt19937_64 rng(1);
    const ValuePool::Slice s = pool.Take(1000, rng);
    ASSERT_EQ(s.n, 1000u);
    for (size_t i = 0; i < s.n; ++i) {
      ASSERT_EQ(kernels::FloatToBf16(s.values[i]), s.bits[i]);
      ASSERT_EQ(kernels::Bf16ToFloat(s.bits[i]), s.values[i]);
      if (kind == ValueKind::kInteger) {
        ASSERT_EQ(s.values[i], std::round(s.values[i]));
        ASSERT_LE(std::fabs(s.values[i]), 4);
      }
    }
    EXPECT_EQ(PackSlice(s, v1::VALUE_DTYPE_BF16).size(), 2000u);
    EXPECT_EQ(PackSlice(s, v1::VALUE_DTYPE_FP32).size(), 4000u);
  }
}

TEST(SweepTest, ParsesValues) {
  EXPECT_EQ(*ParseSweepValues("1,2,4,8"), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(*ParseSweepValues("100..800*2"), (std::vector<double>{100, 200, 400, 800}));
  EXPECT_EQ(ParseSweepValues("100..500*2")->size(), 3u);
  for (const char* bad : {"", "0", "1,-2", "10..5*2", "1..10*1", "1..10", "a,b"}) {
    EXPECT_FALSE(ParseSweepValues(bad).ok()) << bad;
  }
}

// The checker against answers computed by the reference itself, and against wrong ones.
class CheckerTest : public ::testing::Test {
 protected:
  static constexpr int kD = 64;
  static constexpr int kLayers = 2;

  void Fill(HostKeys& keys, int64_t tokens, std::mt19937& rng) {
    std::uniform_int_distribution<int> d(-4, 4);
    std::vector<uint16_t> bits(static_cast<size_t>(tokens) * kLayers * kD);
    for (uint16_t& b : bits) b = kernels::FloatToBf16(static_cast<float>(d(rng)));
    keys.AppendAllLayers(bits.data(), tokens, kLayers);
  }

  // The reference's answer, as the server would send it.
  client::Selection Answer(const HostKeys& keys, int layer, const std::vector<uint16_t>& q, int n,
                           int heads, const CheckParams& p, const std::vector<int32_t>& attn) {
    client::Selection s;
    s.num_tokens = n;
    s.num_heads = heads;
    s.topk = p.select.topk;
    s.start_position = keys.length() - n;
    const int64_t v = kernels::VisibleBlocks(keys.length() - 1);
    std::vector<int32_t> table(v);
    std::iota(table.begin(), table.end(), 0);
    s.block_ids.resize(static_cast<size_t>(n) * heads * p.select.topk);
    kernels::SpanSelect span;
    span.block_table = table.data();
    span.start_pos = s.start_position;
    span.num_tokens = n;
    span.num_heads = heads;
    span.queries = q.data();
    span.params = p.select;
    span.block_ids = s.block_ids.data();
    if (!attn.empty()) {
      s.pages_per_block = p.page_table.pages_per_block;
      s.page_table.resize(s.block_ids.size() * p.page_table.pages_per_block);
      s.context_lens.resize(static_cast<size_t>(n) * heads);
      span.attn_pages = attn.data();
      span.page_table = s.page_table.data();
      span.context_lens = s.context_lens.data();
    }
    kernels::SelectSpan(keys.View(layer), span, p.page_table);
    return s;
  }

  std::mt19937 rng_{77};
};

TEST_F(CheckerTest, AcceptsTheReferenceAndCatchesChanges) {
  for (kernels::KeyStorage storage : {kernels::KeyStorage::kBf16, kernels::KeyStorage::kFp8E4M3,
                                      kernels::KeyStorage::kFp4E2M1}) {
    HostKeys keys(kLayers, kD, storage);
    Fill(keys, 1000, rng_);
    CheckParams p;
    p.select = kernels::SelectParams{4, 1, 1};
    p.page_table = kernels::PageTableParams{4, 8};
    std::vector<int32_t> attn(8);
    std::iota(attn.begin(), attn.end(), 100);
    const int n = 3, heads = 2;
    std::vector<uint16_t> q(static_cast<size_t>(n) * heads * kD);
    std::uniform_int_distribution<int> d(-4, 4);
    for (uint16_t& b : q) b = kernels::FloatToBf16(static_cast<float>(d(rng_)));
    for (int layer = 0; layer < kLayers; ++layer) {
      client::Selection good = Answer(keys, layer, q, n, heads, p, attn);
      CheckOutcome ok = CheckSelection(keys, layer, attn, q.data(), good, p);
      EXPECT_TRUE(ok.mismatch.empty()) << ok.mismatch;
      EXPECT_EQ(ok.rows, n * heads);
      // A swapped block id.
      client::Selection wrong = good;
      std::swap(wrong.block_ids[1], wrong.block_ids[2]);
      EXPECT_FALSE(CheckSelection(keys, layer, attn, q.data(), wrong, p).mismatch.empty());
      // A wrong page-table entry.
      wrong = good;
      wrong.page_table[0] += 1;
      EXPECT_FALSE(CheckSelection(keys, layer, attn, q.data(), wrong, p).mismatch.empty());
      // A wrong start position.
      wrong = good;
      wrong.start_position -= 1;
      EXPECT_FALSE(CheckSelection(keys, layer, attn, q.data(), wrong, p).mismatch.empty());
    }
    // After a truncation the check follows the shorter keys.
    keys.Truncate(700);
    attn.resize(6);
    client::Selection after = Answer(keys, 0, q, n, heads, p, attn);
    EXPECT_TRUE(CheckSelection(keys, 0, attn, q.data(), after, p).mismatch.empty());
  }
}

TEST_F(CheckerTest, ToleranceAcceptsNearTiesOnly) {
  HostKeys keys(1, kD, kernels::KeyStorage::kBf16);
  // Every block's keys are zero except one row per block with value (b + 1): block b's score
  // for an all-ones query is 64 * (b + 1) (blocks 0 and 1 differ by 64 of ~600: ~10%).
  const int blocks = 10;
  std::vector<uint16_t> bits(static_cast<size_t>(blocks) * 128 * kD, kernels::FloatToBf16(0.0f));
  for (int b = 0; b < blocks; ++b) {
    for (int d = 0; d < kD; ++d)
      bits[(static_cast<size_t>(b) * 128) * kD + d] =
          kernels::FloatToBf16(static_cast<float>(b + 1));
  }
  keys.AppendAllLayers(bits.data(), blocks * 128, 1);
  std::vector<uint16_t> q(kD, kernels::FloatToBf16(1.0f));
  CheckParams p;
  p.select = kernels::SelectParams{3, 0, 0};
  p.exact = false;
  p.tolerance = 0.2;  // 20%: block 6 (448) may stand in for block 7 (512), the 3rd best
  client::Selection got = Answer(keys, 0, q, 1, 1, p, {});
  ASSERT_EQ(got.block_ids, (std::vector<int32_t>{9, 8, 7}));
  got.block_ids = {9, 8, 6};
  CheckOutcome near = CheckSelection(keys, 0, {}, q.data(), got, p);
  EXPECT_TRUE(near.mismatch.empty()) << near.mismatch;
  EXPECT_EQ(near.tolerated, 1);
  got.block_ids = {9, 8, 1};  // 128, far below
  EXPECT_FALSE(CheckSelection(keys, 0, {}, q.data(), got, p).mismatch.empty());
  got.block_ids = {9, 9, 8};  // a repeat
  EXPECT_FALSE(CheckSelection(keys, 0, {}, q.data(), got, p).mismatch.empty());
  p.exact = true;
  got.block_ids = {9, 8, 6};
  EXPECT_FALSE(CheckSelection(keys, 0, {}, q.data(), got, p).mismatch.empty());
}

}  // namespace
}  // namespace indexer::bench
