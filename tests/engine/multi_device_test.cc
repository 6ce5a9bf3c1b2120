// Several devices in one engine, on simulated CPU devices (MakeBackends with cpu_devices): the
// partitioned PagePool, placement of new sequences (most free pages, ties to the lower index),
// every page of a sequence on its device, forks on their source's device, exact accounting per
// device, a full device refusing only its own sequences, global quotas, selections identical to
// one device, Batch calls spanning devices (selected in parallel), and snapshots across devices.
#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/backend_factory.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/page_pool.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/gated_backend.h"

namespace indexer::testing {
namespace {

using engine::DeviceBackend;
using engine::DeviceChoice;
using engine::PagePool;
using engine::SequenceInfo;

EngineConfig SmallConfig(int64_t pages_per_device = 16) {
  EngineConfig c = SmallEngineConfig();
  c.capacity_pages = pages_per_device;
  c.cpu_threads = 1;
  return c;
}

std::unique_ptr<Engine> MakeDevices(const EngineConfig& config, int devices,
                                    engine::PageQuotas quotas = {}) {
  DeviceChoice choice;
  choice.kind = "cpu";
  choice.cpu_devices = devices;
  absl::StatusOr<std::vector<DeviceBackend>> made = engine::MakeBackends(config, choice);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return nullptr;
  return std::make_unique<Engine>(config, std::move(*made), std::move(quotas));
}

// Appends n random keys to `id`, recording them in `models`; returns the engine's status.
absl::Status Append(Engine& e, std::map<std::string, SeqModel>& models, std::mt19937_64& rng,
                    const std::string& id, int64_t n, absl::string_view tenant = "") {
  const int d = e.config().head_dim;
  const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(n) * d);
  const std::string bytes = Bytes(k);
  AppendRequest r;
  r.sequence_id = id;
  r.dtype = WireDtype::kBf16;
  r.keys = bytes;
  r.tenant = tenant;
  absl::StatusOr<StepResult> got = e.Append(r);
  if (got.ok()) models.try_emplace(id, 1, d).first->second.Append(0, k);
  return got.status();
}

// Every live sequence's pages lie on its device, and each device's free pages are its capacity
// minus the distinct pages its sequences use. `ids` name every sequence, as "id" (default
// tenant) or "tenant/id".
void ExpectExactAccounting(const Engine& e, const std::vector<std::string>& ids) {
  const int64_t per_device = e.config().capacity_pages;
  std::vector<std::set<int32_t>> used(e.num_devices());
  for (const std::string& name : ids) {
    const size_t slash = name.find('/');
    const std::string tenant = slash == std::string::npos ? "" : name.substr(0, slash);
    const std::string id = slash == std::string::npos ? name : name.substr(slash + 1);
    absl::StatusOr<SequenceInfo> info = e.Get(id, tenant);
    if (!info.ok()) continue;
    ASSERT_GE(info->device, 0);
    ASSERT_LT(info->device, e.num_devices());
    for (int32_t p : info->pages) {
      EXPECT_GE(p, info->device * per_device) << id << " page " << p;
      EXPECT_LT(p, (info->device + 1) * per_device) << id << " page " << p;
      used[info->device].insert(p);
    }
  }
  const engine::EngineStats s = e.Stats();
  ASSERT_EQ(s.devices.size(), static_cast<size_t>(e.num_devices()));
  int64_t free = 0;
  for (int d = 0; d < e.num_devices(); ++d) {
    EXPECT_EQ(s.devices[d].total_pages, per_device);
    EXPECT_EQ(s.devices[d].free_pages, per_device - static_cast<int64_t>(used[d].size()))
        << "device " << d;
    EXPECT_EQ(s.devices[d].slot.first_page, d * per_device);
    free += s.devices[d].free_pages;
  }
  EXPECT_EQ(s.total_pages, per_device * e.num_devices());
  EXPECT_EQ(s.free_pages, free);
}

TEST(MultiDevicePagePool, PartitionsHandOutTheirOwnIds) {
  PagePool pool(4, {}, 3);
  EXPECT_EQ(pool.total_pages(), 12);
  EXPECT_EQ(pool.devices(), 3);
  absl::StatusOr<std::vector<int32_t>> a = pool.Allocate(3, "", true, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int32_t>{6, 5, 4}));
  for (int32_t p : *a) EXPECT_EQ(pool.DeviceOf(p), 1);
  EXPECT_EQ(pool.FreePagesPerDevice(), (std::vector<int64_t>{4, 1, 4}));
  const absl::StatusOr<std::vector<int32_t>> full = pool.Allocate(2, "", true, 1);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(full.status().message(), "device 1")) << full.status();
  EXPECT_EQ(pool.FreePagesPerDevice(), (std::vector<int64_t>{4, 1, 4}));
  EXPECT_EQ(pool.Release(*a), 3);
  EXPECT_EQ(pool.free_pages(1), 4);
  EXPECT_EQ(pool.free_pages(), 12);
}

TEST(MultiDevicePagePool, QuotasCountEveryDevice) {
  engine::PageQuotas quotas;
  quotas.default_pages = 5;
  PagePool pool(4, quotas, 2);
  ASSERT_TRUE(pool.Allocate(3, "t", true, 0).ok());
  ASSERT_TRUE(pool.Allocate(2, "t", true, 1).ok());
  const absl::StatusOr<std::vector<int32_t>> over = pool.Allocate(1, "t", true, 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(over.status().message(), "quota")) << over.status();
  EXPECT_EQ(pool.TenantPages("t"), 5);
}

TEST(MultiDeviceFactory, SlotsAndRefusals) {
  EngineConfig c = SmallConfig(10);
  DeviceChoice choice;
  choice.kind = "cpu";
  choice.cpu_devices = 3;
  absl::StatusOr<std::vector<DeviceBackend>> made = engine::MakeBackends(c, choice);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->size(), 3u);
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ((*made)[d].slot.ordinal, d);
    EXPECT_EQ((*made)[d].slot.first_page, 10 * d);
    EXPECT_EQ((*made)[d].slot.num_pages, 10);
    EXPECT_EQ((*made)[d].backend->name(), "cpu");
  }
  choice.cpu_devices = 0;
  EXPECT_EQ(engine::MakeBackends(c, choice).status().code(), absl::StatusCode::kInvalidArgument);
  c.capacity_pages = int64_t{1} << 30;
  choice.cpu_devices = 2;
  const absl::Status too_many = engine::MakeBackends(c, choice).status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(too_many.message(), "page ids")) << too_many;
}

TEST(MultiDeviceBackend, PagesOutsideTheSlotAreRefused) {
  const EngineConfig c = SmallConfig(4);
  engine::CpuBackend b(c, engine::DeviceSlot{1, 4, 4});
  std::vector<uint8_t> page(static_cast<size_t>(c.BytesPerPage()), 7);
  const int32_t inside = 5, outside = 3;
  EXPECT_TRUE(b.WritePages(std::span<const int32_t>(&inside, 1), page.data()).ok());
  EXPECT_EQ(b.WritePages(std::span<const int32_t>(&outside, 1), page.data()).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(b.CopyPage(inside, 8).code(), absl::StatusCode::kInternal);
  std::vector<uint8_t> back(page.size(), 0);
  ASSERT_TRUE(b.ReadPages(std::span<const int32_t>(&inside, 1), back.data()).ok());
  EXPECT_EQ(back, page);
}

TEST(MultiDevice, PlacementGoesToTheMostFreePagesTiesToTheLowerIndex) {
  auto e = MakeDevices(SmallConfig(16), 3);
  std::map<std::string, SeqModel> models;
  std::mt19937_64 rng(1);
  // (id, tokens, expected device): free pages before each are in the comment.
  const std::vector<std::tuple<std::string, int64_t, int>> steps = {
      {"a", 100, 0},  // 16 16 16
      {"b", 300, 1},  // 15 16 16
      {"c", 10, 2},   // 15 13 16
      {"d", 500, 0},  // 15 13 15: tie 0 and 2 -> 0
      {"e", 1, 2},    // 11 13 15
      {"f", 129, 2},  // 11 13 14
      {"g", 1, 1},    // 11 13 12
  };
  std::vector<std::string> ids;
  for (const auto& [id, tokens, device] : steps) {
    ASSERT_TRUE(Append(*e, models, rng, id, tokens).ok());
    absl::StatusOr<SequenceInfo> info = e->Get(id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->device, device) << id;
    ids.push_back(id);
    ExpectExactAccounting(*e, ids);
  }
  // Growing a sequence never moves it.
  ASSERT_TRUE(Append(*e, models, rng, "c", 1000).ok());
  EXPECT_EQ(e->Get("c")->device, 2);
  ExpectExactAccounting(*e, ids);
}

TEST(MultiDevice, ABatchCreatingManySequencesSpreadsThem) {
  auto e = MakeDevices(SmallConfig(16), 2);
  std::mt19937_64 rng(2);
  const std::vector<uint16_t> k = RandomBf16(rng, 200 * static_cast<size_t>(e->config().head_dim));
  const std::string bytes = Bytes(k);
  std::vector<StepRequest> items(6);
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(absl::StrCat("n", i));
  for (int i = 0; i < 6; ++i) {
    items[i].sequence_id = ids[i];
    AppendRequest a;
    a.dtype = WireDtype::kBf16;
    a.keys = bytes;
    items[i].append = a;
  }
  for (const auto& r : e->Batch(items)) ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int> on(2, 0);
  for (const std::string& id : ids) ++on[e->Get(id)->device];
  EXPECT_EQ(on, (std::vector<int>{3, 3}));
  ExpectExactAccounting(*e, ids);
}

TEST(MultiDevice, ForksStayOnTheSourceDeviceAndCopyOnWriteThere) {
  auto e = MakeDevices(SmallConfig(16), 3);
  std::map<std::string, SeqModel> models;
  std::mt19937_64 rng(3);
  ASSERT_TRUE(Append(*e, models, rng, "a", 10).ok());   // device 0
  ASSERT_TRUE(Append(*e, models, rng, "b", 300).ok());  // device 1
  ASSERT_TRUE(e->Fork("b", "b2", std::nullopt).ok());
  ASSERT_TRUE(e->Fork("b", "b3", 200).ok());
  EXPECT_EQ(e->Get("b2")->device, 1);
  EXPECT_EQ(e->Get("b3")->device, 1);
  // Appending to the fork copies its shared partial page, on device 1.
  models["b2"] = models["b"];
  ASSERT_TRUE(Append(*e, models, rng, "b2", 5).ok());
  models["b3"] = models["b"];
  models["b3"].Truncate(200);
  ASSERT_TRUE(Append(*e, models, rng, "b3", 100).ok());
  const std::vector<std::string> ids = {"a", "b", "b2", "b3"};
  ExpectExactAccounting(*e, ids);
  EXPECT_EQ(e->Get("b2")->shared_pages, 2);
  for (const std::string& id : ids) {
    SCOPED_TRACE(id);
    ASSERT_TRUE(CheckSelection(*e, e->config(), id, models[id], rng, SelectArgs{.heads = 2}, 3).ok());
  }
  // Released everywhere, every page comes back to its device.
  for (const std::string& id : ids) ASSERT_TRUE(e->Release(id).ok());
  for (const engine::DeviceStats& d : e->Stats().devices) EXPECT_EQ(d.free_pages, d.total_pages);
}

TEST(MultiDevice, AFullDeviceRefusesOnlyItsOwnSequences) {
  auto e = MakeDevices(SmallConfig(4), 2);
  std::map<std::string, SeqModel> models;
  std::mt19937_64 rng(4);
  ASSERT_TRUE(Append(*e, models, rng, "big", 4 * 128).ok());  // fills device 0
  ASSERT_TRUE(Append(*e, models, rng, "small", 10).ok());     // device 1
  EXPECT_EQ(e->Get("big")->device, 0);
  EXPECT_EQ(e->Get("small")->device, 1);
  const absl::Status full = Append(*e, models, rng, "big", 1);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(Contains(full.message(), "device 0")) << full;
  EXPECT_EQ(e->Get("big")->lengths, std::vector<int64_t>{512});
  // Device 1 still serves its sequence, and new sequences go there.
  ASSERT_TRUE(Append(*e, models, rng, "small", 200).ok());
  ASSERT_TRUE(Append(*e, models, rng, "new", 10).ok());
  EXPECT_EQ(e->Get("new")->device, 1);
  ExpectExactAccounting(*e, {"big", "small", "new"});
  // Both full: a new sequence is refused and not left behind.
  ASSERT_TRUE(Append(*e, models, rng, "new", 128).ok());  // device 1: 2 + 1 + ... pages
  const engine::EngineStats s = e->Stats();
  EXPECT_EQ(s.devices[0].free_pages, 0);
  const int64_t left = s.devices[1].free_pages;
  const absl::Status refused = Append(*e, models, rng, "newer", (left + 1) * 128);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(e->Get("newer").status().code(), absl::StatusCode::kNotFound);
  ExpectExactAccounting(*e, {"big", "small", "new"});
}

TEST(MultiDevice, TenantQuotasAreGlobalAcrossDevices) {
  engine::PageQuotas quotas;
  quotas.default_pages = 3;
  auto e = MakeDevices(SmallConfig(8), 2, quotas);
  std::map<std::string, SeqModel> models;
  std::mt19937_64 rng(5);
  ASSERT_TRUE(Append(*e, models, rng, "x", 128, "t").ok());  // device 0
  ASSERT_TRUE(Append(*e, models, rng, "y", 128, "t").ok());  // device 1
  EXPECT_NE(e->Get("x", "t")->device, e->Get("y", "t")->device);
  ASSERT_TRUE(Append(*e, models, rng, "z", 1, "t").ok());
  const absl::Status over = Append(*e, models, rng, "w", 1, "t");
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(over.message(), "quota")) << over;
  EXPECT_EQ(e->Usage("t").pages, 3);
}

// The same random history on one device and on three gives the same answers, both equal to
// the reference.
TEST(MultiDevice, SelectionsEqualOneDevice) {
  EngineConfig big = SmallConfig(48);
  auto one = MakeDevices(big, 1);
  auto three = MakeDevices(SmallConfig(16), 3);
  std::map<std::string, SeqModel> m1, m3;
  std::mt19937_64 keys1(6), keys3(6), rng(7);
  std::vector<std::string> ids;
  for (int i = 0; i < 9; ++i) ids.push_back(absl::StrCat("s", i));
  for (int round = 0; round < 4; ++round) {
    for (const std::string& id : ids) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 150);
      ASSERT_TRUE(Append(*one, m1, keys1, id, n).ok());
      ASSERT_TRUE(Append(*three, m3, keys3, id, n).ok());
    }
  }
  std::set<int> devices;
  for (const std::string& id : ids) devices.insert(three->Get(id)->device);
  EXPECT_EQ(devices.size(), 3u);
  ExpectExactAccounting(*three, ids);
  for (const std::string& id : ids) {
    const std::vector<uint16_t> q = RandomBf16(rng, 4 * 2 * static_cast<size_t>(big.head_dim));
    SelectArgs a;
    a.heads = 2;
    a.init_blocks = 1;
    absl::StatusOr<StepResult> r1 = SelectQueries(*one, id, q, a);
    absl::StatusOr<StepResult> r3 = SelectQueries(*three, id, q, a);
    ASSERT_TRUE(r1.ok() && r3.ok());
    EXPECT_EQ(r1->block_ids, r3->block_ids) << id;
    const SeqModel& m = m3[id];
    ExpectSameSelection(*r3, ExpectedSelect(big, m, 0, m.Len(0) - 4, 4, 2, q,
                                            EffectiveParams(big, a)));
  }
}

// A Batch over sequences on every device: correct answers, and the devices select in parallel
// (device 0's launch is held while device 1's runs).
TEST(MultiDevice, ABatchSpanningDevicesSelectsOnEachInParallel) {
  for (bool batching : {true, false}) {
    SCOPED_TRACE(batching ? "batching on" : "batching off");
    EngineConfig c = SmallConfig(16);
    c.batching.enabled = batching;
    std::vector<DeviceBackend> devices;
    std::vector<GatedBackend*> gates;
    for (int d = 0; d < 2; ++d) {
      const engine::DeviceSlot slot{d, d * c.capacity_pages, c.capacity_pages};
      auto gated = std::make_unique<GatedBackend>(std::make_unique<engine::CpuBackend>(c, slot));
      gates.push_back(gated.get());
      devices.push_back(DeviceBackend{slot, std::move(gated)});
    }
    Engine e(c, std::move(devices));
    std::map<std::string, SeqModel> models;
    std::mt19937_64 rng(8);
    const std::vector<std::string> ids = {"a", "b", "c", "d"};
    for (const std::string& id : ids) ASSERT_TRUE(Append(e, models, rng, id, 150).ok());
    std::vector<std::vector<uint16_t>> keys, queries;
    std::vector<std::string> key_bytes, query_bytes;
    for (size_t i = 0; i < ids.size() + 1; ++i) {
      keys.push_back(RandomBf16(rng, c.head_dim));
      queries.push_back(RandomBf16(rng, c.head_dim));
      key_bytes.push_back(Bytes(keys.back()));
      query_bytes.push_back(Bytes(queries.back()));
    }
    std::vector<std::string> all = ids;
    all.push_back("fresh");  // created by the batch
    std::vector<StepRequest> items(all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      items[i].sequence_id = all[i];
      AppendRequest a;
      a.dtype = WireDtype::kBf16;
      a.keys = key_bytes[i];
      items[i].append = a;
      items[i].num_heads = 1;
      items[i].query_dtype = WireDtype::kBf16;
      items[i].queries = query_bytes[i];
    }
    std::vector<absl::StatusOr<StepResult>> results;
    if (batching) {
      // Device 0 held: device 1's selection still runs (it was submitted before any wait).
      gates[0]->Close();
      std::thread call([&] { results = e.Batch(items); });
      ASSERT_TRUE(gates[0]->WaitForCalls(1));
      ASSERT_TRUE(gates[1]->WaitForCalls(1));
      gates[0]->Open();
      call.join();
    } else {
      results = e.Batch(items);
    }
    ASSERT_EQ(results.size(), all.size());
    std::set<int> used;
    for (size_t i = 0; i < all.size(); ++i) {
      ASSERT_TRUE(results[i].ok()) << all[i] << ": " << results[i].status();
      SeqModel& m = models.try_emplace(all[i], 1, c.head_dim).first->second;
      m.Append(0, keys[i]);
      ExpectSameSelection(*results[i],
                          ExpectedSelect(c, m, 0, m.Len(0) - 1, 1, 1, queries[i], c.defaults));
      used.insert(e.Get(all[i])->device);
    }
    EXPECT_EQ(used.size(), 2u);
    EXPECT_EQ(gates[0]->calls().size(), 1u) << "one launch per device";
    EXPECT_EQ(gates[1]->calls().size(), 1u);
    ExpectExactAccounting(e, all);
  }
}

TEST(MultiDevice, ConcurrentCallsOnEveryDeviceMatchTheReference) {
  EngineConfig c = SmallConfig(64);
  c.batching.max_tasks = 4;
  auto e = MakeDevices(c, 3);
  constexpr int kThreads = 6, kSteps = 40;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      std::map<std::string, SeqModel> models;
      const std::vector<std::string> ids = {absl::StrCat("t", t, "x"), absl::StrCat("t", t, "y")};
      for (const std::string& id : ids) ASSERT_TRUE(Append(*e, models, rng, id, 50 + 60 * t).ok());
      for (int step = 0; step < kSteps; ++step) {
        const std::string& id = ids[step % 2];
        ASSERT_TRUE(Append(*e, models, rng, id, 1 + static_cast<int64_t>(rng() % 20)).ok());
        ASSERT_TRUE(CheckSelection(*e, c, id, models[id], rng, SelectArgs{.heads = 2}, 2).ok());
      }
      for (const std::string& id : ids) ASSERT_TRUE(e->Release(id).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  for (const engine::DeviceStats& d : e->Stats().devices) EXPECT_EQ(d.free_pages, d.total_pages);
}

// ---------------------------------------------------------------------------------------------
// Snapshots across devices.

class MultiDeviceSnapshot : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "/multi_device_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".snap";
  }
  void TearDown() override { std::remove(path_.c_str()); }

  // Sequences on all three devices, forks sharing pages on device 1, two tenants.
  void Populate(Engine& e) {
    ASSERT_TRUE(Append(e, models_, rng_, "a", 300).ok());       // device 0
    ASSERT_TRUE(Append(e, models_, rng_, "b", 200).ok());       // device 1
    ASSERT_TRUE(Append(e, models_, rng_, "c", 100).ok());       // device 2
    ASSERT_TRUE(Append(e, models_, rng_, "t", 50, "beta").ok());  // device 2
    ASSERT_TRUE(e.Fork("b", "b-fork", std::nullopt).ok());
    models_["b-fork"] = models_["b"];
    ASSERT_TRUE(Append(e, models_, rng_, "b-fork", 7).ok());
  }
  std::map<std::string, SequenceInfo> Infos(const Engine& e) {
    std::map<std::string, SequenceInfo> out;
    for (const char* id : {"a", "b", "c", "b-fork"}) out[id] = *e.Get(id);
    out["beta/t"] = *e.Get("t", "beta");
    return out;
  }

  std::string path_;
  std::map<std::string, SeqModel> models_;
  std::mt19937_64 rng_{9};
};

TEST_F(MultiDeviceSnapshot, RoundTripKeepsEverySequenceOnItsDevice) {
  auto e = MakeDevices(SmallConfig(16), 3);
  ASSERT_NO_FATAL_FAILURE(Populate(*e));
  const auto before = Infos(*e);
  EXPECT_EQ(before.at("a").device, 0);
  EXPECT_EQ(before.at("b").device, 1);
  EXPECT_EQ(before.at("b-fork").device, 1);
  EXPECT_EQ(before.at("c").device, 2);
  engine::SnapshotStats written;
  ASSERT_TRUE(e->WriteSnapshot(path_, &written).ok());
  EXPECT_EQ(written.sequences, 5);

  auto restored = MakeDevices(SmallConfig(16), 3);
  ASSERT_TRUE(restored->RestoreSnapshot(path_).ok());
  const auto after = Infos(*restored);
  for (const auto& [id, info] : before) {
    EXPECT_EQ(after.at(id).device, info.device) << id;
    EXPECT_EQ(after.at(id).lengths, info.lengths) << id;
    EXPECT_EQ(after.at(id).shared_pages, info.shared_pages) << id;
  }
  ExpectExactAccounting(*restored, {"a", "b", "c", "b-fork", "beta/t"});
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(restored->Stats().devices[d].free_pages, e->Stats().devices[d].free_pages) << d;
  }
  for (const char* id : {"a", "b", "c", "b-fork"}) {
    SCOPED_TRACE(id);
    ASSERT_TRUE(CheckSelection(*restored, restored->config(), id, models_[id], rng_,
                               SelectArgs{.heads = 2}, 2).ok());
  }
  // And the restored engine keeps working: a fork of a restored sequence stays on its device.
  ASSERT_TRUE(restored->Fork("c", "c2", 50).ok());
  EXPECT_EQ(restored->Get("c2")->device, 2);
}

TEST_F(MultiDeviceSnapshot, AFileThatDoesNotFitTheDeviceLayoutIsRefused) {
  auto e = MakeDevices(SmallConfig(16), 3);
  ASSERT_NO_FATAL_FAILURE(Populate(*e));
  ASSERT_TRUE(e->WriteSnapshot(path_).ok());
  for (int devices : {1, 2}) {
    auto fewer = MakeDevices(SmallConfig(48), devices);
    const absl::Status s = fewer->RestoreSnapshot(path_);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(Contains(s.message(), absl::StrCat("this server has ", devices, " devices"))) << s;
    EXPECT_EQ(fewer->Stats().live_sequences, 0);
    EXPECT_EQ(fewer->Stats().free_pages, fewer->Stats().total_pages);
  }
  // Same device count, too little room on device 0 (a: 3 pages).
  auto small = MakeDevices(SmallConfig(2), 3);
  const absl::Status s = small->RestoreSnapshot(path_);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s.message(), "on device 0")) << s;
  EXPECT_EQ(small->Stats().live_sequences, 0);
  // More devices than the writer had is fine: the extra ones stay empty.
  auto more = MakeDevices(SmallConfig(16), 4);
  ASSERT_TRUE(more->RestoreSnapshot(path_).ok());
  EXPECT_EQ(more->Stats().devices[3].free_pages, 16);
  EXPECT_EQ(more->Get("c")->device, 2);
}

TEST_F(MultiDeviceSnapshot, AOneDeviceFileRestoresOntoDeviceZero) {
  auto one = MakeDevices(SmallConfig(16), 1);
  ASSERT_TRUE(Append(*one, models_, rng_, "a", 300).ok());
  ASSERT_TRUE(Append(*one, models_, rng_, "b", 10).ok());
  ASSERT_TRUE(one->WriteSnapshot(path_).ok());
  auto two = MakeDevices(SmallConfig(16), 2);
  ASSERT_TRUE(two->RestoreSnapshot(path_).ok());
  EXPECT_EQ(two->Get("a")->device, 0);
  EXPECT_EQ(two->Get("b")->device, 0);
  ExpectExactAccounting(*two, {"a", "b"});
  // New sequences then go to the emptier device.
  ASSERT_TRUE(Append(*two, models_, rng_, "c", 10).ok());
  EXPECT_EQ(two->Get("c")->device, 1);
  ASSERT_TRUE(CheckSelection(*two, two->config(), "a", models_["a"], rng_, SelectArgs{}).ok());
}

}  // namespace
}  // namespace indexer::testing
