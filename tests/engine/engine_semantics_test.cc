// Engine semantics through its public API (engine/engine.h) on a CpuBackend: appends, layers,
// validation, all-or-nothing failures, attention pages, select-with-append, Batch, deadlines,
// fork / truncate / release and copy-on-write. Every selection is checked against
// kernels::SelectSpan run on the test's own copy of the keys.
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/key_cache_backend.h"
#include "tests/engine/engine_test_util.h"

namespace indexer::testing {
namespace {

using engine::CallControl;
using engine::EngineStats;
using engine::KeyCacheBackend;
using engine::SequenceInfo;
using Ids = std::vector<int32_t>;

// A CpuBackend whose calls can be made to fail, to check that the engine undoes what it started.
class FlakyBackend final : public KeyCacheBackend {
 public:
  explicit FlakyBackend(const EngineConfig& config) : inner_(config) {}
  std::string name() const override { return "flaky"; }
  std::string device() const override { return inner_.device(); }
  absl::Status WriteKeys(const engine::KeyWrite& w) override {
    if (fail_write) return absl::InternalError("injected WriteKeys failure");
    return inner_.WriteKeys(w);
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    if (fail_copy) return absl::InternalError("injected CopyPage failure");
    return inner_.CopyPage(src, dst);
  }
  absl::Status Select(std::span<const engine::SelectTask> tasks,
                      const kernels::PageTableParams& pt) override {
    if (fail_select) return absl::InternalError("injected Select failure");
    return inner_.Select(tasks, pt);
  }
  // Counts the engine's batched key writes (the default implementation writes one by one, so
  // fail_write still applies).
  absl::Status WriteKeysBatch(std::span<const engine::KeyWrite> writes) override {
    ++write_batches;
    batched_writes += static_cast<int64_t>(writes.size());
    return KeyCacheBackend::WriteKeysBatch(writes);
  }
  std::atomic<bool> fail_write{false}, fail_copy{false}, fail_select{false};
  std::atomic<int64_t> write_batches{0}, batched_writes{0};

 private:
  engine::CpuBackend inner_;
};

bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

#define EXPECT_STATUS(expr, code_, needle)                                           \
  do {                                                                              \
    const absl::Status s_ = (expr);                                                 \
    EXPECT_EQ(s_.code(), absl::StatusCode::code_) << s_;                            \
    EXPECT_TRUE(Contains(s_.message(), needle))                                     \
        << "message '" << s_.message() << "' does not name '" << (needle) << "'"; \
  } while (0)

// Everything observable about the engine's state for some ids.
struct Snapshot {
  EngineStats stats;
  std::map<std::string, std::optional<SequenceInfo>> seqs;
};

bool SameInfo(const SequenceInfo& a, const SequenceInfo& b) {
  return a.lengths == b.lengths && a.pages == b.pages && a.attention_pages == b.attention_pages &&
         a.shared_pages == b.shared_pages;
}

class EngineTest : public ::testing::Test {
 protected:
  void Init(EngineConfig config, bool flaky = false) {
    config_ = config;
    ASSERT_TRUE(config.Validate().ok()) << config.Validate();
    if (flaky) {
      auto backend = std::make_unique<FlakyBackend>(config);
      flaky_ = backend.get();
      engine_ = std::make_unique<Engine>(config, std::move(backend));
    } else {
      engine_ = MakeEngine(config);
    }
    model_.clear();
  }
  void SetUp() override { Init(SmallEngineConfig()); }

  int D() const { return config_.head_dim; }
  std::vector<uint16_t> Keys(int64_t n, int layers = 1) {
    return RandomBf16(rng_, static_cast<size_t>(n) * layers * D());
  }

  // Appends n random keys to `layer` of `id` (engine and model); expects success.
  StepResult AppendOk(const std::string& id, int layer, int64_t n, Ids attn = {}) {
    const std::vector<uint16_t> k = Keys(n);
    absl::StatusOr<StepResult> r = AppendKeys(*engine_, id, layer, k, attn);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    SeqModel& m = ModelFor(id);
    m.Append(layer, k);
    if (!m.attn_decided) {
      m.attn_decided = true;
      m.has_attn = !attn.empty();
    }
    m.attn.insert(m.attn.end(), attn.begin(), attn.end());
    return *r;
  }

  SeqModel& ModelFor(const std::string& id) {
    auto it = model_.find(id);
    if (it == model_.end()) it = model_.emplace(id, SeqModel(config_.layers, D())).first;
    return it->second;
  }

  // Checks a selection of `id` against the model: the last n tokens of `layer`, or at `start`.
  void ExpectSelects(const std::string& id, int layer = 0, int n = 1,
                     std::optional<int64_t> start = std::nullopt, int heads = 2) {
    SCOPED_TRACE(::testing::Message() << "select " << id << " layer " << layer << " n " << n);
    SelectArgs a;
    a.layer = layer;
    a.heads = heads;
    a.start = start;
    const absl::Status s = CheckSelection(*engine_, config_, id, model_.at(id), rng_, a, n);
    EXPECT_TRUE(s.ok()) << s;
    // Top-1 without forced blocks: the answer depends on every visible block's score, so wrong
    // keys anywhere show (with the defaults, short sequences select all their blocks).
    a.topk = 1;
    a.init_blocks = 0;
    a.local_blocks = 0;
    const absl::Status s1 = CheckSelection(*engine_, config_, id, model_.at(id), rng_, a, n);
    EXPECT_TRUE(s1.ok()) << s1;
  }

  // Checks Get() against the model's lengths and attention pages.
  void ExpectShape(const std::string& id) {
    absl::StatusOr<SequenceInfo> info = engine_->Get(id);
    ASSERT_TRUE(info.ok()) << info.status();
    const SeqModel& m = model_.at(id);
    EXPECT_EQ(info->lengths, m.Lengths());
    EXPECT_EQ(static_cast<int64_t>(info->pages.size()), m.Blocks());
    EXPECT_EQ(info->attention_pages, m.has_attn ? m.attn : Ids{});
  }

  Snapshot Take(const std::vector<std::string>& ids) const {
    Snapshot s;
    s.stats = engine_->Stats();
    for (const auto& id : ids) {
      absl::StatusOr<SequenceInfo> info = engine_->Get(id);
      if (info.ok()) {
        s.seqs[id] = *info;
      } else {
        EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound) << info.status();
        s.seqs[id] = std::nullopt;
      }
    }
    return s;
  }

  // Nothing observable changed between two snapshots.
  void ExpectUnchanged(const Snapshot& before) const {
    std::vector<std::string> ids;
    for (const auto& [id, info] : before.seqs) ids.push_back(id);
    const Snapshot now = Take(ids);
    EXPECT_EQ(now.stats.free_pages, before.stats.free_pages);
    EXPECT_EQ(now.stats.live_sequences, before.stats.live_sequences);
    for (const auto& [id, info] : before.seqs) {
      const auto& after = now.seqs.at(id);
      ASSERT_EQ(after.has_value(), info.has_value()) << id << " appeared or disappeared";
      if (info) {
        EXPECT_TRUE(SameInfo(*info, *after))
            << id << " changed: lengths " << ::testing::PrintToString(info->lengths) << " -> "
            << ::testing::PrintToString(after->lengths) << ", pages "
            << ::testing::PrintToString(info->pages) << " -> "
            << ::testing::PrintToString(after->pages) << ", shared_pages " << info->shared_pages
            << " -> " << after->shared_pages << ", attention_pages "
            << ::testing::PrintToString(info->attention_pages) << " -> "
            << ::testing::PrintToString(after->attention_pages);
      }
    }
  }

  int64_t FreePages() const { return engine_->Stats().free_pages; }

  EngineConfig config_;
  std::unique_ptr<Engine> engine_;
  FlakyBackend* flaky_ = nullptr;
  std::map<std::string, SeqModel> model_;
  std::mt19937_64 rng_{20240611};
};

// ---------------------------------------------------------------------------------------------
// Appends and lengths

TEST_F(EngineTest, AppendCreatesTheSequenceThenGrowsIt) {
  const StepResult first = AppendOk("a", 0, 100);
  EXPECT_TRUE(first.created);
  EXPECT_EQ(first.lengths, (std::vector<int64_t>{100}));
  EXPECT_EQ(first.num_blocks, 1);
  EXPECT_EQ(engine_->Stats().live_sequences, 1);
  EXPECT_EQ(FreePages(), config_.capacity_pages - 1);

  const StepResult second = AppendOk("a", 0, 100);
  EXPECT_FALSE(second.created);
  EXPECT_EQ(second.lengths, (std::vector<int64_t>{200}));
  EXPECT_EQ(second.num_blocks, 2);
  EXPECT_EQ(FreePages(), config_.capacity_pages - 2);
  ExpectShape("a");
  absl::StatusOr<SequenceInfo> info = engine_->Get("a");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->shared_pages, 0);
  EXPECT_NE(info->pages[0], info->pages[1]);

  ExpectSelects("a");            // decode: last token
  ExpectSelects("a", 0, 5);      // speculative: last 5
  ExpectSelects("a", 0, 200, 0); // the whole sequence as a prefill span
  ExpectSelects("a", 0, 3, 126); // across the block boundary
}

TEST_F(EngineTest, LayersHaveTheirOwnLengthsAndShareTheBlockTable) {
  EngineConfig c = SmallEngineConfig();
  c.layers = 3;
  Init(c);
  const int64_t total = c.capacity_pages;
  EXPECT_EQ(AppendOk("s", 0, 100).num_blocks, 1);
  EXPECT_EQ(FreePages(), total - 1);
  // Layer 1 reaches block 1 first: its page is allocated now.
  StepResult r = AppendOk("s", 1, 200);
  EXPECT_EQ(r.lengths, (std::vector<int64_t>{100, 200, 0}));
  EXPECT_EQ(r.num_blocks, 2);
  EXPECT_EQ(FreePages(), total - 2);
  // Layer 2 stays inside existing blocks: no page.
  r = AppendOk("s", 2, 50);
  EXPECT_EQ(r.lengths, (std::vector<int64_t>{100, 200, 50}));
  EXPECT_EQ(FreePages(), total - 2);
  // Layer 0 passes everyone: blocks 2 and 3.
  r = AppendOk("s", 0, 300);
  EXPECT_EQ(r.lengths, (std::vector<int64_t>{400, 200, 50}));
  EXPECT_EQ(r.num_blocks, 4);
  EXPECT_EQ(FreePages(), total - 4);

  // All layers at once: keys [n][layers][head_dim].
  const int64_t n = 30;
  const std::vector<uint16_t> k = Keys(n, 3);
  absl::StatusOr<StepResult> all = AppendKeys(*engine_, "s", 0, k, {}, /*all_layers=*/true);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_FALSE(all->created);
  EXPECT_EQ(all->lengths, (std::vector<int64_t>{430, 230, 80}));
  EXPECT_EQ(all->num_blocks, 4);
  SeqModel& m = model_.at("s");
  for (int l = 0; l < 3; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      const auto row = k.begin() + (t * 3 + l) * D();
      m.keys[l].insert(m.keys[l].end(), row, row + D());
    }
  }
  ExpectShape("s");
  absl::StatusOr<SequenceInfo> info = engine_->Get("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(std::set<int32_t>(info->pages.begin(), info->pages.end()).size(), 4u);
  for (int l = 0; l < 3; ++l) {
    ExpectSelects("s", l);
    ExpectSelects("s", l, 7);
    ExpectSelects("s", l, 20, 40);
  }
  // A new sequence created by an all-layers append.
  const std::vector<uint16_t> k2 = Keys(129, 3);
  absl::StatusOr<StepResult> created = AppendKeys(*engine_, "t", 0, k2, {}, true);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->created);
  EXPECT_EQ(created->lengths, (std::vector<int64_t>{129, 129, 129}));
  EXPECT_EQ(created->num_blocks, 2);
}

TEST_F(EngineTest, Fp32KeysAndQueriesAreRoundedToBf16TiesToEven) {
  // Dim-0 key values per block (q = e0 makes the score the key value):
  //   b0: 1.0 exact                           -> 1.0
  //   b1: 1 + 2^-8 (tie: 0x3f80 / 0x3f81)     -> 1.0 (even)
  //   b2: 1 + 2^-7 = 0x3f81 exact             -> 1.0078125
  //   b3: 1 + 3 * 2^-8 (tie: 0x3f81 / 0x3f82) -> 1.015625 (even)
  // Ties to even: [3, 2, 0, 1]. Round-half-up would give b1 = 1.0078125: [3, 1, 2, 0];
  // truncation would give b3 = 1.0078125: [2, 3, 0, 1].
  const float values[4] = {1.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-7f, 1.0f + 3 * 0x1p-8f};
  std::vector<float> keys(4 * 128 * D(), 0.0f);
  for (int64_t t = 0; t < 4 * 128; ++t) keys[t * D()] = values[t / 128];
  const std::string bytes = Bytes(keys);
  AppendRequest r;
  r.sequence_id = "f";
  r.dtype = WireDtype::kFp32;
  r.keys = bytes;
  ASSERT_TRUE(engine_->Append(r).ok());
  // The query, in fp32 too: 1 + 2^-8 rounds to 1.0.
  std::vector<float> q(D(), 0.0f);
  q[0] = 1.0f + 0x1p-8f;
  const std::string qbytes = Bytes(q);
  StepRequest s;
  s.sequence_id = "f";
  s.num_heads = 1;
  s.query_dtype = WireDtype::kFp32;
  s.queries = qbytes;
  s.topk = 4;
  s.local_blocks = 0;
  absl::StatusOr<StepResult> got = engine_->Select(s);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->block_ids, (Ids{3, 2, 0, 1}));

  // And the same through the model: keys rounded here with FloatToBf16.
  SeqModel& m = ModelFor("f");
  for (float v : keys) m.keys[0].push_back(kernels::FloatToBf16(v));
  std::vector<uint16_t> qb;
  for (float v : q) qb.push_back(kernels::FloatToBf16(v));
  EXPECT_EQ(qb[0], 0x3f80);
  ExpectSameSelection(*got, ExpectedSelect(config_, m, 0, 511, 1, 1, qb, {4, 0, 0}));
}

TEST_F(EngineTest, Fp8StorageSelectsLikeTheReferenceOnFp8Keys) {
  EngineConfig c = SmallEngineConfig();
  c.key_storage = kernels::KeyStorage::kFp8E4M3;
  c.layers = 2;
  c.cpu_threads = 1;  // and the CPU backend without worker threads
  Init(c);
  AppendOk("q", 0, 300);
  AppendOk("q", 1, 260);
  for (int l = 0; l < 2; ++l) {
    ExpectSelects("q", l);
    ExpectSelects("q", l, 9, 100);
  }
}

TEST_F(EngineTest, Fp4StorageSelectsLikeTheReferenceOnFp4Keys) {
  EngineConfig c = SmallEngineConfig();
  c.key_storage = kernels::KeyStorage::kFp4E2M1;
  c.layers = 2;
  Init(c);
  AppendOk("q", 0, 300);
  AppendOk("q", 1, 260);
  for (int l = 0; l < 2; ++l) {
    ExpectSelects("q", l);
    ExpectSelects("q", l, 9, 100);
  }
}

// ---------------------------------------------------------------------------------------------
// Validation: every refusal names the field and applies nothing

TEST_F(EngineTest, NonFiniteKeysOrQueriesAreRefusedNamingTheField) {
  AppendOk("a", 0, 50);
  const Snapshot before = Take({"a", "new"});
  for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    std::vector<uint16_t> k = Keys(10);
    k[3 * D() + 5] = bad;
    EXPECT_STATUS(AppendKeys(*engine_, "a", 0, k).status(), kInvalidArgument, "keys[3][5]");
    EXPECT_STATUS(AppendKeys(*engine_, "new", 0, k).status(), kInvalidArgument, "keys");
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    3.4e38f}) {
    std::vector<float> k(10 * D(), 0.5f);
    k[7] = bad;
    const std::string bytes = Bytes(k);
    AppendRequest r;
    r.sequence_id = "new";
    r.dtype = WireDtype::kFp32;
    r.keys = bytes;
    EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "keys");
  }
  // Queries: a select carrying valid keys and a NaN query applies neither.
  std::vector<uint16_t> q = Keys(1, 2);
  q[D() + 1] = 0x7fc0;
  const std::string keys = Bytes(Keys(4));
  const std::string queries = Bytes(q);
  StepRequest s = Bf16Select("a", 0, 2, queries);
  s.append = AppendRequest{"a", 0, false, WireDtype::kBf16, keys, {}};
  EXPECT_STATUS(engine_->Select(s).status(), kInvalidArgument, "queries");
  s.sequence_id = "new";
  s.append->sequence_id = "new";
  EXPECT_STATUS(engine_->Select(s).status(), kInvalidArgument, "queries");
  ExpectUnchanged(before);
  ExpectSelects("a");
}

TEST_F(EngineTest, DtypesAndByteSizesAreChecked) {
  AppendOk("a", 0, 50);
  const Snapshot before = Take({"a", "new"});
  const std::string k = Bytes(Keys(3));
  AppendRequest r;
  r.sequence_id = "a";
  r.keys = k;
  r.dtype = WireDtype::kUnspecified;
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "keys");
  r.dtype = WireDtype::kBf16;
  const std::string partial = k.substr(0, k.size() - 2);  // 3 rows minus one value
  r.keys = partial;
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "keys");
  r.keys = absl::string_view();
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "keys");
  r.dtype = WireDtype::kFp32;  // 3 bf16 rows = 1.5 fp32 rows
  r.keys = k;
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "keys");
  // All-layers keys must hold every layer of every token.
  r.dtype = WireDtype::kBf16;
  r.sequence_id = "new";
  EngineConfig c2 = SmallEngineConfig();
  c2.layers = 2;
  {
    Engine two(c2, std::make_unique<engine::CpuBackend>(c2));
    AppendRequest all;
    all.sequence_id = "x";
    all.all_layers = true;
    all.dtype = WireDtype::kBf16;
    all.keys = k;  // 3 single-layer rows: 1.5 two-layer rows
    EXPECT_STATUS(two.Append(all).status(), kInvalidArgument, "keys");
    EXPECT_EQ(two.Stats().live_sequences, 0);
  }
  // Queries: unspecified dtype, and sizes that are not whole [H][head_dim] rows.
  const std::string q1 = Bytes(Keys(1));
  StepRequest s;
  s.sequence_id = "a";
  s.num_heads = 1;
  s.queries = q1;
  s.query_dtype = WireDtype::kUnspecified;
  EXPECT_STATUS(engine_->Select(s).status(), kInvalidArgument, "queries");
  s.query_dtype = WireDtype::kBf16;
  s.num_heads = 2;  // one head's worth of bytes
  EXPECT_STATUS(engine_->Select(s).status(), kInvalidArgument, "queries");
  s.queries = absl::string_view();
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kInvalidArgument);
  ExpectUnchanged(before);
}

// Tensors in device memory (a client's CUDA region) are checked for what needs no access to
// their values -- dtype, whole rows, alignment, outputs named whole -- and a backend that reads
// no device memory refuses them with FAILED_PRECONDITION, applying nothing. The CPU backend
// never dereferences them: host bytes stand in for the device here.
TEST_F(EngineTest, DeviceTensorsAreCheckedAndTheCpuBackendRefusesThem) {
  AppendOk("a", 0, 50);
  const Snapshot before = Take({"a", "new"});
  alignas(16) static char device_bytes[4096];
  const absl::string_view one_row(device_bytes, static_cast<size_t>(D()) * 2);
  AppendRequest r;
  r.sequence_id = "a";
  r.dtype = WireDtype::kBf16;
  r.keys = one_row;
  r.keys_device = 0;
  EXPECT_STATUS(engine_->Append(r).status(), kFailedPrecondition, "cannot read tensors in CUDA regions");
  r.sequence_id = "new";
  EXPECT_STATUS(engine_->Append(r).status(), kFailedPrecondition, "CUDA regions");
  r.dtype = WireDtype::kFp32;
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "must be BF16");
  r.dtype = WireDtype::kBf16;
  r.keys = absl::string_view(device_bytes + 2, one_row.size());
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "multiple of 16");
  r.keys = one_row.substr(2);
  EXPECT_STATUS(engine_->Append(r).status(), kInvalidArgument, "multiple of one row");

  StepRequest s = Bf16Select("a", 0, 1, one_row);
  s.queries_device = 0;
  EXPECT_STATUS(engine_->Select(s).status(), kFailedPrecondition, "CUDA regions");
  s.queries_device = -1;
  int32_t out[64] = {};
  s.outputs.block_ids = std::span<int32_t>(out, 64);
  s.outputs.device = 0;
  EXPECT_STATUS(engine_->Select(s).status(), kInvalidArgument, "all three references");
  s.outputs.page_table = std::span<int32_t>(out, 64);
  s.outputs.context_lens = std::span<int32_t>(out, 64);
  EXPECT_STATUS(engine_->Select(s).status(), kFailedPrecondition, "CUDA regions");
  ExpectUnchanged(before);
  ExpectSelects("a");
}

TEST_F(EngineTest, LayerHeadsTopkAndIdsOutOfRange) {
  EngineConfig c = SmallEngineConfig();
  c.layers = 2;
  Init(c);
  AppendOk("a", 0, 50);
  AppendOk("a", 1, 50);
  const Snapshot before = Take({"a", "new"});
  for (int64_t layer : {-1, 2, 100}) {
    EXPECT_STATUS(AppendKeys(*engine_, "a", layer, Keys(1)).status(), kInvalidArgument, "layer");
    SelectArgs a;
    a.layer = layer;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kInvalidArgument, "layer");
  }
  for (int heads : {0, 5}) {  // max_index_heads is 4
    SelectArgs a;
    a.heads = heads;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1, heads == 0 ? 1 : heads), a).status(),
                  kInvalidArgument, "num_heads");
  }
  for (int64_t topk : {0, -1, 33}) {  // max_topk is 32
    SelectArgs a;
    a.topk = topk;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kInvalidArgument, "topk");
  }
  {
    SelectArgs a;
    a.init_blocks = -1;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kInvalidArgument,
                  "init_blocks");
    a.init_blocks = std::nullopt;
    a.local_blocks = -2;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kInvalidArgument,
                  "local_blocks");
    a.local_blocks = std::nullopt;
    a.start = -1;
    EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kInvalidArgument,
                  "start_position");
  }
  EXPECT_STATUS(AppendKeys(*engine_, "", 0, Keys(1)).status(), kInvalidArgument, "sequence_id");
  EXPECT_STATUS(AppendKeys(*engine_, std::string(257, 'x'), 0, Keys(1)).status(), kInvalidArgument,
                "sequence_id");
  EXPECT_STATUS(engine_->Release("").status(), kInvalidArgument, "sequence_id");
  // A select without queries.
  StepRequest empty;
  empty.sequence_id = "a";
  empty.num_heads = 1;
  empty.query_dtype = WireDtype::kBf16;
  EXPECT_EQ(engine_->Select(empty).status().code(), absl::StatusCode::kInvalidArgument);
  // An append whose sequence_id differs from the step's.
  const std::string k = Bytes(Keys(1));
  const std::string q = Bytes(Keys(1));
  StepRequest mismatch = Bf16Select("a", 0, 1, q);
  mismatch.append = Bf16Append("b", 0, k);
  EXPECT_STATUS(engine_->Select(mismatch).status(), kInvalidArgument, "sequence_id");
  ExpectUnchanged(before);
  // Huge init/local counts are valid and mean "every block".
  SelectArgs a;
  a.init_blocks = int64_t{1} << 40;
  a.local_blocks = int64_t{1} << 40;
  absl::StatusOr<StepResult> all = SelectQueries(*engine_, "a", Keys(1), a);
  ASSERT_TRUE(all.ok()) << all.status();
  Ids want(8, -1);
  want[0] = 0;
  EXPECT_EQ(all->block_ids, want);
}

TEST_F(EngineTest, ConfiguredLimitsAreEnforcedAndApplyNothing) {
  EngineConfig c = SmallEngineConfig();
  c.max_tokens_per_sequence = 300;
  c.max_query_tokens = 16;
  Init(c);
  AppendOk("a", 0, 200);
  const Snapshot before = Take({"a", "b"});
  // One append longer than a sequence may be: the request itself is invalid.
  EXPECT_STATUS(AppendKeys(*engine_, "b", 0, Keys(301)).status(), kInvalidArgument,
                "max_tokens_per_sequence");
  // An append that would take a sequence past it: a configured limit, RESOURCE_EXHAUSTED.
  EXPECT_STATUS(AppendKeys(*engine_, "a", 0, Keys(101)).status(), kResourceExhausted,
                "max_tokens_per_sequence");
  // More query tokens than one span may have.
  SelectArgs a;
  EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(17), a).status(), kInvalidArgument,
                "query tokens");
  // Sequence ids: 256 bytes are fine, 257 are not.
  EXPECT_EQ(AppendKeys(*engine_, std::string(257, 'b'), 0, Keys(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUnchanged(before);
  AppendOk("a", 0, 100);  // exactly the limit
  ExpectSelects("a", 0, 16);
  AppendOk(std::string(256, 'b'), 0, 5);
  ExpectSelects(std::string(256, 'b'));
}

TEST_F(EngineTest, LargestAttentionPageIdsDoNotOverflowThePageTable) {
  // With 8 pages per block and stride 8, attention page ids up to (2^31 - 8) / 8 = 268435455
  // give page-table entries up to 2^31 - 1; one more is refused.
  const int32_t top = 268435455;
  EXPECT_STATUS(AppendKeys(*engine_, "s", 0, Keys(200), {0, top + 1}).status(), kInvalidArgument,
                "attention_pages[1]");
  AppendOk("s", 0, 200, {top, top - 1});
  absl::StatusOr<StepResult> r = SelectQueries(*engine_, "s", Keys(1), SelectArgs{});
  ASSERT_TRUE(r.ok()) << r.status();
  // Selection [1 (local), 0]: full block 0 first, then the tail block 1.
  ASSERT_EQ(r->block_ids[0], 1);
  ASSERT_EQ(r->block_ids[1], 0);
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(r->page_table[j], int64_t{top} * 8 + j);
    EXPECT_EQ(r->page_table[8 + j], int64_t{top - 1} * 8 + j);
  }
  EXPECT_EQ(r->page_table[7], 2147483647);
  EXPECT_EQ(r->context_lens[0], 200);
  ExpectSelects("s");
}

TEST_F(EngineTest, SpansMustLieInsideTheLayersLength) {
  EngineConfig c = SmallEngineConfig();
  c.layers = 2;
  Init(c);
  AppendOk("a", 0, 10);
  const Snapshot before = Take({"a"});
  SelectArgs a;
  a.start = 10;
  EXPECT_STATUS(SelectQueries(*engine_, "a", Keys(1), a).status(), kFailedPrecondition, "a");
  a.start = 8;
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(3), a).status().code(),
            absl::StatusCode::kFailedPrecondition);
  a.start = std::nullopt;  // default start 10 - 11 < 0
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(11), a).status().code(),
            absl::StatusCode::kFailedPrecondition);
  a.layer = 1;  // layer 1 is empty
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(1), a).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Start positions whose end would overflow int64.
  a.layer = 0;
  for (int64_t start : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 1,
                        int64_t{1} << 62}) {
    a.start = start;
    EXPECT_EQ(SelectQueries(*engine_, "a", Keys(3), a).status().code(),
              absl::StatusCode::kFailedPrecondition)
        << start;
  }
  ExpectUnchanged(before);
  ExpectSelects("a", 0, 1, 9);
  ExpectSelects("a", 0, 10, 0);
  ExpectSelects("a", 0, 10);
}

// The idle TTL releases only sequences no call has named: reading one (Get) names it.
TEST_F(EngineTest, GetKeepsASequenceFromTheIdleTtl) {
  AppendOk("read", 0, 10);
  AppendOk("idle", 0, 10);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(engine_->Get("read").ok());
  EXPECT_EQ(engine_->ReclaimIdle(absl::Milliseconds(200)), 1);
  EXPECT_TRUE(engine_->Get("read").ok()) << "reclaimed although just read";
  EXPECT_EQ(engine_->Get("idle").status().code(), absl::StatusCode::kNotFound);
}

// Once the server abandons selections (shutdown past the drain), a selection fails with
// CANCELLED and its step, append included, is rolled back; appends alone still apply.
TEST_F(EngineTest, AbandonedSelectionsFailCancelledAndApplyNothing) {
  AppendOk("a", 0, 200);
  engine_->AbandonSelections();
  const std::string k = Bytes(Keys(1));
  const std::string q = Bytes(Keys(1));
  StepRequest s;
  s.sequence_id = "a";
  s.num_heads = 1;
  s.query_dtype = WireDtype::kBf16;
  s.queries = q;
  s.append.emplace();
  s.append->dtype = WireDtype::kBf16;
  s.append->keys = k;
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(engine_->Get("a")->lengths[0], 200);
  AppendOk("a", 0, 5);
  EXPECT_EQ(engine_->Get("a")->lengths[0], 205);
}

// Outputs given memory by the caller go there (the results' vectors stay empty), memory too
// small for the shape is refused, and an item the caller refused fails with its status,
// applying nothing.
TEST_F(EngineTest, ProvidedOutputsAndRefusedItems) {
  AppendOk("a", 0, 600);
  const std::string q = Bytes(Keys(2));
  StepRequest s;
  s.sequence_id = "a";
  s.num_heads = 1;
  s.query_dtype = WireDtype::kBf16;
  s.queries = q;
  s.topk = 4;
  absl::StatusOr<StepResult> inline_result = engine_->Select(s);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();
  ASSERT_EQ(inline_result->block_ids.size(), 8u);

  std::vector<int32_t> memory(9, -7);
  StepRequest provided = s;
  provided.outputs.block_ids = memory;
  absl::StatusOr<StepResult> r = engine_->Select(provided);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->block_ids.empty());
  EXPECT_EQ(std::vector<int32_t>(memory.begin(), memory.begin() + 8), inline_result->block_ids);
  EXPECT_EQ(memory[8], -7) << "written past the shape";

  provided.outputs.block_ids = std::span<int32_t>(memory).first(7);
  EXPECT_STATUS(engine_->Select(provided).status(), kInvalidArgument, "block_ids");
  provided.outputs = {};
  provided.outputs.context_lens = std::span<int32_t>(memory).first(1);
  EXPECT_STATUS(engine_->Select(provided).status(), kInvalidArgument, "context_lens");

  const std::string k = Bytes(Keys(1));
  StepRequest refused = s;
  refused.append.emplace();
  refused.append->dtype = WireDtype::kBf16;
  refused.append->keys = k;
  refused.refused = absl::NotFoundError("keys_ref: region \"r\" is not registered");
  EXPECT_STATUS(engine_->Select(refused).status(), kNotFound, "keys_ref");
  EXPECT_EQ(engine_->Get("a")->lengths[0], 600) << "a refused item's append was applied";
}

TEST_F(EngineTest, UnknownSequencesAreNotFound) {
  AppendOk("a", 0, 10);
  EXPECT_STATUS(SelectQueries(*engine_, "nope", Keys(1), {}).status(), kNotFound, "nope");
  EXPECT_STATUS(engine_->Release("nope").status(), kNotFound, "nope");
  EXPECT_STATUS(engine_->Truncate("nope", 1).status(), kNotFound, "nope");
  EXPECT_STATUS(engine_->Fork("nope", "b", std::nullopt).status(), kNotFound, "nope");
  EXPECT_STATUS(engine_->Get("nope").status(), kNotFound, "nope");
  EXPECT_EQ(engine_->Stats().live_sequences, 1);
  ASSERT_TRUE(engine_->Release("a").ok());
  EXPECT_EQ(engine_->Get("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Release("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(1), {}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, ForkOntoAnExistingIdIsAlreadyExistsAndChangesNothing) {
  AppendOk("a", 0, 200);
  AppendOk("b", 0, 10);
  const Snapshot before = Take({"a", "b"});
  EXPECT_STATUS(engine_->Fork("a", "b", std::nullopt).status(), kAlreadyExists, "b");
  EXPECT_STATUS(engine_->Fork("a", "a", std::nullopt).status(), kInvalidArgument, "target_id");
  EXPECT_STATUS(engine_->Fork("a", "c", -1).status(), kInvalidArgument, "length");
  ExpectUnchanged(before);
  EXPECT_EQ(engine_->Get("a")->shared_pages, 0);
}

// ---------------------------------------------------------------------------------------------
// Pool exhaustion

TEST_F(EngineTest, PoolExhaustionAppliesNothing) {
  EngineConfig c = SmallEngineConfig();
  c.capacity_pages = 4;
  Init(c);
  AppendOk("a", 0, 300);  // 3 pages
  EXPECT_EQ(FreePages(), 1);
  Snapshot before = Take({"a", "b"});
  // A new sequence that does not fit is not created.
  EXPECT_STATUS(AppendKeys(*engine_, "b", 0, Keys(200)).status(), kResourceExhausted, "b");
  // An existing one keeps its length; 300 -> 600 tokens needs blocks 3 and 4.
  EXPECT_EQ(AppendKeys(*engine_, "a", 0, Keys(300)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // A select carrying such an append applies neither.
  {
    const std::string k = Bytes(Keys(300));
    const std::string q = Bytes(Keys(1));
    StepRequest s;
    s.sequence_id = "a";
    s.append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
    s.num_heads = 1;
    s.query_dtype = WireDtype::kBf16;
    s.queries = q;
    EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kResourceExhausted);
    s.sequence_id = "b";
    EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kResourceExhausted);
  }
  ExpectUnchanged(before);
  EXPECT_EQ(engine_->Get("b").status().code(), absl::StatusCode::kNotFound);
  ExpectSelects("a");
  ExpectSelects("a", 0, 300, 0);

  AppendOk("b", 0, 100);  // the last page
  EXPECT_EQ(FreePages(), 0);
  AppendOk("a", 0, 1);    // inside block 2: no page needed
  before = Take({"a", "b"});
  EXPECT_EQ(AppendKeys(*engine_, "a", 0, Keys(100)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged(before);
  // Copy-on-write needs a page too: c shares a's partial block 2; appending to c must copy it.
  ASSERT_TRUE(engine_->Fork("a", "c", std::nullopt).ok());
  model_["c"] = model_.at("a");
  before = Take({"a", "b", "c"});
  EXPECT_EQ(AppendKeys(*engine_, "c", 0, Keys(1)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged(before);
  ExpectSelects("a");
  ExpectSelects("c");
  // Free b's page: now the copy fits, and a is untouched by c's append.
  ASSERT_EQ(*engine_->Release("b"), 1);
  model_.erase("b");
  AppendOk("c", 0, 1);
  EXPECT_EQ(FreePages(), 0);
  EXPECT_EQ(engine_->Get("c")->shared_pages, 2);
  EXPECT_EQ(engine_->Get("a")->shared_pages, 2);
  ExpectSelects("a");
  ExpectSelects("c");
  ExpectSelects("c", 0, 4);
}

TEST_F(EngineTest, AllLayersAppendExhaustionAppliesNothing) {
  EngineConfig c = SmallEngineConfig();
  c.capacity_pages = 3;
  c.layers = 2;
  Init(c);
  AppendOk("a", 0, 200);
  AppendOk("a", 1, 10);
  const Snapshot before = Take({"a", "n"});
  // Layer 0 would reach 200 + 200 = 400 tokens: blocks 2 and 3, one page short.
  EXPECT_EQ(AppendKeys(*engine_, "a", 0, Keys(200, 2), {}, true).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(AppendKeys(*engine_, "n", 0, Keys(400, 2), {}, true).status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged(before);
  ExpectSelects("a", 0);
  ExpectSelects("a", 1);
}

// ---------------------------------------------------------------------------------------------
// Attention pages

TEST_F(EngineTest, AttentionPagesFollowTheFirstAppend) {
  // With attention pages: one per block each append opens.
  AppendOk("s", 0, 300, {7, 8, 9});
  ExpectShape("s");
  Snapshot before = Take({"s", "t"});
  // 10 tokens inside block 2 open no block: no ids allowed.
  EXPECT_STATUS(AppendKeys(*engine_, "s", 0, Keys(10), {1}).status(), kInvalidArgument,
                "attention_pages");
  // 300 -> 500 tokens opens blocks 3: exactly one id.
  EXPECT_STATUS(AppendKeys(*engine_, "s", 0, Keys(200)).status(), kInvalidArgument,
                "attention_pages");
  EXPECT_EQ(AppendKeys(*engine_, "s", 0, Keys(200), {1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(AppendKeys(*engine_, "s", 0, Keys(200), {-1}).status(), kInvalidArgument,
                "attention_pages");
  ExpectUnchanged(before);
  AppendOk("s", 0, 10);
  AppendOk("s", 0, 190, {4});
  ExpectShape("s");
  ExpectSelects("s");
  ExpectSelects("s", 0, 40, 100);  // a span across blocks: rows and context lengths per token

  // A first append with the wrong count fails and does not decide anything: the sequence does
  // not exist afterwards, and a later append without ids creates it without attention pages.
  EXPECT_EQ(AppendKeys(*engine_, "t", 0, Keys(300), {1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Get("t").status().code(), absl::StatusCode::kNotFound);
  AppendOk("t", 0, 100);
  before = Take({"s", "t"});
  EXPECT_STATUS(AppendKeys(*engine_, "t", 0, Keys(100), {5}).status(), kFailedPrecondition, "t");
  ExpectUnchanged(before);
  SelectArgs a;
  absl::StatusOr<StepResult> r = SelectQueries(*engine_, "t", Keys(1), a);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->page_table.empty());
  EXPECT_TRUE(r->context_lens.empty());
  ExpectSelects("t");
}

TEST_F(EngineTest, AttentionPagesCountBlocksOpenedByAnyLayer) {
  EngineConfig c = SmallEngineConfig();
  c.layers = 2;
  c.page_table = kernels::PageTableParams{3, 5};
  Init(c);
  AppendOk("s", 0, 200, {11, 12});
  // Layer 1 stays inside blocks 0 and 1: no ids.
  EXPECT_EQ(AppendKeys(*engine_, "s", 1, Keys(150), {13}).status().code(),
            absl::StatusCode::kInvalidArgument);
  AppendOk("s", 1, 150);
  AppendOk("s", 1, 150, {13});  // layer 1 reaches 300 tokens: opens block 2
  ExpectShape("s");
  for (int l = 0; l < 2; ++l) {
    ExpectSelects("s", l);
    ExpectSelects("s", l, 30, 100);
  }
}

// ---------------------------------------------------------------------------------------------
// Select with an append

TEST_F(EngineTest, SelectWithAppendAppliesBothOrNeither) {
  AppendOk("a", 0, 100);
  const Snapshot before = Take({"a", "new"});
  const std::vector<uint16_t> k = Keys(10);
  const std::string kb = Bytes(k);
  const std::vector<uint16_t> q = Keys(3, 2);
  const std::string qb = Bytes(q);
  StepRequest s;
  s.sequence_id = "a";
  s.append = AppendRequest{"a", 0, false, WireDtype::kBf16, kb, {}};
  s.num_heads = 2;
  s.query_dtype = WireDtype::kBf16;
  s.queries = qb;
  // A span past the new length: 110 tokens after the append.
  s.start_position = 108;
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kFailedPrecondition);
  s.start_position = std::nullopt;
  s.topk = 0;
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.topk = std::nullopt;
  s.sequence_id = "new";
  s.append->sequence_id = "";
  s.start_position = 20;
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kFailedPrecondition);
  ExpectUnchanged(before);

  // Valid: the span may use the appended keys. Default start = 110 - 3.
  s.sequence_id = "a";
  s.start_position = std::nullopt;
  absl::StatusOr<StepResult> r = engine_->Select(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->created);
  EXPECT_EQ(r->lengths, (std::vector<int64_t>{110}));
  EXPECT_EQ(r->start_position, 107);
  EXPECT_EQ(r->num_tokens, 3);
  EXPECT_EQ(r->topk, 8);
  model_.at("a").Append(0, k);
  ExpectSameSelection(*r, ExpectedSelect(config_, model_.at("a"), 0, 107, 3, 2, q, {8, 0, 1}));
  // Explicit start position, on a new sequence created by the step.
  s.sequence_id = "new";
  s.start_position = 5;
  r = engine_->Select(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->created);
  EXPECT_EQ(r->start_position, 5);
  ModelFor("new").Append(0, k);
  ExpectSameSelection(*r, ExpectedSelect(config_, model_.at("new"), 0, 5, 3, 2, q, {8, 0, 1}));
}

TEST_F(EngineTest, BackendFailuresUndoTheAppend) {
  Init(SmallEngineConfig(), /*flaky=*/true);
  AppendOk("a", 0, 200);
  const Snapshot before = Take({"a", "new"});
  const std::string k = Bytes(Keys(100));
  const std::string q = Bytes(Keys(1));
  StepRequest s;
  s.num_heads = 1;
  s.query_dtype = WireDtype::kBf16;
  s.queries = q;
  s.append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
  // The selection fails after the append was applied: the append is taken back.
  flaky_->fail_select = true;
  for (const char* id : {"a", "new"}) {
    s.sequence_id = id;
    EXPECT_STATUS(engine_->Select(s).status(), kInternal, "injected");
  }
  flaky_->fail_select = false;
  ExpectUnchanged(before);
  flaky_->fail_write = true;
  EXPECT_STATUS(AppendKeys(*engine_, "a", 0, Keys(100)).status(), kInternal, "injected");
  EXPECT_STATUS(AppendKeys(*engine_, "new", 0, Keys(100)).status(), kInternal, "injected");
  flaky_->fail_write = false;
  ExpectUnchanged(before);
  ExpectSelects("a");
  ExpectSelects("a", 0, 200, 0);

  // Copy-on-write: a failed page copy applies nothing either.
  ASSERT_TRUE(engine_->Fork("a", "b", std::nullopt).ok());
  model_["b"] = model_.at("a");
  const Snapshot forked = Take({"a", "b"});
  flaky_->fail_copy = true;
  EXPECT_STATUS(AppendKeys(*engine_, "a", 0, Keys(1)).status(), kInternal, "injected");
  EXPECT_STATUS(AppendKeys(*engine_, "b", 0, Keys(100)).status(), kInternal, "injected");
  flaky_->fail_copy = false;
  ExpectUnchanged(forked);
  AppendOk("a", 0, 60);
  AppendOk("b", 0, 70);
  ExpectSelects("a", 0, 3);
  ExpectSelects("b", 0, 3);
}

// A Batch step over many sequences writes every item's keys in one backend call (one device
// round trip per wave); when that call fails, every item that wrote in it is taken back.
TEST_F(EngineTest, AWaveWritesItsKeysInOneBackendCall) {
  Init(SmallEngineConfig(), /*flaky=*/true);
  for (const char* id : {"a", "b", "c"}) AppendOk(id, 0, 150);
  const std::string q = Bytes(Keys(1));
  std::vector<std::string> keys;
  keys.reserve(8);
  auto step_items = [&](bool record) {
    std::vector<StepRequest> items;
    keys.clear();
    for (const char* id : {"a", "b", "c", "d"}) {
      StepRequest s;
      s.sequence_id = id;
      const std::vector<uint16_t> k = Keys(2);
      keys.push_back(Bytes(k));
      s.append = AppendRequest{"", 0, false, WireDtype::kBf16, keys.back(), {}};
      if (std::string(id) != "d") {  // "d": an append alone, creating the sequence
        s.num_heads = 1;
        s.query_dtype = WireDtype::kBf16;
        s.queries = q;
      }
      if (record) ModelFor(id).Append(0, k);
      items.push_back(s);
    }
    return items;
  };
  const int64_t batches = flaky_->write_batches, writes = flaky_->batched_writes;
  auto results = engine_->Batch(step_items(/*record=*/true));
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(flaky_->write_batches - batches, 1);
  EXPECT_EQ(flaky_->batched_writes - writes, 4);
  EXPECT_TRUE(results[3]->created);
  for (const char* id : {"a", "b", "c", "d"}) {
    ExpectSelects(id, 0, 1);
    ExpectSelects(id, 0, 2);
  }

  const Snapshot before = Take({"a", "b", "c", "d", "e"});
  flaky_->fail_write = true;
  std::vector<StepRequest> failing = step_items(/*record=*/false);
  failing[3].sequence_id = "e";  // would be created
  results = engine_->Batch(failing);
  flaky_->fail_write = false;
  for (const auto& r : results) EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  ExpectUnchanged(before);
  for (const char* id : {"a", "b", "c"}) ExpectSelects(id, 0, 3);
  ExpectSelects("d", 0, 2);
}

// The answer budget (max_response_bytes) a step took is given back when the step fails after
// taking it: a later item of the same call still fits. Every item reserves the bytes of an error
// answer (LateErrorReservation); a success takes what its results need beyond that.
TEST_F(EngineTest, AFailedStepGivesItsAnswerBytesBack) {
  EngineConfig c = SmallEngineConfig();
  const int topk = 128;
  // One item's answer: 64 + 8 per layer + 4 bytes per block id (1 token x 1 head x topk).
  const int64_t answer = 64 + 8 * c.layers + 4 * topk;
  const int64_t reserve = engine::LateErrorReservation("a");
  ASSERT_GT(answer, reserve);
  // Two reservations and one answer's excess: the second item fits only if the first, which
  // fails, gave its excess back.
  c.max_response_bytes = 2 * reserve + (answer - reserve);
  c.max_topk = topk;
  Init(c);
  AppendOk("a", 0, 300);
  const std::string q = Bytes(Keys(1));
  const std::string k = Bytes(Keys(1));
  const std::vector<int32_t> attn = {7};
  std::vector<StepRequest> items(2);
  for (StepRequest& s : items) {
    s.sequence_id = "a";  // the same sequence: two waves, in item order
    s.num_heads = 1;
    s.query_dtype = WireDtype::kBf16;
    s.queries = q;
    s.topk = topk;
  }
  // Fails when its append is applied (the sequence has no attention pages), after the budget
  // check.
  items[0].append = AppendRequest{"", 0, false, WireDtype::kBf16, k, attn};
  const auto results = engine_->Batch(items);
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kFailedPrecondition) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  ExpectSelects("a", 0, 1, std::nullopt, /*heads=*/1);
}

// A call whose answer could exceed max_response_bytes even if every item failed is refused
// whole, and nothing of it is applied (a good append among many items that fail their checks).
TEST_F(EngineTest, ACallWhoseErrorsAloneWouldNotFitAppliesNothing) {
  EngineConfig c = SmallEngineConfig();
  c.max_response_bytes = 4096;
  Init(c);
  const std::string k = Bytes(Keys(1));
  std::vector<StepRequest> items(200);
  items[0].sequence_id = "good";
  items[0].append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
  for (size_t i = 1; i < items.size(); ++i) items[i].sequence_id = "empty";  // nothing to do
  const auto results = engine_->Batch(items);
  for (const auto& r : results) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  }
  EXPECT_EQ(engine_->Get("good").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FreePages(), config_.capacity_pages);
}

// engine.h: "Every failed request leaves the engine exactly as it found it". A select whose
// append copied a shared page and whose selection then fails must give the copy back too.
TEST_F(EngineTest, BackendFailureAfterACopyOnWriteAppendLeavesTheEngineAsItWas) {
  Init(SmallEngineConfig(), /*flaky=*/true);
  AppendOk("a", 0, 200);
  ASSERT_TRUE(engine_->Fork("a", "b", std::nullopt).ok());
  model_["b"] = model_.at("a");
  const Snapshot before = Take({"a", "b"});
  const std::string k = Bytes(Keys(100));  // writes the shared block 1, opens block 2
  const std::string q = Bytes(Keys(1));
  StepRequest s;
  s.sequence_id = "b";
  s.num_heads = 1;
  s.query_dtype = WireDtype::kBf16;
  s.queries = q;
  s.append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
  flaky_->fail_select = true;
  EXPECT_EQ(engine_->Select(s).status().code(), absl::StatusCode::kInternal);
  flaky_->fail_select = false;
  ExpectUnchanged(before);
  // Whatever the page accounting, the keys are as before and both sequences still work.
  ExpectSelects("a", 0, 200, 0);
  ExpectSelects("b", 0, 200, 0);
  AppendOk("b", 0, 10);
  ExpectSelects("a", 0, 200, 0);
  ExpectSelects("b", 0, 210, 0);
  ASSERT_TRUE(engine_->Release("a").ok());
  ASSERT_TRUE(engine_->Release("b").ok());
  EXPECT_EQ(FreePages(), config_.capacity_pages);
}

// ---------------------------------------------------------------------------------------------
// Batch

TEST_F(EngineTest, BatchItemsHaveTheirOwnStatusesAndApplyInOrder) {
  AppendOk("w", 0, 50);
  const std::vector<uint16_t> k1 = Keys(20), k2 = Keys(30);
  const std::string k1b = Bytes(k1), k2b = Bytes(k2), bad = Bytes(std::vector<uint16_t>(D(), 0x7f80));
  const std::vector<uint16_t> q = Keys(1, 2);
  const std::string qb = Bytes(q);
  const auto step = [&](const char* id) {
    StepRequest s;
    s.sequence_id = id;
    s.num_heads = 2;
    s.query_dtype = WireDtype::kBf16;
    s.queries = qb;
    return s;
  };
  std::vector<StepRequest> items;
  items.push_back(step("x"));  // 0: creates x with 20 keys, selects
  items.back().append = AppendRequest{"", 0, false, WireDtype::kBf16, k1b, {}};
  items.push_back(step("y"));  // 1: bad topk
  items.back().topk = 0;
  items.push_back(step("z"));  // 2: unknown sequence
  items.push_back(step("x"));  // 3: appends 30 more to x: sees item 0's keys
  items.back().append = AppendRequest{"x", 0, false, WireDtype::kBf16, k2b, {}};
  items.push_back(step("x"));  // 4: Inf key: refused, x untouched
  items.back().append = AppendRequest{"x", 0, false, WireDtype::kBf16, bad, {}};
  items.push_back(step("w"));  // 5: plain select
  items.push_back(step("x"));  // 6: select only, after item 3
  items.back().start_position = 10;
  std::vector<absl::StatusOr<StepResult>> r = engine_->Batch(items);
  ASSERT_EQ(r.size(), items.size());
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_TRUE(r[0]->created);
  EXPECT_EQ(r[0]->lengths, (std::vector<int64_t>{20}));
  EXPECT_EQ(r[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r[2].status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(r[3].ok()) << r[3].status();
  EXPECT_FALSE(r[3]->created);
  EXPECT_EQ(r[3]->lengths, (std::vector<int64_t>{50}));
  EXPECT_EQ(r[3]->start_position, 49);
  EXPECT_STATUS(r[4].status(), kInvalidArgument, "keys");
  ASSERT_TRUE(r[5].ok()) << r[5].status();
  ASSERT_TRUE(r[6].ok()) << r[6].status();
  EXPECT_EQ(r[6]->lengths, (std::vector<int64_t>{50}));

  SeqModel x(1, D());
  x.Append(0, k1);
  const SpanResult want0 = ExpectedSelect(config_, x, 0, 19, 1, 2, q, {8, 0, 1});
  x.Append(0, k2);
  ExpectSameSelection(*r[0], want0);
  ExpectSameSelection(*r[3], ExpectedSelect(config_, x, 0, 49, 1, 2, q, {8, 0, 1}));
  ExpectSameSelection(*r[6], ExpectedSelect(config_, x, 0, 10, 1, 2, q, {8, 0, 1}));
  ExpectSameSelection(*r[5], ExpectedSelect(config_, model_.at("w"), 0, 49, 1, 2, q, {8, 0, 1}));
  EXPECT_EQ(engine_->Get("y").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Get("x")->lengths, (std::vector<int64_t>{50}));
}

TEST_F(EngineTest, BatchOverTheItemLimitIsRefusedWhole) {
  EngineConfig c = SmallEngineConfig();
  c.max_batch_items = 2;
  Init(c);
  const std::string k = Bytes(Keys(5));
  std::vector<StepRequest> items(3);
  for (int i = 0; i < 3; ++i) {
    items[i].sequence_id = i == 0 ? "a" : i == 1 ? "b" : "c";
    items[i].append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
  }
  for (const auto& r : engine_->Batch(items)) {
    EXPECT_STATUS(r.status(), kInvalidArgument, "max_batch_items");
  }
  EXPECT_EQ(engine_->Stats().live_sequences, 0);
  items.pop_back();
  for (const auto& r : engine_->Batch(items)) EXPECT_TRUE(r.ok()) << r.status();
}

// ---------------------------------------------------------------------------------------------
// Deadlines and cancellation

TEST_F(EngineTest, PastDeadlinesAndCancelledCallsApplyNothing) {
  AppendOk("a", 0, 100);
  const Snapshot before = Take({"a", "new"});
  CallControl past;
  past.deadline = absl::Now() - absl::Seconds(1);
  CallControl cancelled;
  cancelled.cancelled = [] { return true; };
  EXPECT_EQ(AppendKeys(*engine_, "a", 0, Keys(10), {}, false, past).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(AppendKeys(*engine_, "new", 0, Keys(10), {}, false, past).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(AppendKeys(*engine_, "a", 0, Keys(10), {}, false, cancelled).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(1), {}, past).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(1), {}, cancelled).status().code(),
            absl::StatusCode::kCancelled);
  const std::string k = Bytes(Keys(10));
  std::vector<StepRequest> items(2);
  items[0].sequence_id = "a";
  items[0].append = AppendRequest{"", 0, false, WireDtype::kBf16, k, {}};
  items[1].sequence_id = "new";
  items[1].append = items[0].append;
  for (const auto& r : engine_->Batch(items, past)) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  }
  ExpectUnchanged(before);
  // A deadline in the future is fine.
  CallControl future;
  future.deadline = absl::Now() + absl::Seconds(60);
  EXPECT_TRUE(AppendKeys(*engine_, "a", 0, Keys(10), {}, false, future).ok());
  // Cancelled after the first item on a sequence was applied: the first stays applied, the
  // second is CANCELLED and not applied. A wave's call is checked twice before it is applied
  // (before the wave, and by the batcher before its launch).
  std::atomic<int> checks{0};
  CallControl later;
  later.cancelled = [&] { return checks.fetch_add(1) >= 2; };
  items[1].sequence_id = "a";
  std::vector<absl::StatusOr<StepResult>> r = engine_->Batch(items, later);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_EQ(r[1].status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(engine_->Get("a")->lengths, (std::vector<int64_t>{120}));
}

// ---------------------------------------------------------------------------------------------
// Fork, truncate, release and copy-on-write

TEST_F(EngineTest, ForkSharesPagesAndAppendsCopyTheSharedPartialPage) {
  const int64_t total = config_.capacity_pages;
  AppendOk("a", 0, 200);  // block 1 is partial
  absl::StatusOr<engine::ForkResult> f = engine_->Fork("a", "b", std::nullopt);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->lengths, (std::vector<int64_t>{200}));
  EXPECT_EQ(f->num_blocks, 2);
  EXPECT_EQ(f->pages_shared, 2);
  model_["b"] = model_.at("a");
  EXPECT_EQ(FreePages(), total - 2);
  SequenceInfo a = *engine_->Get("a");
  SequenceInfo b = *engine_->Get("b");
  EXPECT_EQ(a.pages, b.pages);
  EXPECT_EQ(a.shared_pages, 2);
  EXPECT_EQ(b.shared_pages, 2);
  ExpectSelects("b");

  // b writes into the shared block 1: it gets its own copy; a's keys stay as they were.
  AppendOk("b", 0, 10);
  EXPECT_EQ(FreePages(), total - 3);
  a = *engine_->Get("a");
  b = *engine_->Get("b");
  EXPECT_EQ(a.pages[0], b.pages[0]);
  EXPECT_NE(a.pages[1], b.pages[1]);
  EXPECT_EQ(a.shared_pages, 1);
  EXPECT_EQ(b.shared_pages, 1);
  ExpectSelects("a");
  ExpectSelects("a", 0, 200, 0);
  ExpectSelects("b");
  ExpectSelects("b", 0, 210, 0);
  // a's block 1 is now its own: written in place, no page taken.
  AppendOk("a", 0, 20);
  EXPECT_EQ(FreePages(), total - 3);
  EXPECT_EQ(engine_->Get("a")->pages[1], a.pages[1]);
  ExpectSelects("a", 0, 5);
  ExpectSelects("b", 0, 5);

  // Fork at a length inside block 1: c shares both pages and must copy block 1 to append,
  // leaving a's tokens 150.. intact.
  ASSERT_TRUE(engine_->Fork("a", "c", 150).ok());
  model_["c"] = model_.at("a");
  model_["c"].Truncate(150);
  ExpectShape("c");
  ExpectSelects("c");
  AppendOk("c", 0, 5);
  EXPECT_EQ(FreePages(), total - 4);
  ExpectSelects("a", 0, 220, 0);
  ExpectSelects("c", 0, 155, 0);
  // A fork length past the source's length (up to the wire's uint32 maximum) keeps it all.
  absl::StatusOr<engine::ForkResult> whole = engine_->Fork("a", "e", int64_t{4294967295});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->lengths, (std::vector<int64_t>{220}));
  ASSERT_TRUE(engine_->Release("e").ok());
  // Fork at a block boundary: d shares only block 0; its next append takes a fresh page.
  ASSERT_TRUE(engine_->Fork("a", "d", 128).ok());
  model_["d"] = model_.at("a");
  model_["d"].Truncate(128);
  EXPECT_EQ(engine_->Get("d")->pages.size(), 1u);
  AppendOk("d", 0, 3);
  EXPECT_EQ(FreePages(), total - 5);
  EXPECT_EQ(engine_->Get("a")->shared_pages, 1);  // block 0: a, b, c, d
  for (const char* id : {"a", "b", "c", "d"}) ExpectSelects(id, 0, 4);
}

TEST_F(EngineTest, TruncateReleasesPagesAndALaterAppendCopiesASharedPage) {
  const int64_t total = config_.capacity_pages;
  AppendOk("a", 0, 300, {});
  ASSERT_TRUE(engine_->Fork("a", "b", std::nullopt).ok());
  model_["b"] = model_.at("a");
  // Truncating a keeps block 0; blocks 1 and 2 are still b's, so nothing is freed.
  absl::StatusOr<engine::TruncateResult> t = engine_->Truncate("a", 100);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->lengths, (std::vector<int64_t>{100}));
  EXPECT_EQ(t->num_blocks, 1);
  EXPECT_EQ(t->pages_freed, 0);
  model_.at("a").Truncate(100);
  EXPECT_EQ(FreePages(), total - 3);
  ExpectShape("a");
  EXPECT_EQ(engine_->Get("a")->shared_pages, 1);
  ExpectSelects("a");
  // Appending 50 to a writes into block 0, shared with b: a copies it (b keeps a's old tokens
  // 100..149) and takes a fresh page for block 1: two pages.
  AppendOk("a", 0, 50);
  EXPECT_EQ(FreePages(), total - 5);
  ExpectSelects("a", 0, 150, 0);
  ExpectSelects("b", 0, 300, 0);
  // Truncate past the length changes nothing, however far past (the wire's length is a uint32).
  for (int64_t len : {int64_t{1000}, int64_t{4294967295}}) {
    t = engine_->Truncate("a", len);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->lengths, (std::vector<int64_t>{150}));
    EXPECT_EQ(t->pages_freed, 0);
  }
  EXPECT_EQ(engine_->Truncate("a", -1).status().code(), absl::StatusCode::kInvalidArgument);
  // Releasing b frees its three pages (block 0 is b's alone since a copied it).
  absl::StatusOr<int64_t> freed = engine_->Release("b");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3);
  model_.erase("b");
  EXPECT_EQ(FreePages(), total - 2);
  // Truncating to 0 keeps the sequence, empty.
  t = engine_->Truncate("a", 0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->pages_freed, 2);
  EXPECT_EQ(t->num_blocks, 0);
  model_.at("a").Truncate(0);
  ExpectShape("a");
  EXPECT_EQ(engine_->Stats().live_sequences, 1);
  EXPECT_EQ(SelectQueries(*engine_, "a", Keys(1), {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  AppendOk("a", 0, 130);
  ExpectSelects("a", 0, 130, 0);
  ASSERT_TRUE(engine_->Release("a").ok());
  EXPECT_EQ(FreePages(), total);
}

TEST_F(EngineTest, ReleaseFreesOnlyPagesNobodyElseReferences) {
  const int64_t total = config_.capacity_pages;
  AppendOk("a", 0, 300);
  ASSERT_TRUE(engine_->Fork("a", "b", 200).ok());
  model_["b"] = model_.at("a");
  model_["b"].Truncate(200);
  absl::StatusOr<int64_t> freed = engine_->Release("a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 1);  // block 2 only
  model_.erase("a");
  EXPECT_EQ(FreePages(), total - 2);
  EXPECT_EQ(engine_->Get("b")->shared_pages, 0);
  ExpectSelects("b", 0, 200, 0);
  // b's partial block 1 is its own now: appended in place.
  AppendOk("b", 0, 20);
  EXPECT_EQ(FreePages(), total - 2);
  ExpectSelects("b", 0, 220, 0);
  freed = engine_->Release("b");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 2);
  EXPECT_EQ(FreePages(), total);
  EXPECT_EQ(engine_->Stats().live_sequences, 0);
}

TEST_F(EngineTest, CopyOnWriteCopiesEveryLayer) {
  EngineConfig c = SmallEngineConfig();
  c.layers = 2;
  Init(c);
  const int64_t total = c.capacity_pages;
  AppendOk("a", 0, 600);  // blocks 0..4
  AppendOk("a", 1, 300);  // blocks 0..2 of layer 1
  ASSERT_TRUE(engine_->Fork("a", "b", std::nullopt).ok());
  model_["b"] = model_.at("a");
  // b's layer 1 goes 300 -> 350: it writes block 2, shared: one copy, of both layers (b's
  // layer 0 tokens 256..383 live in the copied page too).
  AppendOk("b", 1, 50);
  EXPECT_EQ(FreePages(), total - 6);
  EXPECT_EQ(engine_->Get("b")->shared_pages, 4);
  // b's layer 0 goes 600 -> 630: it writes block 4, shared: a second copy, whose layer 1 half
  // is empty on both sides.
  AppendOk("b", 0, 30);
  EXPECT_EQ(FreePages(), total - 7);
  // a's layer 1 goes 300 -> 310: block 2 is a's alone now: in place.
  AppendOk("a", 1, 10);
  EXPECT_EQ(FreePages(), total - 7);
  for (const char* id : {"a", "b"}) {
    for (int l = 0; l < 2; ++l) {
      const int64_t len = model_.at(id).Len(l);
      ExpectSelects(id, l, static_cast<int>(len), 0);
    }
  }
}

TEST_F(EngineTest, ForkCarriesAttentionPages) {
  AppendOk("a", 0, 300, {5, 6, 7});
  ASSERT_TRUE(engine_->Fork("a", "b", 130).ok());
  model_["b"] = model_.at("a");
  model_["b"].Truncate(130);
  ExpectShape("b");
  ExpectSelects("b", 0, 10, 120);
  // 130 -> 330 tokens opens block 2, which needs an id of b's own; a's ids are unaffected.
  EXPECT_EQ(AppendKeys(*engine_, "b", 0, Keys(200)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AppendKeys(*engine_, "b", 0, Keys(200), {40, 41}).status().code(),
            absl::StatusCode::kInvalidArgument);
  AppendOk("b", 0, 200, {40});
  ExpectShape("b");
  ExpectShape("a");
  ExpectSelects("a", 0, 3);
  ExpectSelects("b", 0, 3);
  // Truncation drops the ids of dropped blocks.
  ASSERT_TRUE(engine_->Truncate("b", 129).ok());
  model_.at("b").Truncate(129);
  ExpectShape("b");
  AppendOk("b", 0, 200, {50});
  ExpectShape("b");
  ExpectSelects("b", 0, 30, 250);
}

}  // namespace
}  // namespace indexer::testing
