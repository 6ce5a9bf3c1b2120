// A device that fails for good (a sticky CUDA error on a GPU; here FatalFaultBackend on the CPU):
// the DeviceFailure latch itself, then through the engine -- the call that meets the fault and
// every later call on the device answer UNAVAILABLE with the first error's text, roll back,
// and do not reach the device; Engine::Health and Stats report it; other devices keep serving
// and new sequences are placed on them.
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "engine/cpu_backend.h"
#include "engine/device_failure.h"
#include "engine/engine.h"
#include "tests/engine/engine_test_util.h"
#include "tests/testing/fatal_fault_backend.h"

namespace indexer::testing {
namespace {

using engine::DeviceBackend;
using engine::DeviceFailure;
using engine::DeviceSlot;

bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

// UNAVAILABLE naming the device and carrying the fault's text.
void ExpectDeviceFailed(const absl::Status& s, absl::string_view device) {
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Contains(s.message(), kIllegalAddress)) << s;
  EXPECT_TRUE(Contains(s.message(), device)) << s;
}

TEST(DeviceFailure, StartsHealthyAndKeepsTheFirstCause) {
  DeviceFailure f;
  EXPECT_TRUE(f.Check().ok());
  EXPECT_FALSE(f.failed());
  const absl::Status first = f.Fail("gpu 3", absl::InternalError("first cause"));
  EXPECT_TRUE(f.failed());
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(first.message(), "gpu 3")) << first;
  EXPECT_TRUE(Contains(first.message(), "first cause")) << first;
  EXPECT_EQ(f.Check(), first);
  EXPECT_EQ(f.Fail("gpu 3", absl::InternalError("second cause")), first);
  EXPECT_EQ(f.Check(), first);
}

TEST(DeviceFailure, ConcurrentFailuresAgreeOnOneCause) {
  DeviceFailure f;
  std::vector<absl::Status> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&f, &got, i] {
      got[i] = f.Fail("dev", absl::InternalError("cause " + std::to_string(i)));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : got) EXPECT_EQ(s, f.Check());
  EXPECT_EQ(f.Check().code(), absl::StatusCode::kUnavailable);
}

class FailedDeviceTest : public ::testing::TestWithParam<bool> {
 protected:
  EngineConfig Config() const {
    EngineConfig c = SmallEngineConfig();
    c.capacity_pages = 16;
    c.cpu_threads = 1;
    c.batching.enabled = GetParam();
    return c;
  }
  std::unique_ptr<FatalFaultBackend> Faulty(const EngineConfig& c, const DeviceSlot& slot,
                                            const std::string& label) {
    auto b = std::make_unique<FatalFaultBackend>(std::make_unique<engine::CpuBackend>(c, slot), label);
    return b;
  }
  absl::Status Append(Engine& e, const std::string& id, int64_t n) {
    const std::vector<uint16_t> k = RandomBf16(rng_, static_cast<size_t>(n) * e.config().head_dim);
    absl::StatusOr<StepResult> r = AppendKeys(e, id, 0, k);
    if (r.ok()) models_[id].Append(0, k);
    return r.status();
  }
  // A decode step: one new key, then a selection with one query.
  absl::Status Step(Engine& e, const std::string& id) {
    const int d = e.config().head_dim;
    const std::string key = Bytes(RandomBf16(rng_, d));
    const std::string query = Bytes(RandomBf16(rng_, d));
    StepRequest r;
    r.sequence_id = id;
    r.append = engine::AppendRequest{id, 0, false, WireDtype::kBf16, key};
    r.num_heads = 1;
    r.query_dtype = WireDtype::kBf16;
    r.queries = query;
    return e.Select(r).status();
  }
  std::mt19937_64 rng_{7};
  std::map<std::string, SeqModel> models_;

  void SetUp() override {
    models_.clear();
  }
};

TEST_P(FailedDeviceTest, EveryLaterCallFailsFastWithTheFirstError) {
  const EngineConfig c = Config();
  auto backend = Faulty(c, DeviceSlot{}, "test device 0");
  FatalFaultBackend* faulty = backend.get();
  Engine e(c, std::move(backend));
  models_["a"] = SeqModel(1, c.head_dim);
  ASSERT_TRUE(Append(e, "a", 200).ok());
  ASSERT_TRUE(CheckSelection(e, c, "a", models_["a"], rng_, SelectArgs{}).ok());
  EXPECT_TRUE(e.Health().ok());
  EXPECT_TRUE(e.Stats().devices[0].health.ok());
  const int64_t free_before = e.Stats().free_pages;

  // The fault: the step that meets it fails and is rolled back.
  faulty->FailNextCall();
  ExpectDeviceFailed(Step(e, "a"), "test device 0");
  ExpectDeviceFailed(e.Health(), "test device 0");
  ExpectDeviceFailed(e.Stats().devices[0].health, "test device 0");
  absl::StatusOr<engine::SequenceInfo> a = e.Get("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->lengths, std::vector<int64_t>{200});
  EXPECT_EQ(e.Stats().free_pages, free_before);

  // Every later call that needs the device fails the same way, applies nothing, and never
  // reaches the device.
  const int64_t calls = faulty->device_calls();
  ExpectDeviceFailed(Step(e, "a"), "test device 0");
  ExpectDeviceFailed(Append(e, "a", 10), "test device 0");
  ExpectDeviceFailed(Append(e, "new", 10), "test device 0");
  ExpectDeviceFailed(CheckSelection(e, c, "a", models_["a"], rng_, SelectArgs{}), "test device 0");
  const std::string q = Bytes(RandomBf16(rng_, c.head_dim));
  std::vector<StepRequest> items(2);
  for (StepRequest& item : items) {
    item.sequence_id = "a";
    item.num_heads = 1;
    item.query_dtype = WireDtype::kBf16;
    item.queries = q;
  }
  for (const absl::StatusOr<StepResult>& r : e.Batch(items)) ExpectDeviceFailed(r.status(), "test device 0");
  EXPECT_EQ(faulty->device_calls(), calls);
  EXPECT_EQ(e.Get("new").status().code(), absl::StatusCode::kNotFound);
  a = e.Get("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->lengths, std::vector<int64_t>{200});
  EXPECT_EQ(e.Stats().free_pages, free_before);
  ExpectDeviceFailed(e.Health(), "test device 0");

  // What needs no device still works: the scheduler can release what it held.
  ASSERT_TRUE(e.Release("a").ok());
  EXPECT_EQ(e.Stats().free_pages, e.Stats().total_pages);
}

TEST_P(FailedDeviceTest, OtherDevicesServeAndNewSequencesAvoidTheFailedOne) {
  const EngineConfig c = Config();
  std::vector<DeviceBackend> devices;
  const DeviceSlot slot0{0, 0, c.capacity_pages}, slot1{1, c.capacity_pages, c.capacity_pages};
  devices.push_back(DeviceBackend{slot0, std::make_unique<engine::CpuBackend>(c, slot0)});
  auto faulty_backend = Faulty(c, slot1, "test device 1");
  FatalFaultBackend* faulty = faulty_backend.get();
  devices.push_back(DeviceBackend{slot1, std::move(faulty_backend)});
  Engine e(c, std::move(devices));
  for (const char* id : {"a", "b"}) models_[id] = SeqModel(1, c.head_dim);
  ASSERT_TRUE(Append(e, "a", 300).ok());  // device 0 (a tie goes to the lower index)
  ASSERT_TRUE(Append(e, "b", 100).ok());  // device 1 (more free pages)
  ASSERT_EQ(e.Get("a")->device, 0);
  ASSERT_EQ(e.Get("b")->device, 1);

  faulty->FailNextCall();
  ExpectDeviceFailed(CheckSelection(e, c, "b", models_["b"], rng_, SelectArgs{}), "test device 1");
  ExpectDeviceFailed(e.Health(), "test device 1");
  const engine::EngineStats stats = e.Stats();
  EXPECT_TRUE(stats.devices[0].health.ok()) << stats.devices[0].health;
  ExpectDeviceFailed(stats.devices[1].health, "test device 1");

  // Device 0 serves on, exactly.
  EXPECT_TRUE(CheckSelection(e, c, "a", models_["a"], rng_, SelectArgs{}).ok());
  EXPECT_TRUE(Step(e, "a").ok());
  // Device 1 has more free pages, but a new sequence goes where it can be served.
  ASSERT_GT(stats.devices[1].free_pages, stats.devices[0].free_pages);
  models_["c"] = SeqModel(1, c.head_dim);
  ASSERT_TRUE(Append(e, "c", 50).ok());
  EXPECT_EQ(e.Get("c")->device, 0);
  EXPECT_TRUE(CheckSelection(e, c, "c", models_["c"], rng_, SelectArgs{}).ok());
  ExpectDeviceFailed(Step(e, "b"), "test device 1");
}

INSTANTIATE_TEST_SUITE_P(Batching, FailedDeviceTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "BatchingOn" : "BatchingOff";
                         });

}  // namespace
}  // namespace indexer::testing
