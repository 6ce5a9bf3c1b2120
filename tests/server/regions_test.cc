// Tensors by reference end to end: regions registered, listed and unregistered over gRPC, keys,
// queries and outputs in a region answering exactly what inline bytes answer (and what the
// reference selects), and every reference that does not resolve failing its item alone with
// nothing of it applied.
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/cpp/shared_memory.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::SharedMemoryRegion;
using ::testing::HasSubstr;

class RegionsTest : public ServerTest {
 protected:
  // A fresh shared memory object of `bytes`, registered whole as `name`.
  void Register(const std::string& name, size_t bytes) {
    absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> shm = SharedMemoryRegion::Create(
        absl::StrCat("/indexer-regions-test-", ::getpid(), "-", ++objects_), bytes);
    ASSERT_TRUE(shm.ok()) << shm.status();
    ASSERT_TRUE(client_->RegisterSystemRegion(name, (*shm)->key(), 0, bytes).ok());
    shm_ = *std::move(shm);
  }
  // Writes `bytes` at the region's cursor (4-byte aligned) and returns its reference.
  v1::RegionRef Put(const std::string& bytes) {
    absl::StatusOr<v1::RegionRef> ref = shm_->Write("r", cursor_, bytes);
    EXPECT_TRUE(ref.ok()) << ref.status();
    cursor_ += (bytes.size() + 3) / 4 * 4;
    return ref.ok() ? *ref : v1::RegionRef();
  }
  // Room for `values` int32 outputs at the cursor.
  v1::RegionRef Room(size_t values) {
    v1::RegionRef ref = SharedMemoryRegion::Ref("r", cursor_, values * sizeof(int32_t));
    cursor_ += values * sizeof(int32_t);
    return ref;
  }
  const int32_t* At(const v1::RegionRef& ref) const {
    return reinterpret_cast<const int32_t*>(shm_->data() + ref.offset());
  }
  // The request with its keys and queries moved into the region, and outputs asked there.
  v1::SelectBlocksRequest ByReference(v1::SelectBlocksRequest r, bool outputs) {
    if (r.has_append()) {
      *r.mutable_append()->mutable_keys_ref() = Put(r.append().keys());
      r.mutable_append()->clear_keys();
    }
    const int64_t rows = int64_t{r.num_tokens()} * r.num_heads();
    const int64_t topk = r.has_topk() ? r.topk() : options_.engine.defaults.topk;
    *r.mutable_queries_ref() = Put(r.queries());
    r.clear_queries();
    if (outputs) {
      v1::SelectOutputRefs* o = r.mutable_output_refs();
      *o->mutable_block_ids() = Room(rows * topk);
      *o->mutable_page_table() = Room(rows * topk * PageTable().pages_per_block);
      *o->mutable_context_lens() = Room(rows);
    }
    return r;
  }
  absl::StatusOr<Selection> Parse(const v1::SelectBlocksRequest& asked,
                                  const v1::SelectBlocksResponse& r) const {
    if (!asked.has_output_refs()) return client::ParseSelection(r);
    const v1::SelectOutputRefs& o = asked.output_refs();
    return client::ParseSelection(
        r, client::OutputsInMemory{At(o.block_ids()), At(o.page_table()), At(o.context_lens())});
  }

  std::unique_ptr<SharedMemoryRegion> shm_;
  uint64_t cursor_ = 0;
  int objects_ = 0;
};

TEST_F(RegionsTest, RegisterListAndUnregister) {
  ASSERT_NO_FATAL_FAILURE(Register("r", 1 << 16));
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->max_regions(), static_cast<uint32_t>(options_.max_regions));
  absl::StatusOr<v1::ListRegionsResponse> listed = client_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->regions_size(), 1);
  EXPECT_EQ(listed->regions(0).name(), "r");
  EXPECT_EQ(listed->regions(0).kind(), "system");
  EXPECT_EQ(listed->regions(0).key(), shm_->key());
  EXPECT_EQ(listed->regions(0).byte_size(), 1u << 16);

  EXPECT_EQ(client_->RegisterSystemRegion("r", shm_->key(), 0, 16).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->RegisterSystemRegion("x", "/indexer-no-such-object", 0, 16).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->RegisterSystemRegion("x", "no-slash", 0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status past = client_->RegisterSystemRegion("x", shm_->key(), 1 << 15, 1 << 16);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.message(), HasSubstr("past the end"));

  EXPECT_EQ(*client_->UnregisterRegion("r"), 1u);
  EXPECT_EQ(client_->ListRegions("r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->UnregisterRegion("r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*client_->UnregisterRegion(""), 0u);
}

TEST_F(RegionsTest, AServerWithoutRegionsSaysSo) {
  options_.max_regions = 0;
  Restart();
  absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> shm =
      SharedMemoryRegion::Create(absl::StrCat("/indexer-regions-off-", ::getpid()), 64);
  ASSERT_TRUE(shm.ok());
  const absl::Status s = client_->RegisterSystemRegion("r", (*shm)->key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("max_regions=0"));
}

TEST_F(RegionsTest, ACpuServerTakesNoCudaRegions) {
  const absl::Status s = client_->RegisterCudaRegion("c", std::string(64, '\0'), 0, 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("takes no CUDA regions"));
  EXPECT_EQ(client_->ListRegions()->regions_size(), 0);
}

// Keys, queries and outputs by reference answer what inline bytes answer, and what the reference
// selects, with attention pages (so every output is written) and without.
TEST_F(RegionsTest, ByReferenceAnswersEqualInline) {
  ASSERT_NO_FATAL_FAILURE(Register("r", 8 << 20));
  for (const bool attn : {false, true}) {
    const std::string id = attn ? "with-pages" : "plain";
    const int tokens = 700;
    const std::vector<float> keys = IntValues(rng_, size_t{tokens} * head_dim());
    v1::AppendKeysRequest append = client::MakeAppend(id, 0, tokens, keys);
    if (attn) {
      for (int b = 0; b < 6; ++b) append.add_attention_pages(100 + b);
    }
    v1::AppendKeysRequest by_ref = append;
    *by_ref.mutable_keys_ref() = Put(append.keys());
    by_ref.clear_keys();
    absl::StatusOr<v1::AppendKeysResponse> appended = client_->AppendKeys(by_ref);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_EQ(appended->lengths(0), static_cast<uint32_t>(tokens));
    Host(id).Append(0, keys);
    if (attn) Host(id).attention_pages = {100, 101, 102, 103, 104, 105};

    for (const int heads : {1, 3}) {
      std::vector<float> q;
      v1::SelectBlocksRequest inline_request = RandomSelect(id, 0, heads, 4, &q);
      inline_request.set_topk(5);
      kernels::SelectParams p = DefaultParams();
      p.topk = 5;
      const std::string where = absl::StrCat(id, " H ", heads);
      absl::StatusOr<v1::SelectBlocksResponse> inline_answer = client_->SelectBlocks(inline_request);
      ASSERT_TRUE(inline_answer.ok()) << inline_answer.status();
      absl::StatusOr<Selection> want = client::ParseSelection(*inline_answer);
      ASSERT_TRUE(want.ok());
      ExpectSameSelection(*want, Host(id).Select(0, q, heads, tokens - 4, p, PageTable()), where);
      EXPECT_EQ(want->has_page_table(), attn);
      for (const bool outputs : {false, true}) {
        const v1::SelectBlocksRequest asked = ByReference(inline_request, outputs);
        absl::StatusOr<v1::SelectBlocksResponse> got = client_->SelectBlocks(asked);
        ASSERT_TRUE(got.ok()) << where << ": " << got.status();
        EXPECT_EQ(got->block_ids().empty(), outputs) << "outputs in a region are not sent";
        absl::StatusOr<Selection> parsed = Parse(asked, *got);
        ASSERT_TRUE(parsed.ok()) << parsed.status();
        ExpectSameSelection(*parsed, *want, absl::StrCat(where, outputs ? " outputs" : ""));
      }
    }
  }
}

// In a Batch, an item whose reference does not resolve fails alone, and its append is not
// applied; the other items, inline or by reference, are answered.
TEST_F(RegionsTest, ABadReferenceFailsItsItemAlone) {
  ASSERT_NO_FATAL_FAILURE(Register("r", 1 << 20));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  std::vector<float> q;
  v1::BatchRequest batch;
  *batch.add_items() = ByReference(RandomSelect("a", 0, 2, 1, &q), true);  // 0: OK

  v1::SelectBlocksRequest past = RandomSelect("b", 0, 1, 1, &q);          // 1: past the end
  *past.mutable_append() = client::MakeAppend("", 0, 1, IntValues(rng_, head_dim()));
  past = ByReference(past, false);
  past.mutable_append()->mutable_keys_ref()->set_offset(shm_->size() - 2);
  *batch.add_items() = past;

  v1::SelectBlocksRequest unknown = ByReference(RandomSelect("a", 0, 1, 1, &q), false);  // 2
  unknown.mutable_queries_ref()->set_region("nope");
  *batch.add_items() = unknown;

  v1::SelectBlocksRequest both = RandomSelect("a", 0, 1, 1, &q);          // 3: ref and bytes
  *both.mutable_queries_ref() = Put(both.queries());
  *batch.add_items() = both;

  v1::SelectBlocksRequest small = ByReference(RandomSelect("a", 0, 2, 1, &q), true);  // 4
  small.mutable_output_refs()->mutable_block_ids()->set_byte_size(4);
  *batch.add_items() = small;

  v1::SelectBlocksRequest overlap = ByReference(RandomSelect("a", 0, 1, 1, &q), true);  // 5
  *overlap.mutable_output_refs()->mutable_context_lens() = overlap.queries_ref();
  *batch.add_items() = overlap;

  *batch.add_items() = RandomSelect("a", 0, 1, 1, &q);                    // 6: inline, OK

  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->results_size(), 7);
  const absl::StatusCode want[] = {
      absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
      absl::StatusCode::kInvalidArgument, absl::StatusCode::kInvalidArgument,
      absl::StatusCode::kInvalidArgument, absl::StatusCode::kOk};
  const char* says[] = {"", "keys_ref", "queries_ref", "both set", "block_ids", "overlaps", ""};
  for (int i = 0; i < 7; ++i) {
    const absl::Status s = client::ItemStatus(r->results(i));
    EXPECT_EQ(s.code(), want[i]) << "item " << i << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(says[i])) << i;
  }
  EXPECT_EQ(client_->GetSequence("b").status().code(), absl::StatusCode::kNotFound)
      << "the refused item's append was applied";
  absl::StatusOr<Selection> first = Parse(batch.items(0), r->results(0).result());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->num_heads, 2);
}

// A unary call whose reference does not resolve fails with its status, applying nothing.
TEST_F(RegionsTest, AUnaryCallWithABadReferenceAppliesNothing) {
  ASSERT_NO_FATAL_FAILURE(Register("r", 1 << 16));
  v1::AppendKeysRequest append = client::MakeAppend("x", 0, 4, IntValues(rng_, 4 * head_dim()));
  *append.mutable_keys_ref() = Put(append.keys());
  append.clear_keys();
  append.mutable_keys_ref()->set_region("gone");
  EXPECT_EQ(client_->AppendKeys(append).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetSequence("x").status().code(), absl::StatusCode::kNotFound);

  ASSERT_NO_FATAL_FAILURE(AppendRandom("y", 0, 10));
  std::vector<float> q;
  v1::SelectBlocksRequest select = RandomSelect("y", 0, 1, 1, &q);
  *select.mutable_append() = client::MakeAppend("", 0, 1, IntValues(rng_, head_dim()));
  select = ByReference(select, true);
  select.mutable_output_refs()->mutable_block_ids()->set_offset(shm_->size());
  const absl::Status s = client_->SelectBlocks(select).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  absl::StatusOr<v1::GetSequenceResponse> y = client_->GetSequence("y");
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->lengths(0), 10u) << "the refused selection's append was applied";
}

}  // namespace
}  // namespace indexer::testing
