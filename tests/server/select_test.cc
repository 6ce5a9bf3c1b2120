// SelectBlocks end to end: results equal kernels::SelectSpan on a host copy of the keys (exact:
// integer keys and queries), with page tables, start positions, an embedded append, and every
// refusal.
#include <limits>

#include "absl/strings/str_cat.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class SelectTest : public ServerTest {};

TEST_F(SelectTest, MatchesTheReferenceAcrossSpansAndParameters) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 1000));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 1, 700));
  struct Case {
    int layer, heads, tokens;
    int64_t start;  // -1: default
    int topk, init, local;  // -1: default
  };
  const Case cases[] = {
      {0, 1, 1, -1, -1, -1, -1},     // decode step, server defaults
      {0, 4, 1, -1, 16, 2, 1},       // topk > V: -1 padding
      {0, 2, 37, 0, 3, 0, 1},        // prefill span from 0
      {0, 3, 20, 500, 5, 1, 2},      // span from the middle, init and local
      {0, 4, 4, -1, 1, 0, 0},        // speculative span ending at the last token, topk 1
      {0, 2, 3, 125, 32, 0, 0},      // across a block boundary, no forced blocks
      {0, 1, 2, 998, 4, 100, 1},     // init covers everything; local overrides it
      {0, 2, 1, 640, 6, 0, 100},     // local covers everything
      {1, 2, 5, -1, 8, 1, 1},        // the other layer, shorter
      {1, 4, 64, 600, 7, 0, 1},
  };
  for (const Case& c : cases) {
    const std::string where = absl::StrCat("layer ", c.layer, " H ", c.heads, " n ", c.tokens,
                                           " start ", c.start, " topk ", c.topk, " init ", c.init,
                                           " local ", c.local);
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect("a", c.layer, c.heads, c.tokens, &q);
    kernels::SelectParams p = DefaultParams();
    if (c.topk >= 0) req.set_topk(p.topk = c.topk);
    if (c.init >= 0) req.set_init_blocks(p.init_blocks = c.init);
    if (c.local >= 0) req.set_local_blocks(p.local_blocks = c.local);
    const int64_t len = Host("a").length(c.layer);
    const int64_t p0 = c.start >= 0 ? c.start : len - c.tokens;
    if (c.start >= 0) req.set_start_position(c.start);
    absl::StatusOr<v1::SelectBlocksResponse> raw = client_->SelectBlocks(req);
    ASSERT_TRUE(raw.ok()) << where << ": " << raw.status();
    EXPECT_EQ(std::vector<uint32_t>(raw->lengths().begin(), raw->lengths().end()),
              (std::vector<uint32_t>{1000, 700}));
    EXPECT_TRUE(raw->page_table().empty());
    EXPECT_TRUE(raw->context_lens().empty());
    absl::StatusOr<Selection> got = client::ParseSelection(*raw);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameSelection(*got, Host("a").Select(c.layer, q, c.heads, p0, p, PageTable()), where);
  }
}

TEST_F(SelectTest, ExplicitStartPositionAtTheLastTokenEqualsTheDefault) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 257));
  std::vector<float> q;
  v1::SelectBlocksRequest req = RandomSelect("a", 0, 2, 2, &q);
  absl::StatusOr<Selection> by_default = client_->Select(req);
  req.set_start_position(255);
  absl::StatusOr<Selection> explicit_start = client_->Select(req);
  ASSERT_TRUE(by_default.ok() && explicit_start.ok());
  EXPECT_EQ(by_default->start_position, 255);
  ExpectSameSelection(*by_default, *explicit_start, "default vs explicit start_position");
}

TEST_F(SelectTest, PageTablesAndContextLengthsMatchTheReference) {
  // Attention page ids unrelated to cache pages or block numbers.
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 300, {900, 17, 3}));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 400, {5000, 8, 12345}));  // 700: blocks 3..5
  for (const int topk : {1, 3, 6, 12}) {
    for (const int layer : {0, 1}) {
      std::vector<float> q;
      v1::SelectBlocksRequest req = RandomSelect("a", layer, 3, 140, &q);
      req.set_topk(topk);
      req.set_init_blocks(1);
      req.set_start_position(500);  // crosses block 4 -> 5
      absl::StatusOr<Selection> got = client_->Select(req);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(got->has_page_table());
      EXPECT_EQ(got->pages_per_block, PageTable().pages_per_block);
      ExpectSameSelection(*got, Host("a").Select(layer, q, 3, 500, Params(topk, 1, 1), PageTable()),
                          absl::StrCat("topk ", topk, " layer ", layer));
    }
  }
}

// The worked example of SPEC.md, with the server configured as it says.
class WorkedExampleTest : public ServerTest {
 protected:
  WorkedExampleTest() { options_.engine.page_table = kernels::PageTableParams{2, 2}; }
};

TEST_F(WorkedExampleTest, SpecWorkedExample) {
  // Raw scores b0..b4 = [0.5, 2.0, -3.0, 2.0, 7.0] at p = 600: q = e0 and every key of block b
  // has k[0] = score_b.
  const float scores[] = {0.5f, 2.0f, -3.0f, 2.0f, 7.0f};
  std::vector<float> keys(601 * head_dim(), 0.0f);
  for (int t = 0; t <= 600; ++t) keys[t * head_dim()] = scores[t / 128];
  v1::AppendKeysRequest append = client::MakeAppend("ex", 0, keys);
  for (int32_t a : {10, 11, 12, 13, 14}) append.add_attention_pages(a);
  ASSERT_TRUE(client_->AppendKeys(append).ok());
  std::vector<float> q(head_dim(), 0.0f);
  q[0] = 1.0f;
  v1::SelectBlocksRequest req = client::MakeSelect("ex", 0, 1, q);
  req.set_topk(3);
  req.set_init_blocks(1);
  req.set_local_blocks(1);
  absl::StatusOr<Selection> got = client_->Select(req);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->start_position, 600);
  EXPECT_EQ(got->block_ids, (std::vector<int32_t>{0, 4, 1}));
  EXPECT_EQ(got->page_table, (std::vector<int32_t>{20, 21, 22, 23, 28, 29}));
  EXPECT_EQ(got->context_lens, (std::vector<int32_t>{345}));
}

TEST_F(SelectTest, EmbeddedAppendMakesADecodeStep) {
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 255));
  for (int step = 0; step < 3; ++step) {  // 255 -> 258 crosses into block 2
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect("a", 1, 2, 1, &q);
    const std::vector<float> key = IntValues(rng_, layers() * head_dim());
    *req.mutable_append() = client::MakeAppendAllLayers("", key);
    absl::StatusOr<Selection> got = client_->Select(req);
    ASSERT_TRUE(got.ok()) << got.status();
    Host("a").AppendAllLayers(key);
    const int64_t len = 256 + step;
    EXPECT_EQ(got->lengths, (std::vector<uint32_t>{static_cast<uint32_t>(len), static_cast<uint32_t>(len)}));
    ExpectSameSelection(*got, Host("a").Select(1, q, 2, len - 1, DefaultParams(), PageTable()),
                        absl::StrCat("step ", step));
  }
  // The append may name the same sequence, and may create it.
  std::vector<float> q;
  v1::SelectBlocksRequest req = RandomSelect("new", 0, 1, 1, &q);
  const std::vector<float> key = IntValues(rng_, head_dim());
  *req.mutable_append() = client::MakeAppend("new", 0, key);
  absl::StatusOr<Selection> got = client_->Select(req);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->block_ids[0], 0);
  EXPECT_EQ(got->lengths, (std::vector<uint32_t>{1, 0}));
}

TEST_F(SelectTest, InvalidSelectionAppliesNoEmbeddedAppend) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 100));
  std::vector<float> q;
  struct Case {
    std::string name;
    absl::StatusCode code;
    std::function<void(v1::SelectBlocksRequest*)> edit;
  };
  const Case cases[] = {
      {"topk 0", absl::StatusCode::kInvalidArgument, [](auto* r) { r->set_topk(0); }},
      {"span past the length", absl::StatusCode::kFailedPrecondition,
       [](auto* r) { r->set_start_position(101); }},
      {"append to another sequence", absl::StatusCode::kInvalidArgument,
       [](auto* r) { r->mutable_append()->set_sequence_id("b"); }},
      {"bad append", absl::StatusCode::kInvalidArgument,
       [](auto* r) { r->mutable_append()->set_dtype(v1::VALUE_DTYPE_UNSPECIFIED); }},
      {"unspecified query dtype", absl::StatusCode::kInvalidArgument,
       [](auto* r) { r->set_query_dtype(v1::VALUE_DTYPE_UNSPECIFIED); }},
  };
  for (const Case& c : cases) {
    v1::SelectBlocksRequest req = RandomSelect("a", 0, 1, 1, &q);
    *req.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, head_dim()));
    c.edit(&req);
    absl::StatusOr<v1::SelectBlocksResponse> r = client_->SelectBlocks(req);
    EXPECT_EQ(r.status().code(), c.code) << c.name << ": " << r.status();
    EXPECT_EQ(client_->GetSequence("a")->lengths(0), 100u) << c.name;
  }
  // A selection of a sequence that does not exist yet, with an invalid span, creates nothing.
  v1::SelectBlocksRequest req = RandomSelect("b", 0, 1, 2, &q);
  *req.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, head_dim()));
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->GetSequence("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages - 1);
}

TEST_F(SelectTest, SpanPastTheLengthIsFailedPrecondition) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  std::vector<float> q;
  v1::SelectBlocksRequest req = RandomSelect("a", 0, 1, 1, &q);
  req.set_start_position(10);
  absl::StatusOr<v1::SelectBlocksResponse> r = client_->SelectBlocks(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // n > length with the default start (p0 < 0).
  req = RandomSelect("a", 0, 1, 11, &q);
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kFailedPrecondition);
  // A span running past the end.
  req = RandomSelect("a", 0, 1, 3, &q);
  req.set_start_position(8);
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kFailedPrecondition);
  // Far past the end (p0 + n would overflow int64).
  req = RandomSelect("a", 0, 1, 2, &q);
  req.set_start_position(std::numeric_limits<int64_t>::max());
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kFailedPrecondition);
  // Layer 1 of the sequence is empty.
  req = RandomSelect("a", 1, 1, 1, &q);
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.set_start_position(-1);
  EXPECT_EQ(client_->SelectBlocks(req).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SelectTest, HugeInitAndLocalBlocksForceEverything) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 700));
  for (const bool init : {false, true}) {
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect("a", 0, 2, 3, &q);
    req.set_topk(8);
    kernels::SelectParams p = Params(8, 0, 0);
    if (init) {
      req.set_init_blocks(0xffffffffu);
      req.set_local_blocks(0);
      p.init_blocks = 1 << 30;
    } else {
      req.set_local_blocks(0xffffffffu);
      p.local_blocks = 1 << 30;
    }
    absl::StatusOr<Selection> got = client_->Select(req);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameSelection(*got, Host("a").Select(0, q, 2, 697, p, PageTable()),
                        init ? "init_blocks 2^32-1" : "local_blocks 2^32-1");
    // Every visible block is forced; ties (all 1e30 or all 1e29) go to the lower id.
    EXPECT_EQ(std::vector<int32_t>(got->blocks(0, 0).begin(), got->blocks(0, 0).end()),
              (std::vector<int32_t>{0, 1, 2, 3, 4, 5, -1, -1}));
  }
}

TEST_F(SelectTest, UnknownSequenceIsNotFound) {
  std::vector<float> q;
  absl::StatusOr<v1::SelectBlocksResponse> r = client_->SelectBlocks(RandomSelect("nope", 0, 1, 1, &q));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("nope"));
}

TEST_F(SelectTest, LimitsAreInvalidArgumentNamingTheField) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 50));
  std::vector<float> q;
  struct Case {
    std::string name;
    std::function<v1::SelectBlocksRequest()> make;
    std::string field;
  };
  const Case cases[] = {
      {"heads 0", [&] { auto r = RandomSelect("a", 0, 1, 1, &q); r.set_num_heads(0); return r; },
       "num_heads"},
      {"heads > max_index_heads", [&] { return RandomSelect("a", 0, 5, 1, &q); }, "num_heads"},
      {"topk 0", [&] { auto r = RandomSelect("a", 0, 1, 1, &q); r.set_topk(0); return r; }, "topk"},
      {"topk > max_topk", [&] { auto r = RandomSelect("a", 0, 1, 1, &q); r.set_topk(33); return r; },
       "topk"},
      {"queries not whole rows",
       [&] { auto r = RandomSelect("a", 0, 2, 1, &q); r.set_num_heads(3); return r; }, "queries"},
      {"empty queries", [&] { auto r = RandomSelect("a", 0, 1, 1, &q); r.clear_queries(); return r; },
       "queries"},
      {"NaN query",
       [&] {
         auto r = RandomSelect("a", 0, 2, 1, &q);
         q[head_dim() + 3] = std::numeric_limits<float>::quiet_NaN();
         r.set_queries(client::PackBf16(q));
         return r;
       },
       "queries[0][67]"},
      {"too many query tokens", [&] { return RandomSelect("a", 0, 1, 513, &q); }, "query tokens"},
      {"layer out of range", [&] { return RandomSelect("a", 2, 1, 1, &q); }, "layer"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::SelectBlocksResponse> r = client_->SelectBlocks(c.make());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.field)) << c.name;
  }
  // The limits themselves are accepted.
  v1::SelectBlocksRequest req = RandomSelect("a", 0, 4, 1, &q);
  req.set_topk(32);
  absl::StatusOr<Selection> got = client_->Select(req);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameSelection(*got, Host("a").Select(0, q, 4, 49, Params(32, 0, 1), PageTable()), "limits");
}

// Keys stored as fp8 e4m3: small integers are exact, so answers equal the bf16 reference.
class Fp8Test : public ServerTest {
 protected:
  Fp8Test() { options_.engine.key_storage = kernels::KeyStorage::kFp8E4M3; }
};

TEST_F(Fp8Test, SmallIntegerKeysSelectLikeBf16) {
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->key_storage(), v1::KEY_STORAGE_FP8_E4M3);
  EXPECT_EQ(info->bytes_per_page(), 128u * 64 * 1 * 2);
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 900));
  std::vector<float> q;
  v1::SelectBlocksRequest req = RandomSelect("a", 1, 4, 30, &q);
  req.set_topk(5);
  absl::StatusOr<Selection> got = client_->Select(req);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameSelection(*got, Host("a").Select(1, q, 4, 870, Params(5, 0, 1), PageTable()), "fp8");
}

// Keys stored as fp4: answers equal the reference run on the same fp4 rounding of the keys.
class Fp4Test : public ServerTest {
 protected:
  Fp4Test() { options_.engine.key_storage = kernels::KeyStorage::kFp4E2M1; }
};

TEST_F(Fp4Test, SelectsLikeTheReferenceOnFp4Keys) {
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->key_storage(), v1::KEY_STORAGE_FP4_E2M1);
  EXPECT_EQ(info->bytes_per_page(), 128u * (32 + 4) * 2);  // head_dim 64, two layers
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 900));
  Host("a").storage = kernels::KeyStorage::kFp4E2M1;
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect("a", layer, 4, 30, &q);
    req.set_topk(5);
    absl::StatusOr<Selection> got = client_->Select(req);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameSelection(*got, Host("a").Select(layer, q, 4, 870, Params(5, 0, 1), PageTable()),
                        "fp4");
  }
}

}  // namespace
}  // namespace indexer::testing
