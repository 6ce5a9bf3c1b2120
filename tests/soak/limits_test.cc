// Limits and bad input, end to end against an in-process server (tests/testing/server_fixture.h):
//  - pool exhaustion answers RESOURCE_EXHAUSTED for whatever needs a page (append, a decode
//    step's append, a Batch item, a write into a page shared with a fork, a new sequence) and
//    harms no other sequence or item; releasing makes room again;
//  - the sequence limit (max_sequences) answers RESOURCE_EXHAUSTED for whatever would create one
//    more sequence (AppendKeys, SelectBlocks with an append, a Batch item, ForkSequence);
//  - every field of every RPC is checked, and a refusal names the field (and the limit) and
//    changes nothing: one table for the whole API.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

// The current answer for one selection, and the reference's.
void ExpectSelects(IndexerClient& c, HostSequence& host, const std::string& id, int layer,
                   std::mt19937& rng, int head_dim, const kernels::SelectParams& params,
                   const kernels::PageTableParams& pt, const std::string& where) {
  const int64_t len = host.length(layer);
  const int n = static_cast<int>(std::min<int64_t>(len, 3));
  const std::vector<float> q = IntValues(rng, static_cast<size_t>(n) * 2 * head_dim);
  v1::SelectBlocksRequest r = client::MakeSelect(id, layer, 2, q);
  r.set_topk(params.topk);
  r.set_init_blocks(params.init_blocks);
  r.set_local_blocks(params.local_blocks);
  absl::StatusOr<Selection> got = c.Select(r);
  ASSERT_TRUE(got.ok()) << where << ": " << got.status();
  ExpectSameSelection(*got, host.Select(layer, q, 2, len - n, params, pt), where);
}

class PoolExhaustionTest : public ServerTest {};

TEST_F(PoolExhaustionTest, RefusesWhatNeedsAPageAndHarmsNothingElse) {
  const kernels::SelectParams params{8, 1, 1};
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("b", 200, {5, 6}));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 1, 10));  // layer 1 ahead of layer 0

  // Fill the pool: big chunks, then single blocks, until not one page is free.
  int chunks = 0;
  for (int size : {512, 128}) {
    for (;;) {
      const std::vector<float> keys = IntValues(rng_, static_cast<size_t>(size) * head_dim());
      absl::StatusOr<v1::AppendKeysResponse> r =
          client_->AppendKeys(client::MakeAppend(absl::StrCat("hog", chunks / 8), 0, keys));
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
        EXPECT_THAT(r.status().message(), HasSubstr("key cache is full"));
        break;
      }
      ++chunks;
    }
  }
  ASSERT_EQ(FreePages(), 0);

  const auto refused = [&](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << what << ": " << s;
  };
  // 300 tokens: the next block needs a page.
  refused(client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, 100 * head_dim()))).status(),
          "append opening a block");
  std::vector<float> q;
  v1::SelectBlocksRequest step = RandomSelect("a", 0, 1, 1, &q);
  *step.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, 100 * head_dim()));
  refused(client_->Select(step).status(), "decode step opening a block");
  refused(client_->AppendKeys(client::MakeAppend("new", 0, IntValues(rng_, head_dim()))).status(),
          "a new sequence");
  EXPECT_EQ(client_->GetSequence("new").status().code(), absl::StatusCode::kNotFound)
      << "a refused creation left a sequence behind";

  // A fork needs no page; a write into the page it shares needs one (copy-on-write).
  ASSERT_TRUE(client_->ForkSequence("a", "a-fork").ok());
  refused(client_->AppendKeys(client::MakeAppend("a-fork", 0, IntValues(rng_, head_dim()))).status(),
          "a write into a shared page");
  refused(client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, head_dim()))).status(),
          "a write into a page shared with a fork");

  // In a Batch only the item that needs a page fails.
  v1::BatchRequest batch;
  std::vector<float> qa, qb;
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &qa);
  *batch.mutable_items(0)->mutable_append() =
      client::MakeAppend("", 0, IntValues(rng_, 100 * head_dim()));
  *batch.add_items() = RandomSelect("b", 1, 1, 1, &qb);
  batch.mutable_items(1)->set_topk(params.topk);
  batch.mutable_items(1)->set_init_blocks(params.init_blocks);
  batch.mutable_items(1)->set_local_blocks(params.local_blocks);
  absl::StatusOr<v1::BatchResponse> br = client_->Batch(batch);
  ASSERT_TRUE(br.ok()) << br.status();
  refused(client::ItemStatus(br->results(0)), "batch item opening a block");
  ASSERT_TRUE(client::ItemStatus(br->results(1)).ok()) << client::ItemStatus(br->results(1));
  absl::StatusOr<Selection> sb = client::ParseSelection(br->results(1).result());
  ASSERT_TRUE(sb.ok());
  ExpectSameSelection(*sb, Host("b").Select(1, qb, 1, Host("b").length(1) - 1, params, PageTable()),
                      "b beside a refused item");

  // Nothing changed: no page moved, a and b select exactly as before.
  EXPECT_EQ(FreePages(), 0);
  for (int layer = 0; layer < layers(); ++layer) {
    ASSERT_NO_FATAL_FAILURE(ExpectSelects(*client_, Host("b"), "b", layer, rng_, head_dim(), params,
                                          PageTable(), "b after the refusals"));
  }
  ASSERT_NO_FATAL_FAILURE(ExpectSelects(*client_, Host("a"), "a", 0, rng_, head_dim(), params,
                                        PageTable(), "a after the refusals"));
  absl::StatusOr<v1::GetSequenceResponse> ga = client_->GetSequence("a");
  ASSERT_TRUE(ga.ok());
  EXPECT_EQ(ga->lengths(0), 300u);
  EXPECT_EQ(ga->shared_pages(), 3u);

  // Room again: the hog's pages come back and the refused append now succeeds.
  for (int i = 0; i <= chunks / 8; ++i) ASSERT_TRUE(client_->ReleaseSequence(absl::StrCat("hog", i)).ok());
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 100));
  ASSERT_NO_FATAL_FAILURE(ExpectSelects(*client_, Host("a"), "a", 0, rng_, head_dim(), params,
                                        PageTable(), "a after the pool emptied"));
}

class SequenceLimitTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.engine.max_sequences = 3;
    ServerTest::SetUp();
  }
};

TEST_F(SequenceLimitTest, RefusesWhatWouldCreateOneMoreSequence) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 10));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("c", 0, 10));
  const int64_t free_pages = FreePages();
  const auto refused = [&](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << what << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("max_sequences 3")) << what;
  };
  refused(client_->AppendKeys(client::MakeAppend("d", 0, IntValues(rng_, head_dim()))).status(),
          "AppendKeys");
  std::vector<float> q;
  v1::SelectBlocksRequest step = RandomSelect("d", 0, 1, 1, &q);
  *step.mutable_append() = client::MakeAppend("", 0, IntValues(rng_, head_dim()));
  refused(client_->Select(step).status(), "SelectBlocks with an append");
  refused(client_->ForkSequence("a", "d").status(), "ForkSequence");
  v1::BatchRequest batch;
  *batch.add_items() = step;
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &q);
  absl::StatusOr<v1::BatchResponse> br = client_->Batch(batch);
  ASSERT_TRUE(br.ok());
  refused(client::ItemStatus(br->results(0)), "Batch item");
  EXPECT_TRUE(client::ItemStatus(br->results(1)).ok()) << "the other item must not be harmed";
  EXPECT_EQ(client_->GetSequence("d").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), free_pages);
  // An existing sequence is not "one more", even at the limit; a truncated one still counts.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("c", 0, 10));
  ASSERT_TRUE(client_->TruncateSequence("c", 0).ok());
  refused(client_->ForkSequence("a", "d").status(), "ForkSequence after truncating c");
  ASSERT_TRUE(client_->ReleaseSequence("c").ok());
  EXPECT_TRUE(client_->ForkSequence("a", "d").ok());
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->live_sequences(), 3u);
  EXPECT_EQ(info->max_sequences(), 3u);
}

class SelectionScratchTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.engine.max_select_scores = 600;  // raw block scores per span and per backend call
    ServerTest::SetUp();
  }
};

TEST_F(SelectionScratchTest, RefusesATooLargeSpanAndSplitsALargeBatch) {
  for (const char* id : {"a", "b", "c", "d"}) ASSERT_NO_FATAL_FAILURE(AppendRandom(id, 0, 1200));
  // 1200 tokens: 10 blocks. 16 tokens x 4 heads x 10 blocks = 640 scores: over the limit.
  std::vector<float> q;
  absl::StatusOr<Selection> big = client_->Select(RandomSelect("a", 0, 4, 16, &q));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_THAT(big.status().message(), HasSubstr("split the span"));
  // Four spans of 15 x 4 x 10 = 600 scores each: one backend call apiece, every answer exact.
  v1::BatchRequest batch;
  std::vector<std::vector<float>> queries(4);
  const std::vector<std::string> ids = {"a", "b", "c", "d"};
  for (size_t i = 0; i < ids.size(); ++i) *batch.add_items() = RandomSelect(ids[i], 0, 4, 15, &queries[i]);
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(client::ItemStatus(r->results(i)).ok()) << client::ItemStatus(r->results(i));
    absl::StatusOr<Selection> got = client::ParseSelection(r->results(i).result());
    ASSERT_TRUE(got.ok());
    ExpectSameSelection(*got, Host(ids[i]).Select(0, queries[i], 4, 1200 - 15, DefaultParams(), PageTable()),
                        ids[i]);
  }
}

// One row per refusal: the call, the code, and what the message must name.
struct Refusal {
  std::string what;
  std::function<absl::Status(IndexerClient&)> call;
  absl::StatusCode code;
  std::string names;
};

class RequestValidationTest : public ServerTest {};

TEST_F(RequestValidationTest, EveryFieldOfEveryRpcIsCheckedAndNamed) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("s", 0, 200));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("s", 1, 150));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("t", 520, {1, 2, 3, 4, 5}));
  const int d = head_dim();
  const auto keys = [&](int tokens) { return IntValues(rng_, static_cast<size_t>(tokens) * d); };
  const auto append = [&](std::function<void(v1::AppendKeysRequest&)> edit) {
    return [=, k = keys(2)](IndexerClient& c) {
      v1::AppendKeysRequest r = client::MakeAppend("s", 0, k);
      edit(r);
      return c.AppendKeys(r).status();
    };
  };
  const auto select = [&](std::function<void(v1::SelectBlocksRequest&)> edit) {
    return [=, q = keys(2)](IndexerClient& c) {
      v1::SelectBlocksRequest r = client::MakeSelect("s", 0, 1, q);
      edit(r);
      return c.Select(r).status();
    };
  };
  const auto inv = absl::StatusCode::kInvalidArgument;
  const auto pre = absl::StatusCode::kFailedPrecondition;
  const auto missing = absl::StatusCode::kNotFound;
  const std::string nan_keys = client::PackBf16(std::vector<float>(d, std::nanf("")));
  const std::vector<Refusal> table = {
      // AppendKeysRequest
      {"append: empty sequence_id", append([](auto& r) { r.set_sequence_id(""); }), inv, "sequence_id"},
      {"append: 257-byte sequence_id", append([](auto& r) { r.set_sequence_id(std::string(257, 'x')); }), inv, "sequence_id has 257 bytes; it must have 1 to 256"},
      {"append: layer", append([](auto& r) { r.set_layer(2); }), inv, "layer is 2; it must be in [0, 1]"},
      {"append: dtype", append([](auto& r) { r.set_dtype(v1::VALUE_DTYPE_UNSPECIFIED); }), inv, "keys: dtype is unspecified"},
      {"append: unknown dtype", append([](auto& r) { r.set_dtype(static_cast<v1::ValueDtype>(9)); }), inv, "keys: dtype"},
      {"append: no keys", append([](auto& r) { r.clear_keys(); }), inv, "keys has 0 bytes"},
      {"append: ragged keys", append([](auto& r) { r.mutable_keys()->pop_back(); }), inv, "keys has 255 bytes"},
      {"append: ragged all_layers keys", [&](IndexerClient& c) {
         v1::AppendKeysRequest r = client::MakeAppend("s", 0, keys(3));
         r.set_all_layers(true);
         return c.AppendKeys(r).status();
       }, inv, "keys has 384 bytes; it must be a non-zero multiple of one row, 128 values"},
      {"append: NaN key", append([&](auto& r) { r.set_keys(nan_keys); }), inv, "keys[0][0] is not finite"},
      {"append: too many tokens", [&](IndexerClient& c) { return c.AppendKeys(client::MakeAppend("s", 0, keys(4097))).status(); }, inv, "max_tokens_per_sequence is 4096"},
      {"append: negative attention page", append([](auto& r) { r.set_sequence_id("t"); r.add_attention_pages(-1); }), inv, "attention_pages[0] is -1"},
      {"append: attention page too large", append([](auto& r) { r.set_sequence_id("t"); r.add_attention_pages(std::numeric_limits<int32_t>::max()); }), inv, "attention_pages[0]"},
      {"append: attention pages on a sequence without", append([](auto& r) { r.add_attention_pages(3); }), pre, "attention_pages must be empty"},
      {"append: attention page count", append([](auto& r) { r.set_sequence_id("t"); r.add_attention_pages(3); r.add_attention_pages(4); }), inv, "attention_pages has 2 ids"},
      // SelectBlocksRequest
      {"select: unknown sequence", select([](auto& r) { r.set_sequence_id("nobody"); }), missing, "sequence 'nobody' does not exist"},
      {"select: empty sequence_id", select([](auto& r) { r.set_sequence_id(""); }), inv, "sequence_id"},
      {"select: layer", select([](auto& r) { r.set_layer(7); }), inv, "layer is 7"},
      {"select: no heads", select([](auto& r) { r.set_num_heads(0); }), inv, "num_heads is 0; it must be in [1, 4]"},
      {"select: too many heads", select([](auto& r) { r.set_num_heads(5); }), inv, "num_heads is 5"},
      {"select: query dtype", select([](auto& r) { r.set_query_dtype(v1::VALUE_DTYPE_UNSPECIFIED); }), inv, "queries: dtype is unspecified"},
      {"select: no queries", select([](auto& r) { r.clear_queries(); }), inv, "queries is empty"},
      {"select: ragged queries", select([](auto& r) { r.mutable_queries()->resize(130); }), inv, "queries has 130 bytes"},
      {"select: NaN query", select([&](auto& r) { r.set_queries(nan_keys); }), inv, "queries[0][0] is not finite"},
      {"select: too many query tokens", [&](IndexerClient& c) { return c.Select(client::MakeSelect("s", 0, 1, keys(513))).status(); }, inv, "query tokens (queries rows) is 513; it must be in [1, 512]"},
      {"select: topk 0", select([](auto& r) { r.set_topk(0); }), inv, "topk is 0; it must be in [1, 32]"},
      {"select: topk too large", select([](auto& r) { r.set_topk(33); }), inv, "topk is 33"},
      {"select: negative start_position", select([](auto& r) { r.set_start_position(-1); }), inv, "start_position is -1"},
      {"select: span past the end", select([](auto& r) { r.set_start_position(199); }), pre, "not inside layer 0's 200 tokens"},
      {"select: huge start_position", select([](auto& r) { r.set_start_position(std::numeric_limits<int64_t>::max()); }), pre, "not inside"},
      {"select: append to another sequence", select([&](auto& r) { *r.mutable_append() = client::MakeAppend("t", 0, keys(1)); }), inv, "append.sequence_id 't' differs"},
      {"select: append with a bad layer", select([&](auto& r) { *r.mutable_append() = client::MakeAppend("", 5, keys(1)); }), inv, "layer is 5"},
      {"select: append with NaN", select([&](auto& r) { *r.mutable_append() = client::MakeAppend("", 0, keys(1)); r.mutable_append()->set_keys(nan_keys); }), inv, "keys[0][0] is not finite"},
      // BatchRequest (each item is a SelectBlocksRequest, checked as above)
      {"batch: too many items", [&](IndexerClient& c) {
         v1::BatchRequest b;
         for (int i = 0; i < 17; ++i) *b.add_items() = client::MakeSelect("s", 0, 1, keys(1));
         absl::StatusOr<v1::BatchResponse> r = c.Batch(b);
         return r.ok() ? client::ItemStatus(r->results(16)) : r.status();
       }, inv, "the batch has 17 items; max_batch_items is 16"},
      {"batch: an item with neither append nor queries", [&](IndexerClient& c) {
         v1::BatchRequest b;
         b.add_items()->set_sequence_id("s");
         absl::StatusOr<v1::BatchResponse> r = c.Batch(b);
         return r.ok() ? client::ItemStatus(r->results(0)) : r.status();
       }, inv, "nothing to do"},
      // ReleaseSequenceRequest, TruncateSequenceRequest, ForkSequenceRequest, GetSequenceRequest
      {"release: empty id", [](IndexerClient& c) { return c.ReleaseSequence("").status(); }, inv, "sequence_id has 0 bytes"},
      {"release: unknown id", [](IndexerClient& c) { return c.ReleaseSequence("nobody").status(); }, missing, "'nobody' does not exist"},
      {"truncate: empty id", [](IndexerClient& c) { return c.TruncateSequence("", 1).status(); }, inv, "sequence_id has 0 bytes"},
      {"truncate: long id", [](IndexerClient& c) { return c.TruncateSequence(std::string(300, 'y'), 1).status(); }, inv, "sequence_id has 300 bytes"},
      {"truncate: unknown id", [](IndexerClient& c) { return c.TruncateSequence("nobody", 1).status(); }, missing, "does not exist"},
      {"fork: empty source", [](IndexerClient& c) { return c.ForkSequence("", "u").status(); }, inv, "source_id has 0 bytes"},
      {"fork: empty target", [](IndexerClient& c) { return c.ForkSequence("s", "").status(); }, inv, "target_id has 0 bytes"},
      {"fork: long target", [](IndexerClient& c) { return c.ForkSequence("s", std::string(257, 'z')).status(); }, inv, "target_id has 257 bytes"},
      {"fork: onto itself", [](IndexerClient& c) { return c.ForkSequence("s", "s").status(); }, inv, "target_id must differ from source_id"},
      {"fork: unknown source", [](IndexerClient& c) { return c.ForkSequence("nobody", "u").status(); }, missing, "'nobody' does not exist"},
      {"fork: target taken", [](IndexerClient& c) { return c.ForkSequence("s", "t").status(); }, absl::StatusCode::kAlreadyExists, "'t' already exists"},
      {"get: empty id", [](IndexerClient& c) { return c.GetSequence("").status(); }, inv, "sequence_id has 0 bytes"},
      {"get: unknown id", [](IndexerClient& c) { return c.GetSequence("nobody").status(); }, missing, "does not exist"},
      // Message and answer sizes (max_message_bytes is 1 MiB here).
      {"request larger than max_message_bytes", [&](IndexerClient& c) { return c.AppendKeys(client::MakeAppend("s", 0, keys(10000))).status(); }, absl::StatusCode::kResourceExhausted, "larger than max"},
      {"answer larger than max_message_bytes", [&](IndexerClient& c) {
         v1::SelectBlocksRequest r = client::MakeSelect("t", 0, 4, keys(4 * 512));
         r.set_topk(32);
         return c.Select(r).status();
       }, absl::StatusCode::kResourceExhausted, "max_response_bytes"},
  };

  std::vector<v1::GetSequenceResponse> before;
  for (const char* id : {"s", "t"}) before.push_back(*client_->GetSequence(id));
  const int64_t free_pages = FreePages();
  for (const Refusal& row : table) {
    const absl::Status s = row.call(*client_);
    EXPECT_EQ(s.code(), row.code) << row.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(row.names)) << row.what;
  }
  // Nothing of any of it was applied.
  EXPECT_EQ(FreePages(), free_pages);
  for (size_t i = 0; i < before.size(); ++i) {
    absl::StatusOr<v1::GetSequenceResponse> now = client_->GetSequence(before[i].sequence_id());
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(now->DebugString(), before[i].DebugString());
  }
  for (const char* id : {"u", "nobody"}) {
    EXPECT_EQ(client_->GetSequence(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
}

// A request protobuf cannot parse (here a string field that is not UTF-8, which only C++ clients
// can even send) is refused by gRPC before it reaches the service: gRPC 1.51 answers
// UNIMPLEMENTED with no message. The code is gRPC's; what this project promises is that nothing
// happens.
TEST_F(RequestValidationTest, UnparsableRequestIsRefusedAndAppliesNothing) {
  const int64_t free_pages = FreePages();
  const std::string not_utf8("s\xff\xfe", 3);
  const absl::Status s =
      client_->AppendKeys(client::MakeAppend(not_utf8, 0, IntValues(rng_, head_dim()))).status();
  EXPECT_FALSE(s.ok());
  std::printf("an unparsable request was answered %s\n", s.ToString().c_str());
  EXPECT_EQ(FreePages(), free_pages);
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->live_sequences(), 0u);
}

}  // namespace
}  // namespace indexer::testing
