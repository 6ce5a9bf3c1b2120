// The CUDA backend behind the engine answers exactly as the CPU backend does: the same random
// sequence of appends (one layer and all layers), forks (copy-on-write on the GPU), truncations
// and selections (decode and prefill shapes, batched, half of them appending first so a wave's
// key writes go through WriteKeysBatch), on integer-valued keys so sums are exact.
// Skips (with a message) where no GPU is usable.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "kernels/numeric.h"
#include "tests/testing/bf16.h"
#include "tests/testing/gpu_test.h"
#include "tests/testing/storages.h"

namespace indexer::engine {
namespace {

using testing::Bytes;
using testing::IntegerBf16;

class CudaBackendTest : public testing::GpuTestWithParam<kernels::KeyStorage> {
 protected:
  void SetUp() override {
    testing::GpuTestWithParam<kernels::KeyStorage>::SetUp();
    if (IsSkipped()) return;
    config_ = testing::GpuEngineConfig(GetParam(), 4096);
    config_.max_index_heads = 16;
    ASSERT_TRUE(config_.Validate().ok());
    cpu_ = std::make_unique<Engine>(config_, std::make_unique<CpuBackend>(config_));
    auto cuda = MakeCudaBackend(config_, DeviceSlot{0, 0, config_.capacity_pages});
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    gpu_ = std::make_unique<Engine>(config_, std::move(*cuda));
  }

  EngineConfig config_;
  std::unique_ptr<Engine> cpu_, gpu_;
};

TEST_P(CudaBackendTest, SameAnswersAsCpuBackend) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::mt19937_64& rng = rng_;
  const int d = config_.head_dim;
  std::vector<std::string> live;
  int next_id = 0;
  for (int op = 0; op < 300; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (live.empty() || kind < 3) {  // append, creating when new
      const std::string id = live.empty() || rng() % 3 == 0 ? absl::StrCat("s", next_id++)
                                                            : live[rng() % live.size()];
      AppendRequest a;
      a.sequence_id = id;
      a.all_layers = rng() % 2 == 0;
      a.layer = static_cast<int64_t>(rng() % config_.layers);
      a.dtype = WireDtype::kBf16;
      const int64_t n = 1 + static_cast<int64_t>(rng() % 700);
      const std::string keys = Bytes(IntegerBf16(rng, n * (a.all_layers ? config_.layers : 1) * d, -4, 4));
      a.keys = keys;
      auto c = cpu_->Append(a);
      auto g = gpu_->Append(a);
      ASSERT_EQ(c.ok(), g.ok()) << c.status() << " vs " << g.status();
      if (c.ok()) {
        ASSERT_EQ(c->lengths, g->lengths);
        if (c->created) live.push_back(id);
      }
    } else if (kind == 3) {  // fork
      const std::string src = live[rng() % live.size()];
      const std::string dst = absl::StrCat("s", next_id++);
      std::optional<int64_t> len;
      if (rng() % 2) len = static_cast<int64_t>(rng() % 2000);
      auto c = cpu_->Fork(src, dst, len);
      auto g = gpu_->Fork(src, dst, len);
      ASSERT_EQ(c.ok(), g.ok());
      if (c.ok()) live.push_back(dst);
    } else if (kind == 4) {  // truncate
      const std::string id = live[rng() % live.size()];
      const int64_t len = static_cast<int64_t>(rng() % 3000);
      ASSERT_EQ(cpu_->Truncate(id, len).ok(), gpu_->Truncate(id, len).ok());
    } else if (kind == 5 && live.size() > 3) {  // release
      const size_t i = rng() % live.size();
      ASSERT_EQ(cpu_->Release(live[i]).ok(), gpu_->Release(live[i]).ok());
      live.erase(live.begin() + i);
    } else {  // a batch of selections over several sequences, decode and prefill shaped
      std::vector<StepRequest> items;
      std::vector<std::string> queries, appended;
      queries.reserve(8);
      appended.reserve(8);
      for (int i = 0; i < 8; ++i) {
        const std::string& id = live[rng() % live.size()];
        auto info = cpu_->Get(id);
        ASSERT_TRUE(info.ok());
        StepRequest s;
        s.sequence_id = id;
        s.layer = static_cast<int64_t>(rng() % config_.layers);
        const int64_t len = info->lengths[s.layer];
        if (len == 0) continue;
        const bool prefill = rng() % 4 == 0;
        const int64_t n = prefill ? 1 + static_cast<int64_t>(rng() % std::min<int64_t>(len, 300))
                                  : 1 + static_cast<int64_t>(rng() % std::min<int64_t>(len, 4));
        s.num_heads = 1 + static_cast<int64_t>(rng() % 4);
        s.query_dtype = WireDtype::kBf16;
        queries.push_back(Bytes(IntegerBf16(rng, n * s.num_heads * d, -4, 4)));
        s.queries = queries.back();
        s.topk = 1 + static_cast<int64_t>(rng() % 32);
        s.init_blocks = static_cast<int64_t>(rng() % 2);
        s.local_blocks = static_cast<int64_t>(rng() % 3);
        if (rng() % 2 == 0) {  // a decode step: append 1 to 3 tokens first (one key write per wave)
          AppendRequest a;
          a.all_layers = rng() % 3 == 0;
          a.layer = s.layer;
          a.dtype = WireDtype::kBf16;
          const int64_t t = 1 + static_cast<int64_t>(rng() % 3);
          appended.push_back(Bytes(IntegerBf16(rng, t * (a.all_layers ? config_.layers : 1) * d, -4, 4)));
          a.keys = appended.back();
          s.append = a;
        }
        items.push_back(s);
      }
      // Half the GPU engine's items write their block ids into caller memory instead (as
      // outputs in a client's region do).
      std::vector<StepRequest> gpu_items = items;
      std::vector<std::vector<int32_t>> provided(items.size());
      for (size_t i = 0; i < items.size(); ++i) {
        if (rng() % 2 != 0) continue;
        const StepRequest& s = items[i];
        const int64_t n = static_cast<int64_t>(s.queries.size()) / (s.num_heads * d * 2);
        provided[i].assign(static_cast<size_t>(n * s.num_heads * *s.topk), -7);
        gpu_items[i].outputs.block_ids = provided[i];
      }
      auto c = cpu_->Batch(items);
      auto g = gpu_->Batch(gpu_items);
      for (size_t i = 0; i < items.size(); ++i) {
        ASSERT_EQ(c[i].ok(), g[i].ok()) << c[i].status() << " vs " << g[i].status();
        if (!c[i].ok()) continue;
        ASSERT_EQ(c[i]->lengths, g[i]->lengths) << "item " << i << " op " << op;
        if (!provided[i].empty()) {
          ASSERT_TRUE(g[i]->block_ids.empty()) << "item " << i << " op " << op;
          ASSERT_EQ(c[i]->block_ids, provided[i]) << "provided memory, item " << i << " op " << op;
          continue;
        }
        ASSERT_EQ(c[i]->block_ids, g[i]->block_ids) << "item " << i << " op " << op;
        ASSERT_EQ(c[i]->page_table, g[i]->page_table);
        ASSERT_EQ(c[i]->context_lens, g[i]->context_lens);
      }
    }
    ASSERT_EQ(cpu_->Stats().free_pages, gpu_->Stats().free_pages);
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, CudaBackendTest, ::indexer::testing::EveryStorage(),
                         ::indexer::testing::StorageTestName);

}  // namespace
}  // namespace indexer::engine
