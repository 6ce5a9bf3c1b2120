// Helpers for the engine tests: building an Engine on a CpuBackend, requests from bf16 keys and
// queries (tests/testing/bf16.h), and a model of each sequence (the keys the test appended) from
// which the expected selection is computed with kernels::SelectSpan on a host key pool of the
// test's own.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "kernels/numeric.h"
#include "tests/testing/bf16.h"
#include "tests/testing/engine_config.h"
#include "tests/testing/engine_requests.h"
#include "tests/testing/host_key_pool.h"

namespace indexer::testing {

using engine::AppendRequest;
using engine::Engine;
using engine::EngineConfig;
using engine::StepRequest;
using engine::StepResult;
using engine::WireDtype;

inline std::unique_ptr<Engine> MakeEngine(const EngineConfig& config) {
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  return std::make_unique<Engine>(config, std::make_unique<engine::CpuBackend>(config));
}

// What a test appended to one sequence.
struct SeqModel {
  SeqModel() = default;
  SeqModel(int layers, int head_dim) : head_dim(head_dim), keys(layers) {}

  int head_dim = 64;
  std::vector<std::vector<uint16_t>> keys;  // per layer: [len][head_dim] bf16 bits
  bool attn_decided = false;
  bool has_attn = false;
  std::vector<int32_t> attn;  // attention page per block, when has_attn

  int64_t Len(int layer) const { return static_cast<int64_t>(keys[layer].size()) / head_dim; }
  int64_t MaxLen() const {
    int64_t m = 0;
    for (size_t l = 0; l < keys.size(); ++l) m = std::max(m, Len(static_cast<int>(l)));
    return m;
  }
  int64_t Blocks() const { return BlocksFor(MaxLen()); }
  std::vector<int64_t> Lengths() const {
    std::vector<int64_t> v;
    for (size_t l = 0; l < keys.size(); ++l) v.push_back(Len(static_cast<int>(l)));
    return v;
  }
  void Append(int layer, const std::vector<uint16_t>& k) {
    keys[layer].insert(keys[layer].end(), k.begin(), k.end());
  }
  void Truncate(int64_t len) {
    for (auto& k : keys) {
      if (static_cast<int64_t>(k.size()) > len * head_dim) k.resize(len * head_dim);
    }
    if (has_attn && static_cast<int64_t>(attn.size()) > Blocks()) attn.resize(Blocks());
  }
};

// The selection kernels::SelectSpan makes on the model's keys of `layer`, stored as `config`
// stores them, with the model's attention pages.
inline SpanResult ExpectedSelect(const EngineConfig& config, const SeqModel& m, int layer,
                                 int64_t start, int n, int heads,
                                 const std::vector<uint16_t>& queries,
                                 const kernels::SelectParams& params) {
  const int64_t len = m.Len(layer);
  const int64_t blocks = std::max<int64_t>(1, BlocksFor(len));
  HostKeyPool pool(config.head_dim, config.key_storage, blocks);
  const std::vector<int32_t> table = IdentityTable(blocks);
  pool.Write(table, m.keys[layer].data(), len);
  const std::vector<int32_t> attn = m.has_attn ? m.attn : std::vector<int32_t>{};
  return RunSelectSpan(pool.view(), table, attn, start, n, heads, queries, params,
                       config.page_table);
}

// Whether `needle` occurs in `haystack` (error messages name what they refuse).
inline bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

inline void ExpectSameSelection(const StepResult& got, const SpanResult& want) {
  EXPECT_EQ(got.block_ids, want.block_ids);
  EXPECT_EQ(got.page_table, want.page_table);
  EXPECT_EQ(got.context_lens, want.context_lens);
}

// Appends bf16 keys to one layer (or, with all_layers, [n][layers][head_dim] keys).
inline absl::StatusOr<StepResult> AppendKeys(Engine& e, absl::string_view id, int64_t layer,
                                             const std::vector<uint16_t>& keys,
                                             std::vector<int32_t> attn = {},
                                             bool all_layers = false,
                                             const engine::CallControl& control = {}) {
  const std::string bytes = Bytes(keys);
  return e.Append(Bf16Append(id, layer, bytes, all_layers, attn), control);
}

struct SelectArgs {
  int64_t layer = 0;
  int heads = 1;
  std::optional<int64_t> start;
  std::optional<int64_t> topk, init_blocks, local_blocks;
};

inline absl::StatusOr<StepResult> SelectQueries(Engine& e, absl::string_view id,
                                                const std::vector<uint16_t>& queries,
                                                const SelectArgs& a,
                                                const engine::CallControl& control = {}) {
  const std::string bytes = Bytes(queries);
  StepRequest r = Bf16Select(id, a.layer, a.heads, bytes);
  r.start_position = a.start;
  r.topk = a.topk;
  r.init_blocks = a.init_blocks;
  r.local_blocks = a.local_blocks;
  return e.Select(r, control);
}

// Parameters the engine uses for `a` under `config`.
inline kernels::SelectParams EffectiveParams(const EngineConfig& config, const SelectArgs& a) {
  return kernels::SelectParams{static_cast<int>(a.topk.value_or(config.defaults.topk)),
                               static_cast<int>(a.init_blocks.value_or(config.defaults.init_blocks)),
                               static_cast<int>(a.local_blocks.value_or(config.defaults.local_blocks))};
}

// Selects n tokens of `layer` at `start` (default: the last n) through the engine and checks the
// answer against the model. Returns the engine's status.
inline absl::Status CheckSelection(Engine& e, const EngineConfig& config, absl::string_view id,
                                   const SeqModel& m, std::mt19937_64& rng, SelectArgs a,
                                   int n = 1) {
  const std::vector<uint16_t> q =
      RandomBf16(rng, static_cast<size_t>(n) * a.heads * config.head_dim);
  absl::StatusOr<StepResult> got = SelectQueries(e, id, q, a);
  if (!got.ok()) return got.status();
  const int64_t start = a.start.value_or(m.Len(static_cast<int>(a.layer)) - n);
  EXPECT_EQ(got->start_position, start);
  EXPECT_EQ(got->num_tokens, n);
  EXPECT_EQ(got->num_heads, a.heads);
  EXPECT_EQ(got->lengths, m.Lengths());
  ExpectSameSelection(*got, ExpectedSelect(config, m, static_cast<int>(a.layer), start, n, a.heads,
                                           q, EffectiveParams(config, a)));
  return absl::OkStatus();
}

}  // namespace indexer::testing
