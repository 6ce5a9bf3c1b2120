// Engine::WriteSnapshot / RestoreSnapshot on their own: exact round trips (bf16 and fp8, shared
// pages, attention pages, tenants), refusal of corrupt and mismatched files with nothing loaded,
// atomic writes, and snapshots taken while other calls run.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu_backend.h"
#include "engine/crc32c.h"
#include "engine/engine.h"
#include "kernels/numeric.h"
#include "tests/security/security_test_util.h"
#include "tests/testing/bf16.h"
#include "tests/testing/engine_config.h"
#include "tests/testing/engine_requests.h"
#include "tests/testing/storages.h"

namespace indexer::testing {
namespace {

using engine::AppendRequest;
using engine::Engine;
using engine::EngineConfig;
using engine::StepRequest;
using engine::WireDtype;
using ::testing::HasSubstr;

EngineConfig SmallConfig(kernels::KeyStorage storage = kernels::KeyStorage::kBf16) {
  EngineConfig c = TwoLayerEngineConfig();
  c.key_storage = storage;
  c.capacity_pages = 48;
  c.max_topk = 16;
  c.defaults = kernels::SelectParams{6, 0, 1};
  c.cpu_threads = 1;
  return c;
}

std::unique_ptr<Engine> MakeEngine(const EngineConfig& c) {
  return std::make_unique<Engine>(c, std::make_unique<engine::CpuBackend>(c));
}

// Real-valued keys and queries, normal(0, 3) (so that fp8 rounding matters).
std::string Bf16Bytes(std::mt19937& rng, size_t n) { return Bytes(RandomBf16(rng, n, 3.0f)); }

void Append(Engine& e, const std::string& tenant, const std::string& id, int64_t layer, bool all,
            int tokens, std::mt19937& rng, std::vector<int32_t> attn = {}) {
  const EngineConfig& c = e.config();
  const std::string keys = Bf16Bytes(rng, size_t(tokens) * (all ? c.layers : 1) * c.head_dim);
  AppendRequest a{id, layer, all, WireDtype::kBf16, keys, attn};
  a.tenant = tenant;
  absl::StatusOr<engine::StepResult> r = e.Append(a);
  ASSERT_TRUE(r.ok()) << tenant << "/" << id << ": " << r.status();
}

// Two tenants using the same ids, forks sharing pages, copy-on-write, attention pages, partial
// blocks, a truncation: every kind of state.
void Populate(Engine& e, std::mt19937& rng) {
  for (const std::string tenant : {"", "beta"}) {
    Append(e, tenant, "a", 0, true, 300, rng, {4, 5, 6});
    Append(e, tenant, "a", 1, false, 100, rng, {7});
    ASSERT_TRUE(e.Fork("a", "fork", std::nullopt, tenant).ok());
    Append(e, tenant, "fork", 0, false, 3, rng);  // copy-on-write of a shared partial page
    ASSERT_TRUE(e.Fork("a", "short", 150, tenant).ok());
    Append(e, tenant, "b", 1, false, 129, rng);
    ASSERT_TRUE(e.Truncate("b", 100, tenant).ok());
  }
}

const std::vector<std::pair<std::string, std::string>> kIds = {
    {"", "a"}, {"", "fork"}, {"", "short"}, {"", "b"},
    {"beta", "a"}, {"beta", "fork"}, {"beta", "short"}, {"beta", "b"}};

struct Answer {
  std::vector<int32_t> ids, table, ctx;
  bool operator==(const Answer&) const = default;
};

// Selections for every sequence (or only `only`) and layer: decode and a span, fixed queries.
std::vector<Answer> Answers(Engine& e, const std::string& only = "") {
  std::mt19937 rng(99);
  std::vector<Answer> out;
  for (const auto& [tenant, id] : kIds) {
    if (!only.empty() && id != only) continue;
    absl::StatusOr<engine::SequenceInfo> info = e.Get(id, tenant);
    EXPECT_TRUE(info.ok()) << tenant << "/" << id << ": " << info.status();
    if (!info.ok()) continue;
    for (int layer = 0; layer < e.config().layers; ++layer) {
      if (info->lengths[layer] == 0) continue;
      for (int n : {1, 4}) {
        if (info->lengths[layer] < n) continue;
        const std::string q = Bf16Bytes(rng, size_t(n) * 2 * e.config().head_dim);
        StepRequest s = Bf16Select(id, layer, 2, q);
        s.tenant = tenant;
        s.init_blocks = 1;
        absl::StatusOr<engine::StepResult> r = e.Select(s);
        EXPECT_TRUE(r.ok()) << r.status();
        if (r.ok()) out.push_back(Answer{r->block_ids, r->page_table, r->context_lens});
      }
    }
  }
  return out;
}

void ExpectEmpty(Engine& e) {
  const engine::EngineStats stats = e.Stats();
  EXPECT_EQ(stats.live_sequences, 0);
  EXPECT_EQ(stats.free_pages, stats.total_pages);
}

class SnapshotRoundTrip : public ::testing::TestWithParam<kernels::KeyStorage> {};

TEST_P(SnapshotRoundTrip, RestoredEngineAnswersIdenticallyAndKeepsSharing) {
  TempDir dir;
  const EngineConfig config = SmallConfig(GetParam());
  std::mt19937 rng(7);
  auto before = MakeEngine(config);
  Populate(*before, rng);
  const std::vector<Answer> want = Answers(*before);
  ASSERT_FALSE(want.empty());
  engine::SnapshotStats written;
  ASSERT_TRUE(before->WriteSnapshot(dir.File("s.snap"), &written).ok());
  EXPECT_EQ(written.sequences, static_cast<int64_t>(kIds.size()));
  EXPECT_EQ(written.pages, before->Stats().total_pages - before->Stats().free_pages);
  EXPECT_THAT(FolderEntries(dir.path()), ::testing::ElementsAre("s.snap"));

  auto after = MakeEngine(config);
  engine::SnapshotStats restored;
  const absl::Status status = after->RestoreSnapshot(dir.File("s.snap"), &restored);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(restored.sequences, written.sequences);
  EXPECT_EQ(restored.pages, written.pages);
  EXPECT_EQ(restored.bytes, written.bytes);
  EXPECT_EQ(after->Stats().free_pages, before->Stats().free_pages);
  EXPECT_EQ(after->Stats().live_sequences, before->Stats().live_sequences);
  for (const std::string tenant : {"", "beta"}) {
    EXPECT_EQ(after->Usage(tenant).pages, before->Usage(tenant).pages) << tenant;
  }
  for (const auto& [tenant, id] : kIds) {
    absl::StatusOr<engine::SequenceInfo> a = before->Get(id, tenant), b = after->Get(id, tenant);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(b->lengths, a->lengths) << id;
    EXPECT_EQ(b->attention_pages, a->attention_pages) << id;
    EXPECT_EQ(b->shared_pages, a->shared_pages) << id;
  }
  EXPECT_TRUE(Answers(*after) == want);

  // Writing the restored state gives the very same file: nothing was lost or invented.
  ASSERT_TRUE(after->WriteSnapshot(dir.File("again.snap")).ok());
  EXPECT_EQ(ReadFile(dir.File("again.snap")), ReadFile(dir.File("s.snap")));

  // Shared pages stay copy-on-write after the restore: appending into the fork's shared pages
  // leaves its source as it was, and both engines carry on alike.
  const std::vector<Answer> source = Answers(*after, "a");
  std::mt19937 more_after(3), more_before(3);
  Append(*after, "", "fork", 1, false, 20, more_after);
  Append(*before, "", "fork", 1, false, 20, more_before);
  EXPECT_TRUE(Answers(*after, "a") == source);
  EXPECT_TRUE(Answers(*after) == Answers(*before));
}

INSTANTIATE_TEST_SUITE_P(Storage, SnapshotRoundTrip, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

TEST(Snapshot, EmptyEngineRoundTrips) {
  TempDir dir;
  auto e = MakeEngine(SmallConfig());
  engine::SnapshotStats stats;
  ASSERT_TRUE(e->WriteSnapshot(dir.File("empty.snap"), &stats).ok());
  EXPECT_EQ(stats.sequences, 0);
  auto f = MakeEngine(SmallConfig());
  ASSERT_TRUE(f->RestoreSnapshot(dir.File("empty.snap")).ok());
  ExpectEmpty(*f);
}

class SnapshotRefusal : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(11);
    auto e = MakeEngine(SmallConfig());
    Populate(*e, rng);
    ASSERT_TRUE(e->WriteSnapshot(path_).ok());
    good_ = ReadFile(path_);
  }

  // Restores `bytes` (written to a file) into a fresh engine of `config`: the status, after
  // checking that the engine was left empty.
  absl::Status Restore(const std::string& bytes, const EngineConfig& config = SmallConfig()) {
    const std::string path = dir_.File("bad.snap");
    WriteFile(path, bytes);
    auto e = MakeEngine(config);
    const absl::Status status = e->RestoreSnapshot(path);
    ExpectEmpty(*e);
    return status;
  }

  TempDir dir_;
  std::string path_ = dir_.File("good.snap");
  std::string good_;
};

TEST_F(SnapshotRefusal, MismatchedSettingsAreRefusedNamingThem) {
  EngineConfig other = SmallConfig();
  other.head_dim = 128;
  absl::Status s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("head_dim 64 (this server: 128)"));

  other = SmallConfig(kernels::KeyStorage::kFp8E4M3);
  s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("key_dtype bf16 (this server: fp8)"));

  other = SmallConfig(kernels::KeyStorage::kFp4E2M1);
  s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("key_dtype bf16 (this server: fp4)"));

  other = SmallConfig();
  other.layers = 3;
  s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("layers 2 (this server: 3)"));

  other = SmallConfig();
  other.capacity_pages = 4;
  s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("capacity is 4 pages"));

  other = SmallConfig();
  other.max_tokens_per_sequence = 200;
  s = Restore(good_, other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_tokens_per_sequence is 200"));
}

TEST_F(SnapshotRefusal, CorruptFilesAreRefusedAndNothingIsLoaded) {
  const size_t n = good_.size();
  struct Case {
    std::string name;
    std::string bytes;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  const auto flipped = [&](size_t at) {
    std::string b = good_;
    b[at] = static_cast<char>(b[at] ^ 0x10);
    return b;
  };
  cases.push_back({"magic", flipped(0), absl::StatusCode::kDataLoss, "not an indexer snapshot"});
  std::string version = good_;
  version[8] = 9;
  cases.push_back({"version", version, absl::StatusCode::kFailedPrecondition, "format version 9"});
  cases.push_back({"a key byte", flipped(n - 12 - 1000), absl::StatusCode::kDataLoss, "checksum"});
  cases.push_back({"a sequence length byte", flipped(56 + 4 + 0 + 4 + 1 + 1),
                   absl::StatusCode::kDataLoss, ""});
  cases.push_back({"the checksum", flipped(n - 12), absl::StatusCode::kDataLoss, "checksum"});
  cases.push_back({"the end marker", flipped(n - 1), absl::StatusCode::kDataLoss, "end marker"});
  // Cut short: the header's sizes no longer fit the file, or the end is missing.
  for (size_t cut : {size_t{0}, size_t{5}, size_t{56}, size_t{80}, n / 2}) {
    cases.push_back({absl::StrCat("truncated to ", cut), good_.substr(0, cut),
                     absl::StatusCode::kDataLoss, ""});
  }
  for (size_t cut : {n - 12, n - 1}) {
    cases.push_back({absl::StrCat("truncated to ", cut), good_.substr(0, cut),
                     absl::StatusCode::kDataLoss, "truncated"});
  }
  cases.push_back({"trailing bytes", good_ + "x", absl::StatusCode::kDataLoss, "follow the end marker"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status s = Restore(c.bytes);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
}

TEST_F(SnapshotRefusal, MissingFilesAndBusyEnginesAreRefused) {
  auto e = MakeEngine(SmallConfig());
  EXPECT_EQ(e->RestoreSnapshot(dir_.File("missing.snap")).code(), absl::StatusCode::kNotFound);
  ExpectEmpty(*e);
  std::mt19937 rng(1);
  Append(*e, "", "x", 0, false, 10, rng);
  const absl::Status s = e->RestoreSnapshot(path_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("restored into an empty server"));
  EXPECT_EQ(e->Stats().live_sequences, 1);
}

TEST_F(SnapshotRefusal, NonFiniteKeysAreRefused) {
  // Make the first key a NaN (bf16 0x7FC0) and fix the checksum, as a tampered file would.
  auto e = MakeEngine(SmallConfig());
  std::mt19937 rng(2);
  Append(*e, "", "x", 0, false, 1, rng);
  ASSERT_TRUE(e->WriteSnapshot(path_).ok());
  std::string bytes = ReadFile(path_);
  const size_t pages_start = bytes.size() - 12 - size_t{128} * 64 * 2 * 2;  // one page, 2 layers
  bytes[pages_start] = static_cast<char>(0xC0);
  bytes[pages_start + 1] = static_cast<char>(0x7F);
  const uint32_t crc = engine::Crc32c(0, bytes.data(), bytes.size() - 12);
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 12 + i] = static_cast<char>((crc >> (8 * i)) & 0xFF);
  const absl::Status s = Restore(bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not finite"));
}

// A CpuBackend whose page reads fail after `reads_left` calls.
class FailingReads final : public engine::KeyCacheBackend {
 public:
  explicit FailingReads(const EngineConfig& c) : inner_(c) {}
  std::string name() const override { return "failing"; }
  std::string device() const override { return inner_.device(); }
  absl::Status WriteKeys(const engine::KeyWrite& w) override { return inner_.WriteKeys(w); }
  absl::Status CopyPage(int32_t s, int32_t d) override { return inner_.CopyPage(s, d); }
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    if (fail) return absl::InternalError("injected ReadPages failure");
    return inner_.ReadPages(pages, dst);
  }
  absl::Status Select(std::span<const engine::SelectTask> t, const kernels::PageTableParams& pt) override {
    return inner_.Select(t, pt);
  }
  bool fail = false;

 private:
  engine::CpuBackend inner_;
};

TEST(SnapshotWrite, AFailedWriteLeavesThePreviousFileAndNoPartialOne) {
  TempDir dir;
  const EngineConfig config = SmallConfig();
  auto backend = std::make_unique<FailingReads>(config);
  FailingReads* failing = backend.get();
  Engine e(config, std::move(backend));
  std::mt19937 rng(5);
  Populate(e, rng);
  const std::string path = dir.File("state.snap");
  ASSERT_TRUE(e.WriteSnapshot(path).ok());
  const std::string previous = ReadFile(path);
  Append(e, "", "new", 0, false, 200, rng);

  failing->fail = true;
  const absl::Status s = e.WriteSnapshot(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr("injected"));
  EXPECT_EQ(ReadFile(path), previous);
  EXPECT_THAT(FolderEntries(dir.path()), ::testing::ElementsAre("state.snap"));

  // Disk full halfway: the file size limit makes write() fail with EFBIG.
  failing->fail = false;
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  struct sigaction ignore {}, saved {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGXFSZ, &ignore, &saved);
  struct rlimit small = old;
  small.rlim_cur = 64 << 10;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status full = e.WriteSnapshot(path);
  setrlimit(RLIMIT_FSIZE, &old);
  sigaction(SIGXFSZ, &saved, nullptr);
  EXPECT_EQ(full.code(), absl::StatusCode::kInternal) << full;
  EXPECT_THAT(std::string(full.message()), HasSubstr("cannot write snapshot file"));
  EXPECT_EQ(ReadFile(path), previous);
  EXPECT_THAT(FolderEntries(dir.path()), ::testing::ElementsAre("state.snap"));

  // A folder that does not exist: nothing is created anywhere.
  EXPECT_FALSE(e.WriteSnapshot(dir.File("no/such/folder.snap")).ok());

  // The engine kept serving and writes fine afterwards.
  ASSERT_TRUE(e.WriteSnapshot(path).ok());
  EXPECT_NE(ReadFile(path), previous);
}

// A file or link already at the old fixed temporary name must neither lend its mode to the
// snapshot nor redirect the write outside the folder.
TEST(SnapshotWrite, StaleTemporaryFilesAndLinksAreNeitherReusedNorFollowed) {
  TempDir dir;
  TempDir outside;
  const EngineConfig config = SmallConfig();
  auto e = MakeEngine(config);
  std::mt19937 rng(9);
  Populate(*e, rng);
  const std::string open_path = dir.File("open.snap");
  WriteFile(open_path + ".tmp", "stale", 0666);
  const std::string target = outside.File("target");
  WriteFile(target, "keep me", 0644);
  const std::string linked_path = dir.File("linked.snap");
  ASSERT_EQ(symlink(target.c_str(), (linked_path + ".tmp").c_str()), 0);
  {
    const mode_t old = umask(0);
    const absl::Status open_status = e->WriteSnapshot(open_path);
    const absl::Status linked_status = e->WriteSnapshot(linked_path);
    umask(old);
    ASSERT_TRUE(open_status.ok()) << open_status;
    ASSERT_TRUE(linked_status.ok()) << linked_status;
  }
  for (const std::string& path : {open_path, linked_path}) {
    struct stat st {};
    ASSERT_EQ(lstat(path.c_str(), &st), 0) << path;
    EXPECT_TRUE(S_ISREG(st.st_mode)) << path << " is not a regular file";
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
    EXPECT_TRUE(MakeEngine(config)->RestoreSnapshot(path).ok()) << path;
  }
  EXPECT_TRUE(ReadFile(target) == "keep me") << "the link's target was overwritten";
  EXPECT_TRUE(ReadFile(open_path + ".tmp") == "stale") << "the stale file was reused";
  EXPECT_THAT(FolderEntries(outside.path()), ::testing::ElementsAre("target"));
}

TEST(SnapshotWrite, SnapshotsTakenWhileCallsRunAreConsistent) {
  // Writers append to "left" and "right" in one Batch call each time, so every consistent
  // instant has equal lengths; snapshots taken meanwhile must show exactly that.
  TempDir dir;
  EngineConfig config = SmallConfig();
  config.capacity_pages = 512;
  config.max_tokens_per_sequence = 1 << 14;
  auto e = MakeEngine(config);
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      std::mt19937 rng(w);
      const std::string tenant = w == 0 ? "" : "beta";
      for (int i = 0; i < 2000 && !stop; ++i) {
        const std::string k1 = Bf16Bytes(rng, 7 * 64), k2 = Bf16Bytes(rng, 7 * 64);
        StepRequest items[2];
        for (int j = 0; j < 2; ++j) {
          items[j].tenant = tenant;
          items[j].sequence_id = j == 0 ? "left" : "right";
          items[j].append = AppendRequest{items[j].sequence_id, 0, false, WireDtype::kBf16,
                                          j == 0 ? k1 : k2, {}};
        }
        for (const auto& r : e->Batch(items)) ASSERT_TRUE(r.ok()) << r.status();
      }
    });
  }
  for (int snap = 0; snap < 6; ++snap) {
    const std::string path = dir.File(absl::StrCat("s", snap, ".snap"));
    ASSERT_TRUE(e->WriteSnapshot(path).ok());
    auto restored = MakeEngine(config);
    ASSERT_TRUE(restored->RestoreSnapshot(path).ok());
    for (const std::string tenant : {"", "beta"}) {
      absl::StatusOr<engine::SequenceInfo> l = restored->Get("left", tenant);
      absl::StatusOr<engine::SequenceInfo> r = restored->Get("right", tenant);
      ASSERT_EQ(l.ok(), r.ok()) << "snapshot " << snap << " caught a Batch half applied";
      if (l.ok()) {
        EXPECT_EQ(l->lengths, r->lengths) << "snapshot " << snap;
      }
    }
  }
  stop = true;
  for (auto& t : writers) t.join();
}

}  // namespace
}  // namespace indexer::testing
