// The engine's building blocks on their own: PagePool, SequenceTable, ThreadPool, DecodeRows,
// EngineConfig.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/config.h"
#include "engine/page_pool.h"
#include "engine/request_validation.h"
#include "engine/sequence_table.h"
#include "engine/thread_pool.h"
#include "engine/wire_values.h"
#include "kernels/numeric.h"
#include "tests/testing/bf16.h"

namespace indexer::engine {
namespace {

// ---------------------------------------------------------------------------------------------
// PagePool

void ExpectRefs(const PagePool& pool, const std::vector<int32_t>& want) {
  for (int32_t p = 0; p < static_cast<int32_t>(want.size()); ++p) {
    EXPECT_EQ(pool.RefCount(p), want[p]) << "page " << p;
  }
}

TEST(LateMessages, LongMessagesAreCutBeforeACharacterNeverInsideOne) {
  const std::string id = "séquence";
  const size_t limit = static_cast<size_t>(LateMessageLimit(id));
  for (const std::string piece : {"a", "é", "日", "\xF0\x9F\x98\x80"}) {
    for (size_t lead = 0; lead < 4; ++lead) {
      std::string message(lead, 'x');
      while (message.size() <= limit + 8) message += piece;
      const absl::Status cut = LimitLateMessage(absl::InternalError(message), id);
      const absl::string_view m = cut.message();
      EXPECT_EQ(cut.code(), absl::StatusCode::kInternal);
      EXPECT_LE(m.size(), limit) << piece << " after " << lead;
      EXPECT_GT(m.size(), limit - 3 - piece.size()) << "cut no further than the character";
      ASSERT_TRUE(absl::EndsWith(m, "..."));
      const absl::string_view kept = m.substr(0, m.size() - 3);
      EXPECT_EQ(message.substr(0, kept.size()), kept);
      EXPECT_EQ((kept.size() - lead) % piece.size(), 0u) << "a character was split: " << piece;
    }
  }
  const absl::Status short_one = absl::NotFoundError("sequence 'é' does not exist");
  EXPECT_EQ(LimitLateMessage(short_one, id), short_one);
}

TEST(PagePool, AllocateIsAllOrNothing) {
  PagePool pool(8);
  EXPECT_EQ(pool.total_pages(), 8);
  EXPECT_EQ(pool.free_pages(), 8);
  ExpectRefs(pool, std::vector<int32_t>(8, 0));

  absl::StatusOr<std::vector<int32_t>> a = pool.Allocate(3);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ(std::set<int32_t>(a->begin(), a->end()).size(), 3u);
  for (int32_t p : *a) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, 8);
    EXPECT_EQ(pool.RefCount(p), 1);
  }
  EXPECT_EQ(pool.free_pages(), 5);

  std::vector<int32_t> before(8);
  for (int32_t p = 0; p < 8; ++p) before[p] = pool.RefCount(p);
  absl::StatusOr<std::vector<int32_t>> too_many = pool.Allocate(6);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.free_pages(), 5);
  ExpectRefs(pool, before);

  absl::StatusOr<std::vector<int32_t>> empty = pool.Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(pool.free_pages(), 5);

  absl::StatusOr<std::vector<int32_t>> rest = pool.Allocate(5);
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(pool.free_pages(), 0);
  std::set<int32_t> all(a->begin(), a->end());
  all.insert(rest->begin(), rest->end());
  EXPECT_EQ(all.size(), 8u);
  EXPECT_EQ(pool.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PagePool, RefCountsAndRelease) {
  PagePool pool(4);
  std::vector<int32_t> a = *pool.Allocate(2);
  pool.AddRef(a);
  for (int32_t p : a) EXPECT_EQ(pool.RefCount(p), 2);
  EXPECT_EQ(pool.Release(a), 0);  // still one reference each
  EXPECT_EQ(pool.free_pages(), 2);
  for (int32_t p : a) EXPECT_EQ(pool.RefCount(p), 1);
  pool.AddRef(std::vector<int32_t>{a[0]});
  // One call may drop two references of one page.
  EXPECT_EQ(pool.Release(std::vector<int32_t>{a[0], a[0], a[1]}), 2);
  EXPECT_EQ(pool.free_pages(), 4);
  EXPECT_EQ(pool.RefCount(a[0]), 0);
  EXPECT_EQ(pool.RefCount(a[1]), 0);
  // Released pages are handed out again.
  std::vector<int32_t> b = *pool.Allocate(4);
  EXPECT_EQ(std::set<int32_t>(b.begin(), b.end()), (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(PagePool, RandomOperationsMatchAModel) {
  std::mt19937_64 rng(31337);
  const int kPages = 40;
  PagePool pool(kPages);
  std::vector<int32_t> refs(kPages, 0);
  for (int op = 0; op < 20000; ++op) {
    const int kind = static_cast<int>(rng() % 3);
    const int64_t free_now = std::count(refs.begin(), refs.end(), 0);
    if (kind == 0) {
      const int64_t n = static_cast<int64_t>(rng() % 8);
      absl::StatusOr<std::vector<int32_t>> got = pool.Allocate(n);
      if (n > free_now) {
        ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
      } else {
        ASSERT_TRUE(got.ok());
        ASSERT_EQ(static_cast<int64_t>(got->size()), n);
        for (int32_t p : *got) {
          ASSERT_EQ(refs[p], 0) << "allocated a page in use";
          refs[p] = 1;
        }
      }
    } else {
      std::vector<int32_t> used;
      for (int32_t p = 0; p < kPages; ++p) {
        if (refs[p] > 0 && rng() % 3 == 0) used.push_back(p);
      }
      if (kind == 1) {
        pool.AddRef(used);
        for (int32_t p : used) ++refs[p];
      } else {
        int64_t freed = 0;
        for (int32_t p : used) freed += --refs[p] == 0;
        ASSERT_EQ(pool.Release(used), freed);
      }
    }
    ASSERT_EQ(pool.free_pages(), std::count(refs.begin(), refs.end(), 0)) << "op " << op;
    if (op % 97 == 0) {
      for (int32_t p = 0; p < kPages; ++p) ASSERT_EQ(pool.RefCount(p), refs[p]);
    }
  }
}

TEST(PagePool, ConcurrentAllocateAndReleaseKeepExactCounts) {
  PagePool pool(64);
  std::vector<std::thread> threads;
  std::atomic<int> exhausted{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 5000; ++i) {
        absl::StatusOr<std::vector<int32_t>> got = pool.Allocate(1 + rng() % 20);
        if (!got.ok()) {
          ++exhausted;
          continue;
        }
        pool.AddRef(*got);
        pool.Release(*got);
        pool.Release(*got);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool.free_pages(), 64);
  for (int32_t p = 0; p < 64; ++p) EXPECT_EQ(pool.RefCount(p), 0);
}

// ---------------------------------------------------------------------------------------------
// SequenceTable

// Ids short enough for a string's inline buffer and long enough for the heap, one with a NUL.
std::string TableId(int i) {
  if (i % 3 == 0) return absl::StrCat("s", i);
  if (i % 3 == 1) return absl::StrCat("a-sequence-id-long-enough-for-the-heap-", i);
  return absl::StrCat(std::string("nul\0", 4), i);
}

TEST(SequenceTable, FindAllAnswersWhatFindAnswersInOrder) {
  SequenceTable table;
  for (int i = 0; i < 150; i += 2) {
    bool created = false;
    ASSERT_NE(nullptr, table.FindOrCreate("t1", TableId(i), 1, &created));
    ASSERT_TRUE(created);
  }
  ASSERT_EQ(SequenceTable::InsertResult::kInserted,
            table.Insert(std::make_shared<Sequence>("t2", TableId(1), 1)));
  // Present and absent ids, another tenant's, repeats: more names than one group holds.
  std::vector<SequenceTable::Name> names;
  std::vector<std::string> ids;
  for (int i = 0; i < 150; ++i) ids.push_back(TableId(i));
  for (int i = 0; i < 150; ++i) names.push_back({"t1", ids[i]});
  for (int i = 0; i < 10; ++i) names.push_back({"t2", ids[i]});
  for (int i = 0; i < 10; ++i) names.push_back({"t1", ids[(i * 7) % 150]});
  names.push_back({"", ids[0]});
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, names.size()}) {
    std::vector<std::shared_ptr<Sequence>> found;
    std::vector<size_t> order;
    table.FindAll(
        n, [&](size_t i) { return names[i]; },
        [&](size_t i, std::shared_ptr<Sequence> seq) {
          order.push_back(i);
          found.push_back(std::move(seq));
        });
    ASSERT_EQ(n, found.size());
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(i, order[i]);
      EXPECT_EQ(table.Find(names[i].tenant, names[i].id), found[i]) << i;
    }
  }
  int hits = 0;
  table.FindAll(
      names.size(), [&](size_t i) { return names[i]; },
      [&](size_t, std::shared_ptr<Sequence> seq) { hits += seq != nullptr; });
  EXPECT_EQ(75 + 1 + 5, hits);  // t1's even ids, t2's one, the even ones among the repeats
}

TEST(SequenceTable, FindAllBesideInsertsAndErasesFindsOnlyWhatItNames) {
  SequenceTable table;
  std::vector<std::string> ids;
  for (int i = 0; i < 64; ++i) ids.push_back(TableId(i));
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    for (int round = 0; !stop.load(); ++round) {
      const std::string& id = ids[round % 64];
      if (round % 2 == 0) {
        bool created = false;
        table.FindOrCreate("t", id, 1, &created);
      } else {
        table.Erase("t", ids[(round * 5) % 64]);
      }
    }
  });
  for (int round = 0; round < 2000; ++round) {
    table.FindAll(
        ids.size(), [&](size_t i) { return SequenceTable::Name{"t", ids[i]}; },
        [&](size_t i, std::shared_ptr<Sequence> seq) {
          if (seq != nullptr) {
            EXPECT_EQ(ids[i], seq->id);
          }
        });
  }
  stop = true;
  churn.join();
}

// ---------------------------------------------------------------------------------------------
// ThreadPool

void ExpectEachIndexOnce(ThreadPool& pool, int64_t n) {
  std::vector<std::atomic<int>> hits(n);
  pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
}

TEST(ThreadPool, ParallelForCoversEveryIndexExactlyOnce) {
  for (int threads : {0, 1, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 3, 7, 64, 1000, 100000}) {
      SCOPED_TRACE(::testing::Message() << threads << " threads, n " << n);
      ExpectEachIndexOnce(pool, n);
    }
  }
}

TEST(ThreadPool, ReturnsOnlyAfterEveryBodyHasFinished) {
  ThreadPool pool(3);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> finished{0};
    pool.ParallelFor(16, [&](int64_t i) {
      if (i % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      finished.fetch_add(1);
    });
    ASSERT_EQ(finished.load(), 16) << "round " << round;
  }
}

TEST(ThreadPool, NestedLoopsFinish) {
  ThreadPool pool(2);
  const int kOuter = 12, kInner = 500;
  std::vector<std::atomic<int>> hits(kOuter * kInner);
  pool.ParallelFor(kOuter, [&](int64_t o) {
    pool.ParallelFor(kInner, [&](int64_t i) { hits[o * kInner + i].fetch_add(1); });
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPool, ConcurrentLoopsFromManyThreadsFinish) {
  ThreadPool pool(2);
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int t = 0; t < 6; ++t) {
    callers.emplace_back([&] {
      for (int round = 0; round < 30; ++round) {
        std::vector<std::atomic<int>> hits(777);
        pool.ParallelFor(777, [&](int64_t i) { hits[i].fetch_add(1); });
        for (auto& h : hits) {
          if (h.load() != 1) ADD_FAILURE() << "an index ran " << h.load() << " times";
        }
        total.fetch_add(777);
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(total.load(), 6 * 30 * 777);
}

TEST(ThreadPool, DestructionAfterManyShortLoops) {
  for (int i = 0; i < 50; ++i) {
    ThreadPool pool(3);
    ExpectEachIndexOnce(pool, 5);
  }
}

// ---------------------------------------------------------------------------------------------
// DecodeRows

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DecodeRows, Bf16RowsArePassedThrough) {
  const std::vector<uint16_t> in = {0x3f80, 0xc000, 0x8000, 0x7f7f, 0x0001, 0x4040};
  const std::string bytes = testing::Bytes(in);
  std::vector<uint16_t> out;
  int64_t rows = -1;
  ASSERT_TRUE(DecodeRows(bytes, WireDtype::kBf16, 3, "keys", &out, &rows).ok());
  EXPECT_EQ(rows, 2);
  EXPECT_EQ(out, in);
}

// The summary the check leaves for backends, against magnitudes compared as floats.
TEST(DecodeRows, TheViewSumsUpTheValuesItChecked) {
  const float f16_min_normal = 0x1p-14f, f16_max = 65504.0f;
  const auto expect_summary = [&](const std::vector<uint16_t>& values, WireDtype dtype,
                                  const std::string& bytes) {
    Bf16Rows rows;
    ASSERT_TRUE(DecodeRowsView(bytes, dtype, 1, "queries", &rows).ok());
    float max_abs = 0.0f;
    bool fits = true;
    for (uint16_t v : values) {
      const float a = std::fabs(kernels::Bf16ToFloat(v));
      max_abs = std::max(max_abs, a);
      fits = fits && (a == 0.0f || (a >= f16_min_normal && a <= f16_max));
    }
    EXPECT_TRUE(rows.summary.known);
    EXPECT_EQ(max_abs, kernels::Bf16ToFloat(rows.summary.max_magnitude));
    EXPECT_EQ(fits, rows.summary.fits_f16);
  };
  // Edges: zeros of both signs, bf16 subnormals, f16's normal range's ends and just past them.
  const std::vector<std::vector<uint16_t>> cases = {
      {0x0000},         {0x8000, 0x0000}, {0x0001},         {0x3880, 0xb880},
      {0x387f},         {0x477f, 0xc77f}, {0x4780},         {0x3f80, 0x8001},
      {0x7f7f, 0x3f80}, {0xff7f},         {0x4000, 0xc040, 0x3f00},
  };
  for (const std::vector<uint16_t>& c : cases) expect_summary(c, WireDtype::kBf16, testing::Bytes(c));
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint16_t> values(1 + rng() % 300);
    const int exponent_spread = 1 + static_cast<int>(rng() % 254);
    for (uint16_t& v : values) {
      const uint32_t exponent = 127 - exponent_spread / 2 + rng() % exponent_spread;
      v = static_cast<uint16_t>(((rng() & 1) << 15) | (std::min<uint32_t>(exponent, 254) << 7) |
                                (rng() & 0x7f));
    }
    expect_summary(values, WireDtype::kBf16, testing::Bytes(values));
    // fp32 on the wire: the summary is of the rounded values.
    std::string fp32(values.size() * 4, '\0');
    for (size_t i = 0; i < values.size(); ++i) {
      const float f = kernels::Bf16ToFloat(values[i]);
      std::memcpy(fp32.data() + i * 4, &f, 4);
    }
    expect_summary(values, WireDtype::kFp32, fp32);
  }
  Bf16Rows refused;
  EXPECT_FALSE(DecodeRowsView(testing::Bytes(std::vector<uint16_t>{0x3f80, 0x7f80}), WireDtype::kBf16, 1, "q", &refused).ok());
  EXPECT_FALSE(refused.summary.known);
}

TEST(DecodeRows, Fp32RoundsToBf16TiesToEven) {
  // 1 + 2^-8 -> 1.0 (tie, even); 1 + 3 * 2^-8 -> 0x3f82 (tie, even); -2.5 exact; 1 + 2^-7 + tiny
  // -> 0x3f81 (nearest); the largest fp32 below the bf16 overflow tie stays finite (0x7f7f).
  const std::vector<float> in = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f,
                                 1.0f + 0x1p-7f + 0x1p-20f, FromBits(0x7f7f7fffu), -0.0f};
  const std::string bytes = testing::Bytes(in);
  std::vector<uint16_t> out;
  int64_t rows = -1;
  ASSERT_TRUE(DecodeRows(bytes, WireDtype::kFp32, 2, "queries", &out, &rows).ok());
  EXPECT_EQ(rows, 3);
  EXPECT_EQ(out, (std::vector<uint16_t>{0x3f80, 0x3f82, 0xc020, 0x3f81, 0x7f7f, 0x8000}));
}

void ExpectInvalid(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(needle), std::string::npos)
      << "message '" << s.message() << "' does not contain '" << needle << "'";
}

TEST(DecodeRows, RefusesBadDtypesAndSizesNamingTheField) {
  std::vector<uint16_t> out;
  int64_t rows = 0;
  const std::string six_bf16 = testing::Bytes(std::vector<uint16_t>(6, 0x3f80));
  ExpectInvalid(DecodeRows(six_bf16, WireDtype::kUnspecified, 3, "my_keys", &out, &rows), "my_keys");
  ExpectInvalid(DecodeRows("", WireDtype::kBf16, 3, "my_keys", &out, &rows), "my_keys");
  // 6 bf16 values are not whole rows of 4.
  ExpectInvalid(DecodeRows(six_bf16, WireDtype::kBf16, 4, "my_keys", &out, &rows), "my_keys");
  // An odd number of bytes.
  ExpectInvalid(DecodeRows(six_bf16.substr(0, 11), WireDtype::kBf16, 1, "my_keys", &out, &rows),
                "my_keys");
  // fp32: 12 bytes are 3 values, not whole rows of 2; 14 bytes are not whole values.
  const std::string fp32 = testing::Bytes(std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});
  ExpectInvalid(DecodeRows(fp32.substr(0, 12), WireDtype::kFp32, 2, "my_q", &out, &rows), "my_q");
  ExpectInvalid(DecodeRows(fp32.substr(0, 14), WireDtype::kFp32, 1, "my_q", &out, &rows), "my_q");
  // The same 12 bytes read as bf16 are 6 values: 2 rows of 3.
  ASSERT_TRUE(DecodeRows(fp32.substr(0, 12), WireDtype::kBf16, 3, "my_q", &out, &rows).ok());
  EXPECT_EQ(rows, 2);
}

TEST(DecodeRows, RefusesNonFiniteValuesNamingFieldAndPosition) {
  std::vector<uint16_t> out;
  int64_t rows = 0;
  for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0xffc1}}) {
    std::vector<uint16_t> in(8, 0x3f80);
    in[6] = bad;  // row 1, column 2 of rows of 4
    ExpectInvalid(DecodeRows(testing::Bytes(in), WireDtype::kBf16, 4, "keys", &out, &rows), "keys[1][2]");
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), FLT_MAX, -3.4e38f,
                    FromBits(0x7f7f8000u)}) {
    std::vector<float> in(8, 1.0f);
    in[5] = bad;  // row 1, column 1 of rows of 4
    ExpectInvalid(DecodeRows(testing::Bytes(in), WireDtype::kFp32, 4, "queries", &out, &rows),
                  "queries[1][1]");
  }
}

// ---------------------------------------------------------------------------------------------
// EngineConfig

TEST(EngineConfig, ValidateNamesTheSettingOutOfRange) {
  EngineConfig ok;
  EXPECT_TRUE(ok.Validate().ok()) << ok.Validate();
  EngineConfig c = ok;
  c.head_dim = 96;
  ExpectInvalid(c.Validate(), "head_dim");
  c = ok;
  c.layers = 0;
  ExpectInvalid(c.Validate(), "layers");
  c = ok;
  c.defaults.topk = c.max_topk + 1;
  ExpectInvalid(c.Validate(), "topk");
  c = ok;
  c.page_table.block_page_stride = c.page_table.pages_per_block - 1;
  ExpectInvalid(c.Validate(), "block_page_stride");
  c = ok;
  c.capacity_pages = 0;
  ExpectInvalid(c.Validate(), "capacity_pages");
  EXPECT_EQ(ok.BytesPerPage(), 128 * 128 * 2);
  c = ok;
  c.key_storage = kernels::KeyStorage::kFp8E4M3;
  c.layers = 3;
  EXPECT_EQ(c.BytesPerPage(), 128 * 128 * 1 * 3);
  // fp4: 64 code bytes and 8 scale bytes per 128-dim key.
  c.key_storage = kernels::KeyStorage::kFp4E2M1;
  EXPECT_EQ(c.BytesPerPage(), 128 * 72 * 3);
  c.head_dim = 64;
  EXPECT_EQ(c.BytesPerPage(), 128 * 36 * 3);
}

}  // namespace
}  // namespace indexer::engine
