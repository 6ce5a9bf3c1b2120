// Batch and BatchStream end to end: per-item statuses, items on one sequence applied in order,
// stream answers in order with their request ids, and results equal to the unary ones.
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

class BatchTest : public ServerTest {
 protected:
  // A decode item for `id`: append one token to every layer, select `heads` heads on `layer`.
  v1::SelectBlocksRequest DecodeItem(const std::string& id, int layer, int heads,
                                     std::vector<float>* key, std::vector<float>* q) {
    v1::SelectBlocksRequest item = RandomSelect(id, layer, heads, 1, q);
    *key = IntValues(rng_, layers() * head_dim());
    *item.mutable_append() = client::MakeAppendAllLayers("", *key);
    return item;
  }
};

// A Batch whose answer cannot be sent fails whole and applies nothing, counting the failed
// items' messages too: one good append among 2,000 items with nothing to do, each of which would
// answer an error, on a server that sends at most 64 KiB.
TEST_F(BatchTest, ABatchWhoseErrorsAloneDoNotFitAppliesNothing) {
  options_.max_message_bytes = 65536;
  Restart();
  const int64_t free_before = FreePages();
  v1::BatchRequest batch;
  v1::SelectBlocksRequest* good = batch.add_items();
  good->set_sequence_id("good");
  *good->mutable_append() = client::MakeAppend("", 0, IntValues(rng_, 10 * head_dim()));
  for (int i = 0; i < 2000; ++i) batch.add_items()->set_sequence_id("empty");
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  if (r.ok()) {
    for (const v1::BatchItemResult& item : r->results()) {
      EXPECT_NE(item.code(), 0) << "an item of a call that could not be answered succeeded";
    }
  } else {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  }
  EXPECT_EQ(client_->GetSequence("good").status().code(), absl::StatusCode::kNotFound)
      << "the failed call applied its good append";
  EXPECT_EQ(FreePages(), free_before);
}

TEST_F(BatchTest, ItemsHaveTheirOwnStatuses) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 50));
  v1::BatchRequest batch;
  batch.set_request_id(77);
  std::vector<float> qa, qb, qc, key_b;
  *batch.add_items() = RandomSelect("a", 0, 2, 3, &qa);                   // 0: OK
  *batch.add_items() = RandomSelect("missing", 0, 1, 1, &qc);             // 1: NOT_FOUND
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &qc);                   // 2: topk too large
  batch.mutable_items(2)->set_topk(1000);
  v1::SelectBlocksRequest* append_only = batch.add_items();               // 3: append only
  append_only->set_sequence_id("b");
  key_b = IntValues(rng_, 20 * head_dim());
  *append_only->mutable_append() = client::MakeAppend("", 0, key_b);
  *batch.add_items() = RandomSelect("b", 0, 4, 2, &qb);                   // 4: sees item 3
  v1::SelectBlocksRequest* nothing = batch.add_items();                   // 5: nothing to do
  nothing->set_sequence_id("a");
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &qc);                   // 6: span past length
  batch.mutable_items(6)->set_start_position(300);

  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request_id(), 77u);
  ASSERT_EQ(r->results_size(), 7);
  const absl::StatusCode want[] = {
      absl::StatusCode::kOk, absl::StatusCode::kNotFound, absl::StatusCode::kInvalidArgument,
      absl::StatusCode::kOk, absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument,
      absl::StatusCode::kFailedPrecondition};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(client::ItemStatus(r->results(i)).code(), want[i])
        << "item " << i << ": " << client::ItemStatus(r->results(i));
    if (want[i] != absl::StatusCode::kOk) {
      EXPECT_FALSE(r->results(i).message().empty()) << i;
    }
  }
  Host("b").Append(0, key_b);
  absl::StatusOr<Selection> a = client::ParseSelection(r->results(0).result());
  ASSERT_TRUE(a.ok());
  ExpectSameSelection(*a, Host("a").Select(0, qa, 2, 297, DefaultParams(), PageTable()), "item 0");
  EXPECT_EQ(r->results(3).result().lengths(0), 70u);
  EXPECT_EQ(r->results(3).result().num_tokens(), 0u);  // no selection
  absl::StatusOr<Selection> b = client::ParseSelection(r->results(4).result());
  ASSERT_TRUE(b.ok());
  ExpectSameSelection(*b, Host("b").Select(0, qb, 4, 68, DefaultParams(), PageTable()), "item 4");
}

TEST_F(BatchTest, ItemsOnOneSequenceApplyInOrder) {
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("a", 126));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("b", 10));
  // a, b, a, a, b: three decode steps of a (126 -> 129 crosses a block), two of b, interleaved,
  // with a failing item on a in the middle that must not disturb the ones after it.
  v1::BatchRequest batch;
  struct Expected {
    std::string id;
    std::vector<float> key, q;
    bool ok = true;
  };
  std::vector<Expected> items;
  for (const std::string id : {"a", "b", "a", "x", "a", "b"}) {
    Expected e;
    e.id = id == "x" ? "a" : id;
    v1::SelectBlocksRequest item = DecodeItem(e.id, 1, 2, &e.key, &e.q);
    if (id == "x") {  // an invalid item on a: its append must not be applied
      item.set_topk(0);
      e.ok = false;
    }
    *batch.add_items() = item;
    items.push_back(e);
  }
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->results_size(), static_cast<int>(items.size()));
  for (size_t i = 0; i < items.size(); ++i) {
    const Expected& e = items[i];
    if (!e.ok) {
      EXPECT_EQ(client::ItemStatus(r->results(i)).code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    ASSERT_TRUE(client::ItemStatus(r->results(i)).ok()) << client::ItemStatus(r->results(i));
    Host(e.id).AppendAllLayers(e.key);
    const int64_t len = Host(e.id).length(1);
    absl::StatusOr<Selection> got = client::ParseSelection(r->results(i).result());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->lengths, (std::vector<uint32_t>{static_cast<uint32_t>(len), static_cast<uint32_t>(len)}));
    ExpectSameSelection(*got, Host(e.id).Select(1, e.q, 2, len - 1, DefaultParams(), PageTable()),
                        absl::StrCat("item ", i, " on ", e.id));
  }
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 129u);
  EXPECT_EQ(client_->GetSequence("b")->lengths(0), 12u);
}

TEST_F(BatchTest, FirstItemCreatesTheSequenceTheNextOnesExtend) {
  v1::BatchRequest batch;
  std::vector<std::vector<float>> keys, queries;
  for (int i = 0; i < 3; ++i) {
    std::vector<float> key, q;
    v1::SelectBlocksRequest item = RandomSelect("fresh", 0, 1, 1, &q);
    key = IntValues(rng_, 100 * head_dim());
    *item.mutable_append() = client::MakeAppend("", 0, key);
    *batch.add_items() = item;
    keys.push_back(key);
    queries.push_back(q);
  }
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(client::ItemStatus(r->results(i)).ok()) << client::ItemStatus(r->results(i));
    Host("fresh").Append(0, keys[i]);
    absl::StatusOr<Selection> got = client::ParseSelection(r->results(i).result());
    ASSERT_TRUE(got.ok());
    ExpectSameSelection(*got, Host("fresh").Select(0, queries[i], 1, 100 * (i + 1) - 1, DefaultParams(), PageTable()),
                        absl::StrCat("item ", i));
  }
  EXPECT_EQ(client_->ServerInfo()->live_sequences(), 1u);
}

TEST_F(BatchTest, TooManyItemsRefusesEveryItem) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  v1::BatchRequest batch;
  std::vector<float> q;
  for (int i = 0; i < 17; ++i) *batch.add_items() = RandomSelect("a", 0, 1, 1, &q);  // max 16
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->results_size(), 17);
  for (const auto& item : r->results()) {
    EXPECT_EQ(client::ItemStatus(item).code(), absl::StatusCode::kInvalidArgument);
  }
  // An empty batch is answered with no results.
  r = client_->Batch(v1::BatchRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->results_size(), 0);
}

TEST_F(BatchTest, StreamAnswersInOrderAndEqualsUnaryCalls) {
  // Two identical sets of sequences: "s*" driven over the stream, "u*" by unary calls with the
  // same keys and queries. Every answer must be the same, and equal the reference.
  for (const char* id : {"s0", "s1", "u0", "u1"}) (void)Host(id);
  std::vector<float> prefill0 = IntValues(rng_, 200 * layers() * head_dim());
  std::vector<float> prefill1 = IntValues(rng_, 5 * layers() * head_dim());
  for (const auto& [id, keys] : std::vector<std::pair<std::string, std::vector<float>*>>{
           {"s0", &prefill0}, {"u0", &prefill0}, {"s1", &prefill1}, {"u1", &prefill1}}) {
    ASSERT_TRUE(client_->AppendKeys(client::MakeAppendAllLayers(id, *keys)).ok());
    Host(id).AppendAllLayers(*keys);
  }

  constexpr int kSteps = 6;
  std::vector<v1::BatchRequest> requests;
  std::vector<std::vector<std::pair<std::vector<float>, std::vector<float>>>> inputs;  // key, q
  for (int step = 0; step < kSteps; ++step) {
    v1::BatchRequest req;
    req.set_request_id(1000 + step * 7);
    inputs.emplace_back();
    for (int s = 0; s < 2; ++s) {
      std::vector<float> key, q;
      *req.add_items() = DecodeItem(absl::StrCat("s", s), step % 2, 3, &key, &q);
      inputs.back().emplace_back(key, q);
    }
    requests.push_back(req);
  }

  // Write everything first, then read: answers come back in order.
  std::unique_ptr<client::BatchStream> stream = client_->OpenBatchStream();
  for (const v1::BatchRequest& req : requests) ASSERT_TRUE(stream->Write(req));
  ASSERT_TRUE(stream->WritesDone());
  std::vector<v1::BatchResponse> answers(kSteps);
  for (int step = 0; step < kSteps; ++step) ASSERT_TRUE(stream->Read(&answers[step])) << step;
  v1::BatchResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  ASSERT_TRUE(stream->Finish().ok());

  for (int step = 0; step < kSteps; ++step) {
    EXPECT_EQ(answers[step].request_id(), requests[step].request_id());
    ASSERT_EQ(answers[step].results_size(), 2);
    for (int s = 0; s < 2; ++s) {
      const std::string where = absl::StrCat("step ", step, " sequence ", s);
      ASSERT_TRUE(client::ItemStatus(answers[step].results(s)).ok()) << where;
      absl::StatusOr<Selection> streamed = client::ParseSelection(answers[step].results(s).result());
      ASSERT_TRUE(streamed.ok());
      // The same step by a unary call on the twin sequence.
      const auto& [key, q] = inputs[step][s];
      const std::string twin = absl::StrCat("u", s);
      v1::SelectBlocksRequest unary = client::MakeSelect(twin, step % 2, 3, q);
      *unary.mutable_append() = client::MakeAppendAllLayers("", key);
      absl::StatusOr<Selection> direct = client_->Select(unary);
      ASSERT_TRUE(direct.ok()) << direct.status();
      ExpectSameSelection(*streamed, *direct, where + " stream vs unary");
      EXPECT_EQ(streamed->lengths, direct->lengths);
      Host(twin).AppendAllLayers(key);
      const int64_t len = Host(twin).length(0);
      ExpectSameSelection(*direct, Host(twin).Select(step % 2, q, 3, len - 1, DefaultParams(), PageTable()),
                          where + " vs reference");
    }
  }
}

// Many requests in flight on one stream, more than the server keeps unanswered at once
// (BatchStreamReactor::kMaxInFlight): requests on different sequences run side by side,
// requests naming a sequence an earlier one names apply after it, and every answer comes back in
// order and equals the reference applied in request order.
TEST_F(BatchTest, PipelinedStreamRequestsApplyInOrderPerSequenceAndAnswerInOrder) {
  const std::vector<std::string> ids = {"x", "y", "z"};
  for (const std::string& id : ids) {
    std::vector<float> prefill = IntValues(rng_, 130 * layers() * head_dim());
    ASSERT_TRUE(client_->AppendKeys(client::MakeAppendAllLayers(id, prefill)).ok());
    Host(id).AppendAllLayers(prefill);
  }
  // Request i names ids[i % 3], and every fourth request names all three.
  constexpr int kRequests = 20;
  struct Item {
    std::string id;
    std::vector<float> key, q;
  };
  std::vector<std::vector<Item>> items(kRequests);
  std::unique_ptr<client::BatchStream> stream = client_->OpenBatchStream();
  for (int i = 0; i < kRequests; ++i) {
    v1::BatchRequest req;
    req.set_request_id(500 + i);
    const std::vector<std::string> named =
        i % 4 == 3 ? ids : std::vector<std::string>{ids[i % 3]};
    for (const std::string& id : named) {
      Item& it = items[i].emplace_back();
      it.id = id;
      *req.add_items() = DecodeItem(id, 0, 2, &it.key, &it.q);
    }
    ASSERT_TRUE(stream->Write(req)) << i;
  }
  ASSERT_TRUE(stream->WritesDone());
  for (int i = 0; i < kRequests; ++i) {
    v1::BatchResponse answer;
    ASSERT_TRUE(stream->Read(&answer)) << i;
    ASSERT_EQ(answer.request_id(), static_cast<uint64_t>(500 + i));
    ASSERT_EQ(answer.results_size(), static_cast<int>(items[i].size()));
    for (size_t k = 0; k < items[i].size(); ++k) {
      const Item& it = items[i][k];
      const std::string where = absl::StrCat("request ", i, " item ", k, " (", it.id, ")");
      ASSERT_TRUE(client::ItemStatus(answer.results(static_cast<int>(k))).ok()) << where;
      absl::StatusOr<Selection> got = client::ParseSelection(answer.results(static_cast<int>(k)).result());
      ASSERT_TRUE(got.ok()) << where;
      Host(it.id).AppendAllLayers(it.key);
      const int64_t len = Host(it.id).length(0);
      EXPECT_EQ(static_cast<int64_t>(got->lengths[0]), len) << where;
      ExpectSameSelection(*got, Host(it.id).Select(0, it.q, 2, len - 1, DefaultParams(), PageTable()),
                          where);
    }
  }
  v1::BatchResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  ASSERT_TRUE(stream->Finish().ok());
}

TEST_F(BatchTest, StreamStepsAndItemErrorsKeepTheStreamOpen) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 40));
  std::unique_ptr<client::BatchStream> stream = client_->OpenBatchStream();
  for (int i = 0; i < 5; ++i) {
    v1::BatchRequest req;
    req.set_request_id(i);
    std::vector<float> q;
    *req.add_items() = RandomSelect(i % 2 ? "nope" : "a", 0, 1, 1, &q);
    absl::StatusOr<v1::BatchResponse> r = stream->Step(req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->request_id(), static_cast<uint64_t>(i));
    ASSERT_EQ(r->results_size(), 1);
    EXPECT_EQ(client::ItemStatus(r->results(0)).code(),
              i % 2 ? absl::StatusCode::kNotFound : absl::StatusCode::kOk);
  }
  EXPECT_TRUE(stream->Finish().ok());
  // A stream dropped without Finish is cancelled cleanly.
  std::unique_ptr<client::BatchStream> dropped = client_->OpenBatchStream();
  v1::BatchRequest req;
  ASSERT_TRUE(dropped->Step(req).ok());
  dropped.reset();
  EXPECT_TRUE(client_->ServerInfo().ok());
}

TEST_F(BatchTest, ConcurrentClientsGetCorrectAnswers) {
  // Four threads, each running decode steps on its own sequence through the shared client.
  constexpr int kThreads = 4;
  std::vector<std::vector<float>> prefill(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    prefill[t] = IntValues(rng_, 300 * head_dim());
    ASSERT_TRUE(client_->AppendKeys(client::MakeAppend(absl::StrCat("c", t), 0, prefill[t])).ok());
  }
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      HostSequence host(layers(), head_dim());
      host.Append(0, prefill[t]);
      const std::string id = absl::StrCat("c", t);
      for (int step = 0; step < 20 && failures[t].empty(); ++step) {
        const std::vector<float> q = IntValues(rng, 2 * head_dim());
        const std::vector<float> key = IntValues(rng, head_dim());
        v1::SelectBlocksRequest req = client::MakeSelect(id, 0, 2, q);
        *req.mutable_append() = client::MakeAppend("", 0, key);
        absl::StatusOr<Selection> got = client_->Select(req);
        if (!got.ok()) {
          failures[t] = got.status().ToString();
          break;
        }
        host.Append(0, key);
        const Selection want = host.Select(0, q, 2, host.length(0) - 1, DefaultParams(), PageTable());
        if (got->block_ids != want.block_ids) failures[t] = absl::StrCat("step ", step, " differs");
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}

}  // namespace
}  // namespace indexer::testing
