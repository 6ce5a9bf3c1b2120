// CUDA regions end to end: this process allocates GPU memory, shares it by its CUDA IPC handle
// with an indexer-server child on the CUDA backend (a handle cannot be opened by the process
// that made it), and sends keys, queries and outputs by reference. Answers equal inline ones;
// values the device copy finds not finite fail their item alone; spans whose device values need
// the exact path are run again on it; every reference and registration that cannot be served is
// refused with its reason; an allocation freed under the server does not bring it down.
#include <cuda_runtime_api.h>
#include <unistd.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/indexer_client.h"
#include "client/cpp/shared_memory.h"
#include "kernels/numeric.h"
#include "tests/testing/child_process.h"
#include "tests/testing/gpu_test.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::IndexerClient;
using client::Selection;
using ::testing::HasSubstr;

constexpr int kHeadDim = 128;
constexpr int kTopk = 4;
constexpr int kPagesPerBlock = 8;
constexpr size_t kRegionBytes = size_t{16} << 20;

#define CUDA_OK(expr)                                                  \
  do {                                                                 \
    const cudaError_t err_ = (expr);                                   \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

// Device memory of this process and its IPC handle.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess) data_ = nullptr;
    if (data_ != nullptr && cudaIpcGetMemHandle(&handle_, data_) != cudaSuccess) {
      (void)cudaFree(data_);
      data_ = nullptr;
    }
  }
  ~DeviceMemory() { Free(); }
  void Free() {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = nullptr;
  }
  bool ok() const { return data_ != nullptr; }
  char* data() const { return static_cast<char*>(data_); }
  size_t size() const { return bytes_; }
  std::string handle() const {
    return std::string(reinterpret_cast<const char*>(&handle_), sizeof(handle_));
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
  cudaIpcMemHandle_t handle_{};
};

class CudaRegionTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    int port = 0;
    server_ = StartServerBinary({"--device=cuda", "--devices=0", "--layers=1",
                                 absl::StrCat("--head_dim=", kHeadDim), "--capacity=4096",
                                 absl::StrCat("--topk=", kTopk)},
                                &port);
    ASSERT_NE(server_, nullptr);
    absl::StatusOr<std::unique_ptr<IndexerClient>> c =
        IndexerClient::Connect(absl::StrCat("127.0.0.1:", port));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    memory_ = std::make_unique<DeviceMemory>(kRegionBytes);
    ASSERT_TRUE(memory_->ok());
    ASSERT_TRUE(client_->RegisterCudaRegion("g", memory_->handle(), 0, 0, kRegionBytes).ok());
  }

  // Copies `bytes` to the region at the cursor (256-byte aligned): their reference.
  v1::RegionRef Put(const std::string& bytes) {
    v1::RegionRef ref = Room(bytes.size() / 4 + 1);
    ref.set_byte_size(bytes.size());
    EXPECT_EQ(cudaMemcpy(memory_->data() + ref.offset(), bytes.data(), bytes.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    return ref;
  }
  // Room for `values` int32 outputs at the cursor.
  v1::RegionRef Room(size_t values) {
    v1::RegionRef ref;
    ref.set_region("g");
    ref.set_offset(cursor_);
    ref.set_byte_size(values * 4);
    cursor_ = (cursor_ + values * 4 + 255) / 256 * 256;
    EXPECT_LE(cursor_, kRegionBytes);
    return ref;
  }
  std::vector<int32_t> Read(const v1::RegionRef& ref) const {
    std::vector<int32_t> out(ref.byte_size() / 4);
    EXPECT_EQ(cudaMemcpy(out.data(), memory_->data() + ref.offset(), ref.byte_size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
  // `r` with its keys and queries in the region, and its outputs asked there.
  v1::SelectBlocksRequest ByReference(v1::SelectBlocksRequest r) {
    if (r.has_append()) {
      *r.mutable_append()->mutable_keys_ref() = Put(r.append().keys());
      r.mutable_append()->clear_keys();
    }
    const size_t rows = size_t{r.num_tokens()} * r.num_heads();
    *r.mutable_queries_ref() = Put(r.queries());
    r.clear_queries();
    v1::SelectOutputRefs* o = r.mutable_output_refs();
    *o->mutable_block_ids() = Room(rows * kTopk);
    *o->mutable_page_table() = Room(rows * kTopk * kPagesPerBlock);
    *o->mutable_context_lens() = Room(rows);
    return r;
  }
  // The selection a by-reference request's answer and region outputs hold.
  absl::StatusOr<Selection> Parse(const v1::SelectBlocksRequest& asked,
                                  const v1::SelectBlocksResponse& r) {
    const v1::SelectOutputRefs& o = asked.output_refs();
    ids_ = Read(o.block_ids());
    table_ = Read(o.page_table());
    lens_ = Read(o.context_lens());
    return client::ParseSelection(r, client::OutputsInMemory{ids_.data(), table_.data(), lens_.data()});
  }
  v1::SelectBlocksRequest Select(const std::string& id, int heads, int tokens,
                                 const std::vector<float>& q) {
    return client::MakeSelect(id, 0, heads, tokens, q);
  }
  std::vector<float> Values(size_t n, float scale = 1.0f) {
    std::vector<float> v = IntValues(ints_, n);
    for (float& x : v) x *= scale;
    return v;
  }
  double Counter(const std::string& name) {
    absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) return -1;
    for (const v1::MetricFamily& f : stats->families()) {
      if (f.name() == name && f.metrics_size() > 0) return f.metrics(0).value();
    }
    ADD_FAILURE() << "no metric " << name;
    return -1;
  }

  std::unique_ptr<Child> server_;
  std::unique_ptr<IndexerClient> client_;
  std::unique_ptr<DeviceMemory> memory_;
  uint64_t cursor_ = 0;
  std::mt19937 ints_{7};
  std::vector<int32_t> ids_, table_, lens_;
};

TEST_F(CudaRegionTest, RegistersListsAndRefusesWhatItCannotOpen) {
  absl::StatusOr<v1::ListRegionsResponse> listed = client_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->regions_size(), 1);
  EXPECT_EQ(listed->regions(0).kind(), "cuda");
  EXPECT_EQ(listed->regions(0).device_id(), 0);
  EXPECT_EQ(listed->regions(0).byte_size(), kRegionBytes);

  const std::string handle = memory_->handle();
  EXPECT_EQ(client_->RegisterCudaRegion("g", handle, 0, 0, 64).code(),
            absl::StatusCode::kAlreadyExists);
  const absl::Status past = client_->RegisterCudaRegion("x", handle, 0, 64, kRegionBytes);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_THAT(past.message(), HasSubstr("past the allocation"));
  EXPECT_EQ(client_->RegisterCudaRegion("x", handle.substr(1), 0, 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterCudaRegion("x", std::string(64, '\x5a'), 0, 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status other_gpu = client_->RegisterCudaRegion("x", handle, 7, 0, 64);
  EXPECT_EQ(other_gpu.code(), absl::StatusCode::kFailedPrecondition) << other_gpu;
  EXPECT_THAT(other_gpu.message(), HasSubstr("not one of this server's GPUs"));
  EXPECT_EQ(client_->RegisterCudaRegion("x", handle, 0, 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  // A second region over the same allocation: the server opens it again.
  EXPECT_TRUE(client_->RegisterCudaRegion("h", handle, 0, 4096, 4096).ok());
  EXPECT_EQ(*client_->UnregisterRegion(""), 2u);
  EXPECT_EQ(client_->ListRegions()->regions_size(), 0);
}

// Keys, queries and outputs in GPU memory answer exactly what inline bytes answer: a prefill of
// several device chunks, then decode steps (append one token, select) in one Batch, with
// attention pages (every output written) and without.
TEST_F(CudaRegionTest, ByReferenceAnswersEqualInline) {
  const int tokens = 700;
  for (const bool attn : {false, true}) {
    const std::string tag = attn ? "pages" : "plain";
    const std::vector<float> keys = Values(size_t{tokens} * kHeadDim);
    for (const std::string& id : {tag + "-inline", tag + "-ref"}) {
      v1::AppendKeysRequest append = client::MakeAppend(id, 0, tokens, keys);
      if (attn) {
        for (int b = 0; b < 6; ++b) append.add_attention_pages(100 + b);
      }
      if (id.ends_with("-ref")) {
        *append.mutable_keys_ref() = Put(append.keys());
        append.clear_keys();
      }
      absl::StatusOr<v1::AppendKeysResponse> appended = client_->AppendKeys(append);
      ASSERT_TRUE(appended.ok()) << id << ": " << appended.status();
      EXPECT_EQ(appended->lengths(0), static_cast<uint32_t>(tokens));
    }
    for (int step = 0; step < 3; ++step) {
      v1::BatchRequest inline_batch, ref_batch;
      for (const int heads : {1, 4}) {
        const std::vector<float> k = Values(kHeadDim);
        const std::vector<float> q = Values(static_cast<size_t>(heads) * kHeadDim);
        v1::SelectBlocksRequest item = Select(tag + "-inline", heads, 1, q);
        *item.mutable_append() = client::MakeAppend("", 0, 1, k);
        *inline_batch.add_items() = item;
        item.set_sequence_id(tag + "-ref");
        *ref_batch.add_items() = ByReference(item);
      }
      absl::StatusOr<v1::BatchResponse> want = client_->Batch(inline_batch);
      absl::StatusOr<v1::BatchResponse> got = client_->Batch(ref_batch);
      ASSERT_TRUE(want.ok() && got.ok());
      for (int i = 0; i < 2; ++i) {
        const std::string where = absl::StrCat(tag, " step ", step, " item ", i);
        ASSERT_EQ(want->results(i).code(), 0) << where << ": " << want->results(i).message();
        ASSERT_EQ(got->results(i).code(), 0) << where << ": " << got->results(i).message();
        EXPECT_TRUE(got->results(i).result().block_ids().empty());
        absl::StatusOr<Selection> w = client::ParseSelection(want->results(i).result());
        absl::StatusOr<Selection> g = Parse(ref_batch.items(i), got->results(i).result());
        ASSERT_TRUE(w.ok() && g.ok());
        EXPECT_EQ(w->has_page_table(), attn);
        ExpectSameSelection(*g, *w, where);
      }
    }
  }
}

// On the CUDA backend a system region is pinned and read and written in place by the device:
// answers equal inline ones, with every output in the region; references the device cannot
// take (fp32, addresses not 16-byte aligned, outputs named in part) are served on the host as
// on any server; a NaN there fails its item alone, as inline.
TEST_F(CudaRegionTest, PinnedSystemRegionsAnswerAsInline) {
  absl::StatusOr<std::unique_ptr<client::SharedMemoryRegion>> shm = client::SharedMemoryRegion::Create(
      absl::StrCat("/indexer-cuda-region-test-", ::getpid()), size_t{4} << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(client_->RegisterSystemRegion("sys", (*shm)->key(), 0, (*shm)->size()).ok());
  absl::StatusOr<v1::ListRegionsResponse> listed = client_->ListRegions("sys");
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->regions(0).pinned()) << "a CUDA server pins system regions";
  uint64_t at = 0;
  // At a multiple of 256, or 2 bytes past one (`skew`): not 16-byte aligned.
  auto put = [&](const std::string& bytes, bool skew) {
    at = (at + 255) / 256 * 256 + (skew ? 2 : 0);
    absl::StatusOr<v1::RegionRef> ref = (*shm)->Write("sys", at, bytes);
    EXPECT_TRUE(ref.ok()) << ref.status();
    at += bytes.size();
    return ref.ok() ? *ref : v1::RegionRef();
  };
  auto room = [&](size_t values) {
    at = (at + 255) / 256 * 256;
    v1::RegionRef ref = client::SharedMemoryRegion::Ref("sys", at, values * 4);
    at += values * 4;
    return ref;
  };
  const std::vector<float> keys = Values(300 * kHeadDim);
  for (const char* id : {"sys-inline", "sys-ref"}) {
    v1::AppendKeysRequest append = client::MakeAppend(id, 0, 300, keys);
    for (int b = 0; b < 3; ++b) append.add_attention_pages(7 + b);
    if (std::string(id) == "sys-ref") {
      *append.mutable_keys_ref() = put(append.keys(), false);
      append.clear_keys();
    }
    ASSERT_TRUE(client_->AppendKeys(append).ok()) << id;
  }
  struct Variant { const char* what; bool skew; bool fp32; bool all_outputs; };
  for (const Variant& v : {Variant{"in place", false, false, true}, Variant{"fp32", false, true, true},
                           Variant{"misaligned", true, false, true},
                           Variant{"block ids only", false, false, false}}) {
    const std::vector<float> q = Values(2 * kHeadDim);
    const std::vector<float> k = Values(kHeadDim);
    const v1::ValueDtype dtype = v.fp32 ? v1::VALUE_DTYPE_FP32 : v1::VALUE_DTYPE_BF16;
    v1::SelectBlocksRequest item = client::MakeSelect("sys-inline", 0, 2, 1, q, dtype);
    *item.mutable_append() = client::MakeAppend("", 0, 1, k, dtype);
    absl::StatusOr<v1::SelectBlocksResponse> want = client_->SelectBlocks(item);
    ASSERT_TRUE(want.ok()) << v.what << ": " << want.status();
    item.set_sequence_id("sys-ref");
    *item.mutable_append()->mutable_keys_ref() = put(item.append().keys(), v.skew);
    item.mutable_append()->clear_keys();
    *item.mutable_queries_ref() = put(item.queries(), v.skew);
    item.clear_queries();
    v1::SelectOutputRefs* o = item.mutable_output_refs();
    *o->mutable_block_ids() = room(2 * kTopk);
    if (v.all_outputs) {
      *o->mutable_page_table() = room(2 * kTopk * kPagesPerBlock);
      *o->mutable_context_lens() = room(2);
    }
    absl::StatusOr<v1::SelectBlocksResponse> got = client_->SelectBlocks(item);
    ASSERT_TRUE(got.ok()) << v.what << ": " << got.status();
    auto at_ref = [&](const v1::RegionRef& ref) {
      return reinterpret_cast<const int32_t*>((*shm)->data() + ref.offset());
    };
    absl::StatusOr<Selection> g = client::ParseSelection(
        *got, client::OutputsInMemory{at_ref(o->block_ids()),
                                      v.all_outputs ? at_ref(o->page_table()) : nullptr,
                                      v.all_outputs ? at_ref(o->context_lens()) : nullptr});
    absl::StatusOr<Selection> w = client::ParseSelection(*want);
    ASSERT_TRUE(g.ok() && w.ok()) << v.what;
    ExpectSameSelection(*g, *w, v.what);
  }
  std::vector<float> bad = Values(kHeadDim);
  bad[9] = std::nanf("");
  v1::SelectBlocksRequest item = client::MakeSelect("sys-ref", 0, 1, 1, Values(kHeadDim));
  *item.mutable_append() = client::MakeAppend("", 0, 1, bad);
  *item.mutable_append()->mutable_keys_ref() = put(item.append().keys(), false);
  item.mutable_append()->clear_keys();
  *item.mutable_queries_ref() = put(item.queries(), false);
  item.clear_queries();
  const absl::Status nan = client_->SelectBlocks(item).status();
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument) << nan;
  EXPECT_THAT(std::string(nan.message()), HasSubstr("keys (read by the device)"));
  EXPECT_EQ(client_->GetSequence("sys-ref")->lengths(0), 304u) << "the failed append was taken back";
  EXPECT_EQ(*client_->UnregisterRegion("sys"), 1u);
}

// NaN and Inf in device keys or queries fail their item with INVALID_ARGUMENT and nothing of it
// is kept; the batch's other items are answered.
TEST_F(CudaRegionTest, NonFiniteDeviceValuesFailTheirItemAlone) {
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(client_->AppendKeys(client::MakeAppend(id, 0, 300, Values(300 * kHeadDim))).ok());
  }
  v1::BatchRequest batch;
  std::vector<float> bad_keys = Values(kHeadDim);
  bad_keys[5] = std::nanf("");
  v1::SelectBlocksRequest a = Select("a", 1, 1, Values(kHeadDim));
  *a.mutable_append() = client::MakeAppend("", 0, 1, bad_keys);
  *batch.add_items() = ByReference(a);
  std::vector<float> bad_queries = Values(2 * kHeadDim);
  bad_queries[200] = INFINITY;
  v1::SelectBlocksRequest b = Select("b", 2, 1, bad_queries);
  *b.mutable_append() = client::MakeAppend("", 0, 1, Values(kHeadDim));
  *batch.add_items() = ByReference(b);
  v1::SelectBlocksRequest c = Select("c", 1, 1, Values(kHeadDim));
  *c.mutable_append() = client::MakeAppend("", 0, 1, Values(kHeadDim));
  *batch.add_items() = ByReference(c);
  absl::StatusOr<v1::BatchResponse> r = client_->Batch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->results(0).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r->results(0).message(), HasSubstr("keys (read by the device)"));
  EXPECT_EQ(r->results(1).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r->results(1).message(), HasSubstr("queries (read by the device)"));
  EXPECT_EQ(r->results(2).code(), 0) << r->results(2).message();
  EXPECT_EQ(client_->GetSequence("a")->lengths(0), 300u) << "the failed append was taken back";
  EXPECT_EQ(client_->GetSequence("b")->lengths(0), 300u);
  EXPECT_EQ(client_->GetSequence("c")->lengths(0), 301u);
}

// Device values the plan could not see: keys and queries of magnitude 2^58 need the exact path
// (fp32 sums could overflow on the others). The step is planned on the decode path, the device
// copy's scan shows the need, and the span runs again exactly: its answer is the inline one.
TEST_F(CudaRegionTest, DeviceValuesThatNeedTheExactPathRunOnIt) {
  const float big = std::ldexp(1.0f, 58);
  const std::vector<float> keys = Values(200 * kHeadDim, big);
  const std::vector<float> q = Values(2 * kHeadDim, big);
  v1::SelectBlocksRequest inline_item = Select("big-inline", 2, 1, q);
  *inline_item.mutable_append() = client::MakeAppend("", 0, 200, keys);
  v1::SelectBlocksRequest ref_item = inline_item;
  ref_item.set_sequence_id("big-ref");
  ref_item = ByReference(ref_item);
  const double before = Counter("indexer_backend_exact_reruns_total");
  absl::StatusOr<v1::SelectBlocksResponse> want = client_->SelectBlocks(inline_item);
  absl::StatusOr<v1::SelectBlocksResponse> got = client_->SelectBlocks(ref_item);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(Counter("indexer_backend_exact_reruns_total"), before + 1);
  absl::StatusOr<Selection> w = client::ParseSelection(*want);
  absl::StatusOr<Selection> g = Parse(ref_item, *got);
  ASSERT_TRUE(w.ok() && g.ok());
  ExpectSameSelection(*g, *w, "exact");
}

TEST_F(CudaRegionTest, ReferencesAreCheckedBeforeAnythingIsApplied) {
  ASSERT_TRUE(client_->AppendKeys(client::MakeAppend("s", 0, 200, Values(200 * kHeadDim))).ok());
  const std::vector<float> q = Values(kHeadDim);
  auto expect = [&](v1::SelectBlocksRequest r, absl::StatusCode code, const std::string& text) {
    absl::StatusOr<v1::SelectBlocksResponse> answer = client_->SelectBlocks(r);
    EXPECT_EQ(answer.status().code(), code) << text << ": " << answer.status();
    EXPECT_THAT(std::string(answer.status().message()), HasSubstr(text));
  };
  v1::SelectBlocksRequest misaligned = ByReference(Select("s", 1, 1, q));
  misaligned.mutable_queries_ref()->set_offset(misaligned.queries_ref().offset() + 2);
  expect(misaligned, absl::StatusCode::kInvalidArgument, "multiple of 16");
  v1::SelectBlocksRequest fp32 = ByReference(client::MakeSelect("s", 0, 1, 1, q, v1::VALUE_DTYPE_FP32));
  expect(fp32, absl::StatusCode::kInvalidArgument, "must be BF16");
  v1::SelectBlocksRequest two_outputs = ByReference(Select("s", 1, 1, q));
  two_outputs.mutable_output_refs()->clear_context_lens();
  expect(two_outputs, absl::StatusCode::kInvalidArgument, "all three references");
  v1::SelectBlocksRequest past = ByReference(Select("s", 1, 1, q));
  past.mutable_queries_ref()->set_offset(kRegionBytes - 16);
  expect(past, absl::StatusCode::kInvalidArgument, "is not within region");
  v1::SelectBlocksRequest with_append = Select("s", 1, 1, q);
  *with_append.mutable_append() = client::MakeAppend("", 0, 1, Values(kHeadDim));
  with_append = ByReference(with_append);
  with_append.mutable_append()->mutable_keys_ref()->set_offset(
      with_append.append().keys_ref().offset() + 4);
  expect(with_append, absl::StatusCode::kInvalidArgument, "multiple of 16");
  EXPECT_EQ(client_->GetSequence("s")->lengths(0), 200u) << "nothing of a refused item applied";

  v1::SelectBlocksRequest fine = ByReference(Select("s", 1, 1, q));
  ASSERT_TRUE(client_->SelectBlocks(fine).ok());
  ASSERT_EQ(*client_->UnregisterRegion("g"), 1u);
  expect(fine, absl::StatusCode::kNotFound, "is not registered");
}

// A client that frees its allocation while the region is registered breaks its own guarantee;
// the server stays up and keeps serving everyone else.
TEST_F(CudaRegionTest, AFreedAllocationDoesNotBringTheServerDown) {
  auto doomed = std::make_unique<DeviceMemory>(size_t{1} << 20);
  ASSERT_TRUE(doomed->ok());
  ASSERT_TRUE(client_->RegisterCudaRegion("doomed", doomed->handle(), 0, 0, 1 << 20).ok());
  ASSERT_TRUE(client_->AppendKeys(client::MakeAppend("s", 0, 200, Values(200 * kHeadDim))).ok());
  doomed->Free();
  v1::SelectBlocksRequest r = ByReference(Select("s", 1, 1, Values(kHeadDim)));
  r.mutable_queries_ref()->set_region("doomed");
  r.mutable_queries_ref()->set_offset(0);
  absl::StatusOr<v1::SelectBlocksResponse> after_free = client_->SelectBlocks(r);
  std::printf("a selection reading a freed CUDA region answered: %s\n",
              after_free.status().ToString().c_str());
  v1::SelectBlocksRequest fine = ByReference(Select("s", 1, 1, Values(kHeadDim)));
  absl::StatusOr<v1::SelectBlocksResponse> later = client_->SelectBlocks(fine);
  EXPECT_TRUE(later.ok()) << later.status() << "\nserver log:\n" << server_->Log();
  EXPECT_TRUE(client_->UnregisterRegion("doomed").ok());
}

}  // namespace
}  // namespace indexer::testing
