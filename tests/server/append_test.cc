// AppendKeys end to end: creation, lengths, all_layers, attention pages, fp32 input, and every
// refusal (non-finite values naming the field, dtype, sizes, ids, pool full) applying nothing.
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class AppendTest : public ServerTest {};

// The silent-shape hazard: a client built for head_dim 32 sends two tokens' keys, which the
// head_dim-64 server would read as one token. The stated num_tokens makes that an error: the
// client refuses before sending, and the server refuses when the client does not check.
TEST_F(AppendTest, KeysOfAnotherHeadDimAreRefusedNotReadAsOtherTokens) {
  const std::vector<float> keys = IntValues(rng_, 2 * 32);
  const absl::Status in_client = client_->AppendKeys(client::MakeAppend("w1", 0, 2, keys)).status();
  EXPECT_EQ(in_client.code(), absl::StatusCode::kInvalidArgument) << in_client;
  EXPECT_THAT(std::string(in_client.message()), HasSubstr("head_dim 64"));

  client::ClientOptions unchecked;
  unchecked.check_shapes = false;
  absl::StatusOr<std::unique_ptr<IndexerClient>> raw =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", server_->port()), unchecked);
  ASSERT_TRUE(raw.ok());
  const absl::Status in_server = (*raw)->AppendKeys(client::MakeAppend("w1", 0, 2, keys)).status();
  EXPECT_EQ(in_server.code(), absl::StatusCode::kInvalidArgument) << in_server;
  EXPECT_THAT(std::string(in_server.message()), HasSubstr("num_tokens says 2"));
  EXPECT_EQ(client_->GetSequence("w1").status().code(), absl::StatusCode::kNotFound);

  ASSERT_NO_FATAL_FAILURE(AppendRandom("w1", 0, 200));
  const std::vector<float> q = IntValues(rng_, 2 * 4 * 32);  // [2][4 heads][32]
  for (IndexerClient* c : {client_.get(), raw->get()}) {
    const absl::Status select = c->SelectBlocks(client::MakeSelect("w1", 0, 4, 2, q)).status();
    EXPECT_EQ(select.code(), absl::StatusCode::kInvalidArgument) << select;
    v1::BatchRequest batch;
    *batch.add_items() = client::MakeSelect("w1", 0, 4, 2, q);
    absl::StatusOr<v1::BatchResponse> r = c->Batch(batch);
    const absl::Status item = r.ok() ? client::ItemStatus(r->results(0)) : r.status();
    EXPECT_EQ(item.code(), absl::StatusCode::kInvalidArgument) << item;
    std::unique_ptr<client::BatchStream> stream = c->OpenBatchStream();
    absl::StatusOr<v1::BatchResponse> streamed = stream->Step(batch);
    const absl::Status step = streamed.ok() ? client::ItemStatus(streamed->results(0))
                                            : streamed.status();
    EXPECT_EQ(step.code(), absl::StatusCode::kInvalidArgument) << step;
  }
  EXPECT_EQ(client_->GetSequence("w1")->lengths(0), 200u);
}

TEST_F(AppendTest, CreatesOnFirstAppendAndReportsLengthsPerLayer) {
  std::vector<float> keys = IntValues(rng_, 100 * head_dim());
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(client::MakeAppend("a", 0, keys));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->created());
  EXPECT_EQ(Lengths(r->lengths()), (std::vector<uint32_t>{100, 0}));
  EXPECT_EQ(r->num_blocks(), 1u);

  keys = IntValues(rng_, 200 * head_dim());
  r = client_->AppendKeys(client::MakeAppend("a", 0, keys));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->created());
  EXPECT_EQ(Lengths(r->lengths()), (std::vector<uint32_t>{300, 0}));
  EXPECT_EQ(r->num_blocks(), 3u);

  // Layer 1 shares the block table: its first 300 tokens open no new block.
  keys = IntValues(rng_, 300 * head_dim());
  r = client_->AppendKeys(client::MakeAppend("a", 1, keys));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Lengths(r->lengths()), (std::vector<uint32_t>{300, 300}));
  EXPECT_EQ(r->num_blocks(), 3u);
  keys = IntValues(rng_, 100 * head_dim());
  r = client_->AppendKeys(client::MakeAppend("a", 1, keys));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Lengths(r->lengths()), (std::vector<uint32_t>{300, 400}));
  EXPECT_EQ(r->num_blocks(), 4u);
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages - 4);

  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(Lengths(g->lengths()), (std::vector<uint32_t>{300, 400}));
  EXPECT_EQ(g->pages_size(), 4);
  EXPECT_TRUE(g->attention_pages().empty());
}

TEST_F(AppendTest, AllLayersWritesEachLayersKeys) {
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 333));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 70));
  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(Lengths(g->lengths()), (std::vector<uint32_t>{403, 403}));
  // Each layer answers from its own keys.
  for (int layer = 0; layer < layers(); ++layer) {
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect("a", layer, 2, 5, &q);
    req.set_topk(4);
    absl::StatusOr<Selection> got = client_->Select(req);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameSelection(*got, Host("a").Select(layer, q, 2, 398, Params(4, 0, 1), PageTable()),
                        absl::StrCat("layer ", layer));
  }
}

TEST_F(AppendTest, AllLayersIgnoresLayerField) {
  std::vector<float> keys = IntValues(rng_, 10 * layers() * head_dim());
  v1::AppendKeysRequest req = client::MakeAppendAllLayers("a", keys);
  req.set_layer(7);  // out of range, but ignored with all_layers
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Lengths(r->lengths()), (std::vector<uint32_t>{10, 10}));
}

TEST_F(AppendTest, Fp32KeysAreRoundedToBf16LikeThePackedOnes) {
  // Values that bf16 cannot hold exactly, including exact ties (1 + 2^-8 rounds to even: 1).
  std::vector<float> keys(130 * head_dim());
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (float& k : keys) k = dist(rng_);
  keys[0] = 1.0f + 1.0f / 256;
  keys[1] = 1.0f + 3.0f / 256;
  ASSERT_TRUE(client_->AppendKeys(client::MakeAppend("fp32", 0, keys, v1::VALUE_DTYPE_FP32)).ok());
  ASSERT_TRUE(client_->AppendKeys(client::MakeAppend("bf16", 0, keys, v1::VALUE_DTYPE_BF16)).ok());
  Host("ref").Append(0, keys);
  EXPECT_EQ(client::RoundToBf16(keys[0]), 1.0f);
  EXPECT_EQ(client::RoundToBf16(keys[1]), 1.0f + 4.0f / 256);

  std::vector<float> q(3 * 4 * head_dim());
  for (float& x : q) x = dist(rng_);
  for (const v1::ValueDtype qd : {v1::VALUE_DTYPE_FP32, v1::VALUE_DTYPE_BF16}) {
    for (const char* id : {"fp32", "bf16"}) {
      v1::SelectBlocksRequest req = client::MakeSelect(id, 0, 4, q, qd);
      req.set_topk(2);
      absl::StatusOr<Selection> got = client_->Select(req);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameSelection(*got, Host("ref").Select(0, q, 4, 127, Params(2, 0, 1), PageTable()),
                          absl::StrCat(id, " keys, query dtype ", qd));
    }
  }
}

TEST_F(AppendTest, NonFiniteKeysAreRefusedNamingTheFieldAndNothingIsApplied) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    float value;
    v1::ValueDtype dtype;
  };
  for (const Case c : {Case{nan, v1::VALUE_DTYPE_BF16}, Case{nan, v1::VALUE_DTYPE_FP32},
                       Case{inf, v1::VALUE_DTYPE_BF16}, Case{-inf, v1::VALUE_DTYPE_FP32},
                       Case{3.4e38f, v1::VALUE_DTYPE_FP32}}) {  // finite fp32, Inf in bf16
    SCOPED_TRACE(absl::StrCat("value ", c.value, " dtype ", c.dtype));
    std::vector<float> keys = IntValues(rng_, 4 * head_dim());
    keys[3 * head_dim() + 5] = c.value;
    absl::StatusOr<v1::AppendKeysResponse> r =
        client_->AppendKeys(client::MakeAppend("bad", 0, keys, c.dtype));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("keys[3][5]"));
    EXPECT_EQ(client_->GetSequence("bad").status().code(), absl::StatusCode::kNotFound);
  }
  // On an existing sequence: its length stays.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  std::vector<float> keys = IntValues(rng_, 2 * head_dim());
  keys[head_dim()] = nan;
  EXPECT_EQ(client_->AppendKeys(client::MakeAppend("a", 0, keys)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 10u);
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages - 1);
}

TEST_F(AppendTest, UnspecifiedDtypeIsRefused) {
  v1::AppendKeysRequest req = client::MakeAppend("a", 0, IntValues(rng_, 2 * head_dim()));
  req.set_dtype(v1::VALUE_DTYPE_UNSPECIFIED);
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("dtype"));
  EXPECT_EQ(client_->GetSequence("a").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AppendTest, BadSizesLayersAndIdsAreRefused) {
  const std::string row = client::PackBf16(IntValues(rng_, head_dim()));
  struct Case {
    std::string name;
    v1::AppendKeysRequest request;
    std::string message;
  };
  std::vector<Case> cases;
  auto base = [&] {
    v1::AppendKeysRequest r;
    r.set_sequence_id("a");
    r.set_dtype(v1::VALUE_DTYPE_BF16);
    r.set_keys(row + row);
    return r;
  };
  cases.push_back({"empty keys", base(), "keys"});
  cases.back().request.clear_keys();
  cases.push_back({"partial row", base(), "keys"});
  cases.back().request.set_keys(row + row.substr(0, 6));
  cases.push_back({"odd byte count", base(), "keys"});
  cases.back().request.set_keys(row + "x");
  cases.push_back({"fp32 sized as bf16", base(), "keys"});
  cases.back().request.set_dtype(v1::VALUE_DTYPE_FP32);
  cases.back().request.set_keys(row);  // half an fp32 row
  cases.push_back({"all_layers needs layers rows", base(), "keys"});
  cases.back().request.set_all_layers(true);
  cases.back().request.set_keys(row + row + row);  // 1.5 all-layer rows
  cases.push_back({"layer out of range", base(), "layer"});
  cases.back().request.set_layer(2);
  cases.push_back({"empty id", base(), "sequence_id"});
  cases.back().request.clear_sequence_id();
  cases.push_back({"id too long", base(), "sequence_id"});
  cases.back().request.set_sequence_id(std::string(257, 'x'));
  cases.push_back({"negative attention page", base(), "attention_pages[0]"});
  cases.back().request.add_attention_pages(-1);
  cases.push_back({"attention page too large", base(), "attention_pages[0]"});
  cases.back().request.add_attention_pages(std::numeric_limits<int32_t>::max());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(c.request);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message));
  }
  // 256 bytes is the longest id.
  v1::AppendKeysRequest longest = base();
  longest.set_sequence_id(std::string(256, 'y'));
  EXPECT_TRUE(client_->AppendKeys(longest).ok());
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->live_sequences(), 1u);
  EXPECT_EQ(info->free_pages(), info->total_pages() - 1);
}

TEST_F(AppendTest, AttentionPagesOnePerOpenedBlock) {
  // 300 tokens open blocks 0..2: three ids.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300, {40, 41, 42}));
  // 50 more stay in block 2: no id allowed.
  v1::AppendKeysRequest req = client::MakeAppend("a", 0, IntValues(rng_, 50 * head_dim()));
  req.add_attention_pages(43);
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("attention_pages"));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 50));
  // 100 more (350 -> 450) open block 3: exactly one id.
  req = client::MakeAppend("a", 0, IntValues(rng_, 100 * head_dim()));
  r = client_->AppendKeys(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  req.add_attention_pages(7);
  req.add_attention_pages(8);
  r = client_->AppendKeys(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 350u);
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 100, {7}));
  // Layer 1 catching up opens nothing.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 1, 450));

  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(std::vector<int32_t>(g->attention_pages().begin(), g->attention_pages().end()),
            (std::vector<int32_t>{40, 41, 42, 7}));

  // A sequence created without attention pages cannot get them later.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("plain", 0, 10));
  req = client::MakeAppend("plain", 0, IntValues(rng_, 200 * head_dim()));
  req.add_attention_pages(1);
  req.add_attention_pages(2);
  r = client_->AppendKeys(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(client_->GetSequence("plain")->lengths(0), 10u);
}

// A pool of 16 pages, to fill it.
class TinyPoolTest : public ServerTest {
 protected:
  TinyPoolTest() { options_.engine.capacity_pages = 16; }
};

TEST_F(TinyPoolTest, PoolFullIsResourceExhaustedAndAppliesNothing) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 12 * 128));  // 12 pages
  ASSERT_EQ(FreePages(), 4);

  // A new sequence needing 5 pages: refused, not created.
  absl::StatusOr<v1::AppendKeysResponse> r =
      client_->AppendKeys(client::MakeAppend("b", 0, IntValues(rng_, 5 * 128 * head_dim())));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(client_->GetSequence("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), 4);

  // An existing sequence growing past the pool: refused, unchanged, still answering as before.
  r = client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, (4 * 128 + 1) * head_dim())));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->lengths(0), 12u * 128);
  EXPECT_EQ(g->pages_size(), 12);
  EXPECT_EQ(FreePages(), 4);
  std::vector<float> q;
  v1::SelectBlocksRequest sel = RandomSelect("a", 0, 2, 3, &q);
  absl::StatusOr<Selection> got = client_->Select(sel);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameSelection(*got, Host("a").Select(0, q, 2, 12 * 128 - 3, DefaultParams(), PageTable()),
                      "after the refused append");

  // Exactly what is left fits.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 4 * 128));
  EXPECT_EQ(FreePages(), 0);
  r = client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, head_dim())));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  // Releasing gives the pages back.
  ASSERT_TRUE(client_->ReleaseSequence("a").ok());
  EXPECT_EQ(FreePages(), 16);
}

TEST_F(TinyPoolTest, AllLayersAppendPastThePoolAppliesNoLayer) {
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 15 * 128));
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(
      client::MakeAppendAllLayers("a", IntValues(rng_, 129 * layers() * head_dim())));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(Lengths(g->lengths()), (std::vector<uint32_t>{15 * 128, 15 * 128}));
  EXPECT_EQ(FreePages(), 1);
}

TEST_F(AppendTest, MaxTokensPerSequenceIsEnforced) {
  // max_tokens_per_sequence is 4096 here; the pool (64 pages) could hold more.
  for (int i = 0; i < 4; ++i) ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 1024));
  absl::StatusOr<v1::AppendKeysResponse> r =
      client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, head_dim())));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("max_tokens_per_sequence"));
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 4096u);
}

}  // namespace
}  // namespace indexer::testing
