// StepAnswer against protobuf's serializer, the reference: for random answers (selections with
// and without page tables, append-only items, failed items that had outputs, large values), the
// bytes it writes are those of the same message serialized by protobuf, and parse back to it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "indexer/v1/indexer.pb.h"
#include "server/step_answer.h"
#include "tests/testing/test_seed.h"

namespace indexer::server {
namespace {

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

class Random {
 public:
  explicit Random(uint64_t seed) : rng_(seed) {}
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  int64_t Below(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng_); }
  // Mostly small, sometimes needing every varint byte, sometimes 0 (left out of the bytes).
  int64_t Value() { return Coin(0.2) ? 0 : Coin(0.8) ? Below(300) : Below(int64_t{1} << 31); }
  int32_t Int32() { return static_cast<int32_t>(rng_()); }

 private:
  std::mt19937_64 rng_;
};

// Fills item `i` of `answer` at random and the same into `expected`; true when the item
// succeeded, else its status is *failure.
bool FillItem(Random& r, size_t i, int pages_per_block, StepAnswer* answer,
              v1::SelectBlocksResponse* expected, absl::Status* failure) {
  engine::StepResult result;
  result.num_tokens = static_cast<int>(r.Value());
  result.num_heads = static_cast<int>(r.Value());
  result.topk = static_cast<int>(r.Value());
  result.start_position = r.Coin(0.1) ? (int64_t{1} << 40) : r.Value();
  result.has_page_table = r.Coin();
  result.num_blocks = r.Value();
  result.created = r.Coin();
  const bool selects = r.Coin(0.8);
  engine::SelectShape shape;
  if (selects) {
    shape.block_ids = r.Below(40);
    if (result.has_page_table) {
      shape.page_table = r.Coin(0.8) ? r.Below(80) : 0;  // 0: written to a region instead
      shape.context_lens = r.Below(10);
    }
    const engine::SelectOutputs out = answer->Allocate(i, shape);
    for (int64_t v = 0; v < shape.block_ids; ++v) {
      EXPECT_EQ(out.block_ids[v], 0) << "output memory starts zeroed";
      out.block_ids[v] = r.Int32();
      expected->mutable_block_ids()->append(reinterpret_cast<const char*>(&out.block_ids[v]), 4);
    }
    for (int64_t v = 0; v < shape.page_table; ++v) {
      out.page_table[v] = r.Int32();
      expected->mutable_page_table()->append(reinterpret_cast<const char*>(&out.page_table[v]), 4);
    }
    for (int64_t v = 0; v < shape.context_lens; ++v) {
      out.context_lens[v] = r.Int32();
      expected->mutable_context_lens()->append(reinterpret_cast<const char*>(&out.context_lens[v]),
                                               4);
    }
  }
  std::vector<int64_t> lengths(r.Below(4));
  for (int64_t& l : lengths) l = r.Value();
  if (!lengths.empty() || r.Coin()) answer->KeepLengths(i, lengths);
  for (int64_t l : lengths) expected->add_lengths(static_cast<uint32_t>(l));
  if (r.Coin(0.25)) {
    const absl::Status status(static_cast<absl::StatusCode>(1 + r.Below(15)),
                              r.Coin() ? "sequence 'é' failed" : "");
    answer->Failed(i, status);
    *failure = status;
    expected->Clear();
    return false;
  }
  answer->Succeeded(i, result, pages_per_block);
  if (!selects) {
    result.num_tokens = result.num_heads = result.topk = 0;
    result.start_position = 0;
    result.has_page_table = false;
    answer->Succeeded(i, result, pages_per_block);  // the last call counts
  }
  expected->set_num_tokens(result.num_tokens);
  expected->set_num_heads(result.num_heads);
  expected->set_topk(result.topk);
  expected->set_start_position(result.start_position);
  if (result.has_page_table) expected->set_pages_per_block(pages_per_block);
  return true;
}

TEST(StepAnswer, BatchAnswersAreTheBytesProtobufWrites) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(::testing::Message() << "INDEXER_TEST_SEED=" << seed);
  Random r(seed);
  for (int round = 0; round < 300; ++round) {
    const size_t items = static_cast<size_t>(r.Below(12));
    const uint64_t request_id = static_cast<uint64_t>(r.Value());
    StepAnswer answer(StepMessage::kBatch, items, request_id, 64);
    v1::BatchResponse expected;
    expected.set_request_id(request_id);
    for (size_t i = 0; i < items; ++i) {
      v1::BatchItemResult* out = expected.add_results();
      absl::Status failure;
      v1::SelectBlocksResponse select;
      if (FillItem(r, i, 1 + static_cast<int>(r.Below(8)), &answer, &select, &failure)) {
        *out->mutable_result() = select;
      } else {
        out->set_code(static_cast<int>(failure.code()));
        out->set_message(std::string(failure.message()));
      }
    }
    grpc::ByteBuffer written;
    answer.Write(&written);
    EXPECT_EQ(Bytes(written), expected.SerializeAsString()) << "round " << round;
    v1::BatchResponse parsed;
    EXPECT_TRUE(parsed.ParseFromString(Bytes(written))) << "round " << round;
  }
}

TEST(StepAnswer, UnaryAnswersAreTheBytesProtobufWrites) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(::testing::Message() << "INDEXER_TEST_SEED=" << seed);
  Random r(seed);
  int checked = 0;
  for (int round = 0; round < 300; ++round) {
    StepAnswer select(StepMessage::kSelectBlocks, 1, 0, 64);
    v1::SelectBlocksResponse expected;
    absl::Status failure;
    if (FillItem(r, 0, 4, &select, &expected, &failure)) {
      grpc::ByteBuffer written;
      select.Write(&written);
      EXPECT_EQ(Bytes(written), expected.SerializeAsString()) << "round " << round;
      ++checked;
    }

    StepAnswer append(StepMessage::kAppendKeys, 1, 0, 64);
    engine::StepResult result;
    result.num_blocks = r.Value();
    result.created = r.Coin();
    std::vector<int64_t> lengths(r.Below(4));
    for (int64_t& l : lengths) l = r.Value();
    append.KeepLengths(0, lengths);
    append.Succeeded(0, result, 4);
    v1::AppendKeysResponse want;
    for (int64_t l : lengths) want.add_lengths(static_cast<uint32_t>(l));
    want.set_num_blocks(static_cast<uint32_t>(result.num_blocks));
    want.set_created(result.created);
    grpc::ByteBuffer written;
    append.Write(&written);
    EXPECT_EQ(Bytes(written), want.SerializeAsString()) << "round " << round;
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace indexer::server
