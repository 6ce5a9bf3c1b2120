// Snapshots through the CUDA backend's ReadPages/WritePages: the same operations on a CPU and a
// CUDA engine give byte-identical snapshot files, and a snapshot restores into either backend
// with identical selections (integer keys: sums are exact, so backends agree exactly).
// Skips, with a message, where no GPU is usable.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "engine/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "kernels/numeric.h"
#include "tests/testing/bf16.h"
#include "tests/testing/engine_requests.h"
#include "tests/testing/files.h"
#include "tests/testing/gpu_test.h"
#include "tests/testing/storages.h"

namespace indexer::engine {
namespace {

using testing::ReadFile;
using testing::TempDir;

// Integer keys and queries in [-6, 6]: sums are exact, so the backends must agree exactly.
std::string IntegerKeys(std::mt19937_64& rng, size_t n) { return testing::Bytes(testing::IntegerBf16(rng, n, -6, 6)); }

class GpuSnapshotTest : public testing::GpuTestWithParam<kernels::KeyStorage> {
 protected:
  void SetUp() override {
    testing::GpuTestWithParam<kernels::KeyStorage>::SetUp();
    if (IsSkipped()) return;
    config_ = testing::GpuEngineConfig(GetParam(), 256);
    ASSERT_TRUE(config_.Validate().ok());
  }

  std::unique_ptr<Engine> Cpu() {
    return std::make_unique<Engine>(config_, std::make_unique<CpuBackend>(config_));
  }
  std::unique_ptr<Engine> Cuda() {
    auto backend = MakeCudaBackend(config_, DeviceSlot{0, 0, config_.capacity_pages});
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? std::make_unique<Engine>(config_, std::move(*backend)) : nullptr;
  }

  // The same appends, forks (with copy-on-write) and truncations on every engine given.
  void Populate(const std::vector<Engine*>& engines) {
    std::mt19937_64 rng(4242);
    const auto append = [&](const std::string& tenant, const std::string& id, bool all, int layer,
                            int tokens, std::vector<int32_t> attn) {
      const std::string keys =
          IntegerKeys(rng, static_cast<size_t>(tokens) * (all ? config_.layers : 1) * config_.head_dim);
      for (Engine* e : engines) {
        AppendRequest a{id, layer, all, WireDtype::kBf16, keys, attn};
        a.tenant = tenant;
        ASSERT_TRUE(e->Append(a).ok());
      }
    };
    for (const std::string tenant : {"", "t2"}) {
      append(tenant, "a", true, 0, 700, {1, 2, 3, 4, 5, 6});
      append(tenant, "a", false, 2, 90, {7});
      for (Engine* e : engines) ASSERT_TRUE(e->Fork("a", "f", 500, tenant).ok());
      append(tenant, "f", false, 1, 40, {9});
      append(tenant, "b", false, 0, 333, {});
      for (Engine* e : engines) ASSERT_TRUE(e->Truncate("b", 300, tenant).ok());
    }
  }

  std::vector<std::vector<int32_t>> Answers(Engine& e) {
    std::mt19937_64 rng(7);
    std::vector<std::vector<int32_t>> out;
    for (const std::string tenant : {"", "t2"}) {
      for (const std::string id : {"a", "f", "b"}) {
        absl::StatusOr<SequenceInfo> info = e.Get(id, tenant);
        EXPECT_TRUE(info.ok()) << info.status();
        for (int layer = 0; layer < config_.layers && info.ok(); ++layer) {
          if (info->lengths[layer] < 8) continue;
          for (int n : {1, 8}) {
            const std::string q = IntegerKeys(rng, static_cast<size_t>(n) * 4 * config_.head_dim);
            StepRequest s = testing::Bf16Select(id, layer, 4, q);
            s.tenant = tenant;
            s.init_blocks = 1;
            absl::StatusOr<StepResult> r = e.Select(s);
            EXPECT_TRUE(r.ok()) << r.status();
            if (!r.ok()) continue;
            out.push_back(r->block_ids);
            out.push_back(r->page_table);
            out.push_back(r->context_lens);
          }
        }
      }
    }
    return out;
  }

  EngineConfig config_;
};

TEST_P(GpuSnapshotTest, SnapshotsMatchAndRestoreAcrossBackends) {
  TempDir dir;
  auto cpu = Cpu();
  auto gpu = Cuda();
  ASSERT_NE(gpu, nullptr);
  Populate({cpu.get(), gpu.get()});
  const auto want = Answers(*cpu);
  ASSERT_EQ(Answers(*gpu), want);

  ASSERT_TRUE(cpu->WriteSnapshot(dir.File("cpu.snap")).ok());
  const absl::Status written = gpu->WriteSnapshot(dir.File("gpu.snap"));
  ASSERT_TRUE(written.ok()) << written;
  EXPECT_EQ(ReadFile(dir.File("gpu.snap")), ReadFile(dir.File("cpu.snap")))
      << "the CUDA backend's pages read back differently from the CPU backend's";

  gpu.reset();  // one device pool at a time
  auto restored_gpu = Cuda();
  ASSERT_NE(restored_gpu, nullptr);
  const absl::Status restored = restored_gpu->RestoreSnapshot(dir.File("cpu.snap"));
  ASSERT_TRUE(restored.ok()) << restored;
  EXPECT_EQ(Answers(*restored_gpu), want);
  // And back: what the restored GPU engine holds is what was written.
  ASSERT_TRUE(restored_gpu->WriteSnapshot(dir.File("gpu-again.snap")).ok());
  EXPECT_EQ(ReadFile(dir.File("gpu-again.snap")), ReadFile(dir.File("cpu.snap")));

  auto restored_cpu = Cpu();
  ASSERT_TRUE(restored_cpu->RestoreSnapshot(dir.File("gpu.snap")).ok());
  EXPECT_EQ(Answers(*restored_cpu), want);
}

INSTANTIATE_TEST_SUITE_P(Storage, GpuSnapshotTest, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

}  // namespace
}  // namespace indexer::engine
