// ReleaseSequence, TruncateSequence, ForkSequence and GetSequence end to end, including
// ALREADY_EXISTS / NOT_FOUND, page accounting and copy-on-write seen through selections.
#include "absl/strings/str_cat.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

class SequenceTest : public ServerTest {
 protected:
  // Selects the last `tokens` positions of `id` (every head) and compares with the reference.
  void ExpectSelectsLikeHost(const std::string& id, int layer, int tokens, const std::string& where) {
    std::vector<float> q;
    v1::SelectBlocksRequest req = RandomSelect(id, layer, 2, tokens, &q);
    req.set_topk(5);
    absl::StatusOr<Selection> got = client_->Select(req);
    ASSERT_TRUE(got.ok()) << where << ": " << got.status();
    ExpectSameSelection(*got, Host(id).Select(layer, q, 2, Host(id).length(layer) - tokens,
                                              Params(5, 0, 1), PageTable()),
                        where);
  }
};

TEST_F(SequenceTest, GetDescribesTheSequence) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 260, {30, 31, 32}));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 1, 10));
  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sequence_id(), "a");
  EXPECT_EQ(Lengths(g->lengths()), (std::vector<uint32_t>{260, 10}));
  ASSERT_EQ(g->pages_size(), 3);
  for (int32_t p : g->pages()) EXPECT_TRUE(p >= 0 && p < options_.engine.capacity_pages) << p;
  EXPECT_EQ(std::vector<int32_t>(g->attention_pages().begin(), g->attention_pages().end()),
            (std::vector<int32_t>{30, 31, 32}));
  EXPECT_EQ(g->shared_pages(), 0u);
  EXPECT_EQ(client_->GetSequence("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetSequence("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SequenceTest, ReleaseFreesPagesAndForgetsTheSequence) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 10));
  absl::StatusOr<v1::ReleaseSequenceResponse> r = client_->ReleaseSequence("a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->pages_freed(), 3u);
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages - 1);
  EXPECT_EQ(client_->ServerInfo()->live_sequences(), 1u);
  EXPECT_EQ(client_->GetSequence("a").status().code(), absl::StatusCode::kNotFound);
  std::vector<float> q;
  EXPECT_EQ(client_->SelectBlocks(RandomSelect("a", 0, 1, 1, &q)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ReleaseSequence("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ReleaseSequence("").status().code(), absl::StatusCode::kInvalidArgument);
  // The id can be used again: a fresh sequence.
  absl::StatusOr<v1::AppendKeysResponse> again =
      client_->AppendKeys(client::MakeAppend("a", 1, IntValues(rng_, 5 * head_dim())));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->created());
  EXPECT_EQ(Lengths(again->lengths()), (std::vector<uint32_t>{0, 5}));
  // b was untouched.
  EXPECT_EQ(client_->GetSequence("b")->lengths(0), 10u);
}

TEST_F(SequenceTest, TruncateRollsBackTokensAndPages) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 500, {1, 2, 3, 4}));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 1, 200));
  const int64_t free_before = FreePages();
  absl::StatusOr<v1::TruncateSequenceResponse> t = client_->TruncateSequence("a", 250);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Lengths(t->lengths()), (std::vector<uint32_t>{250, 200}));
  EXPECT_EQ(t->num_blocks(), 2u);
  EXPECT_EQ(t->pages_freed(), 2u);
  EXPECT_EQ(FreePages(), free_before + 2);
  Host("a").Truncate(250);
  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("a");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->pages_size(), 2);
  EXPECT_EQ(std::vector<int32_t>(g->attention_pages().begin(), g->attention_pages().end()),
            (std::vector<int32_t>{1, 2}));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("a", 0, 3, "after truncate"));

  // New keys overwrite the rolled-back positions; the block reopened needs an attention page.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 6));          // 250 -> 256 fills block 1
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 44, {77}));   // 256 -> 300 opens block 2
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("a", 0, 60, "after re-append"));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("a", 1, 1, "layer 1"));

  // Truncating to more than the length changes nothing; to 0 keeps the (empty) sequence.
  t = client_->TruncateSequence("a", 4000);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(Lengths(t->lengths()), (std::vector<uint32_t>{300, 200}));
  EXPECT_EQ(t->pages_freed(), 0u);
  t = client_->TruncateSequence("a", 0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(Lengths(t->lengths()), (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(t->num_blocks(), 0u);
  EXPECT_EQ(t->pages_freed(), 3u);
  EXPECT_TRUE(client_->GetSequence("a").ok());

  EXPECT_EQ(client_->TruncateSequence("nope", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->TruncateSequence("", 1).status().code(), absl::StatusCode::kInvalidArgument);
  // Every layer keeps min(its length, length): even past max_tokens_per_sequence, a no-op.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 1, 30));
  t = client_->TruncateSequence("b", 0xffffffffu);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Lengths(t->lengths()), (std::vector<uint32_t>{0, 30}));
  EXPECT_EQ(t->pages_freed(), 0u);
}

TEST_F(SequenceTest, ForkSharesPagesAndCopiesOnWrite) {
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("src", 300, {10, 11, 12}));
  const int64_t free_before = FreePages();

  absl::StatusOr<v1::ForkSequenceResponse> f = client_->ForkSequence("src", "full");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Lengths(f->lengths()), (std::vector<uint32_t>{300, 300}));
  EXPECT_EQ(f->num_blocks(), 3u);
  EXPECT_EQ(f->pages_shared(), 3u);
  EXPECT_EQ(FreePages(), free_before);  // nothing copied
  hosts_.emplace("full", Host("src"));

  f = client_->ForkSequence("src", "part", 130u);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Lengths(f->lengths()), (std::vector<uint32_t>{130, 130}));
  EXPECT_EQ(f->num_blocks(), 2u);
  hosts_.emplace("part", Host("src"));
  Host("part").Truncate(130);

  absl::StatusOr<v1::GetSequenceResponse> g = client_->GetSequence("src");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->shared_pages(), 3u);
  absl::StatusOr<v1::GetSequenceResponse> gp = client_->GetSequence("part");
  ASSERT_TRUE(gp.ok());
  EXPECT_EQ(gp->pages(0), g->pages(0));
  EXPECT_EQ(gp->pages(1), g->pages(1));
  EXPECT_EQ(std::vector<int32_t>(gp->attention_pages().begin(), gp->attention_pages().end()),
            (std::vector<int32_t>{10, 11}));

  // Writing into the shared, partly filled block 1 of "part" copies it first: the source and
  // the full fork still answer from their own keys.
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("part", 50));
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("full", 10));  // block 2, shared with src
  ASSERT_NO_FATAL_FAILURE(AppendRandomAllLayers("src", 100, {13}));
  for (const char* id : {"src", "full", "part"}) {
    for (int layer = 0; layer < layers(); ++layer) {
      ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost(id, layer, 150, absl::StrCat(id, " layer ", layer)));
    }
  }
  EXPECT_NE(client_->GetSequence("part")->pages(1), client_->GetSequence("src")->pages(1));

  // Releasing the source keeps the forks' shared pages alive.
  absl::StatusOr<v1::ReleaseSequenceResponse> r = client_->ReleaseSequence("src");
  ASSERT_TRUE(r.ok());
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("full", 0, 10, "full after the source's release"));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("part", 1, 10, "part after the source's release"));
  ASSERT_TRUE(client_->ReleaseSequence("full").ok());
  ASSERT_TRUE(client_->ReleaseSequence("part").ok());
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages);
}

TEST_F(SequenceTest, TruncateThenAppendCopiesPagesSharedWithAFork) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("src", 0, 300));
  ASSERT_TRUE(client_->ForkSequence("src", "fork").ok());
  hosts_.emplace("fork", Host("src"));
  // Both roll back into block 1 (shared) and write different keys there.
  for (const char* id : {"src", "fork"}) {
    ASSERT_TRUE(client_->TruncateSequence(id, 200).ok());
    Host(id).Truncate(200);
  }
  ASSERT_NO_FATAL_FAILURE(AppendRandom("src", 0, 40));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("fork", 0, 20));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("src", 0, 140, "source"));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("fork", 0, 120, "fork"));
  EXPECT_EQ(client_->GetSequence("src")->pages(0), client_->GetSequence("fork")->pages(0));
  EXPECT_NE(client_->GetSequence("src")->pages(1), client_->GetSequence("fork")->pages(1));
  ASSERT_TRUE(client_->ReleaseSequence("src").ok());
  ASSERT_TRUE(client_->ReleaseSequence("fork").ok());
  EXPECT_EQ(FreePages(), options_.engine.capacity_pages);
}

TEST_F(SequenceTest, ForkErrors) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("src", 0, 100));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("taken", 0, 10));
  const int64_t free_before = FreePages();
  absl::StatusOr<v1::ForkSequenceResponse> f = client_->ForkSequence("src", "taken");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAlreadyExists) << f.status();
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("taken"));
  EXPECT_EQ(client_->GetSequence("taken")->lengths(0), 10u);
  EXPECT_EQ(client_->GetSequence("src")->shared_pages(), 0u);
  EXPECT_EQ(FreePages(), free_before);

  EXPECT_EQ(client_->ForkSequence("nope", "new").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetSequence("new").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ForkSequence("src", "src").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->ForkSequence("src", "").status().code(), absl::StatusCode::kInvalidArgument);
  // A length past the source's keeps all of it (min(its length, length)).
  f = client_->ForkSequence("src", "long", 0xffffffffu);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Lengths(f->lengths()), (std::vector<uint32_t>{100, 0}));
  EXPECT_EQ(f->pages_shared(), 1u);
  // A fork of length 0 is an empty sequence that can grow.
  f = client_->ForkSequence("src", "empty", 0u);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks(), 0u);
  ASSERT_NO_FATAL_FAILURE(AppendRandom("empty", 0, 3));
  ASSERT_NO_FATAL_FAILURE(ExpectSelectsLikeHost("empty", 0, 1, "grown empty fork"));
}

class TenantSequenceLimitTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.engine.tenant_max_sequences = 2;
    ServerTest::SetUp();
  }
};

// --tenant_max_sequences counts the caller's tenant (here the default one) like max_sequences
// counts everyone: appends and forks that would create one more are refused naming the limit,
// and apply nothing.
TEST_F(TenantSequenceLimitTest, CreatingPastTheLimitIsRefusedNamingIt) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  ASSERT_TRUE(client_->ForkSequence("a", "b", 0).ok()) << "a zero-page fork counts too";
  const int64_t free_before = FreePages();
  std::vector<float> keys = IntValues(rng_, 10 * head_dim());
  const absl::Status append = client_->AppendKeys(client::MakeAppend("c", 0, keys)).status();
  EXPECT_EQ(append.code(), absl::StatusCode::kResourceExhausted) << append;
  EXPECT_THAT(std::string(append.message()), HasSubstr("tenant_max_sequences 2"));
  const absl::Status fork = client_->ForkSequence("a", "d").status();
  EXPECT_EQ(fork.code(), absl::StatusCode::kResourceExhausted) << fork;
  EXPECT_THAT(std::string(fork.message()), HasSubstr("tenant_max_sequences"));
  EXPECT_EQ(client_->GetSequence("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), free_before);
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tenant_sequences(), 2u);
  EXPECT_EQ(info->tenant_max_sequences(), 2u);
  // Appending to a sequence it holds is fine; releasing one makes room.
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 10));
  ASSERT_TRUE(client_->ReleaseSequence("b").ok());
  EXPECT_TRUE(client_->AppendKeys(client::MakeAppend("c", 0, keys)).ok());
}

}  // namespace
}  // namespace indexer::testing
