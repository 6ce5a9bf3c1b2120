#include "engine/cpu_backend.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_fast_scores.h"
#include "kernels/cpu_reference.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;

int WorkerCount(const EngineConfig& config) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int n = config.cpu_threads > 0 ? config.cpu_threads : hw;
  return n - 1;  // the calling thread works too
}

// Blocks scored by one unit of work: about a million multiply-adds, so that units are big enough
// to amortise scheduling and small enough to spread one long sequence over every core.
int64_t BlocksPerUnit(int rows, int head_dim) {
  const int64_t macs_per_block = int64_t{rows} * kBlockSize * head_dim;
  return std::max<int64_t>(1, (int64_t{1} << 20) / macs_per_block);
}

absl::Status SelectionsAbandoned() {
  return absl::CancelledError("the selection was abandoned: the server is shutting down");
}

}  // namespace

CpuBackend::CpuBackend(const EngineConfig& config, const DeviceSlot& slot)
    : config_(config),
      slot_(slot),
      pages_(slot.num_pages > 0 ? slot.num_pages : config.capacity_pages),
      layer_bytes_(pages_ * kernels::PageBytes(config.key_storage, config.head_dim)),
      storage_(new uint8_t[static_cast<size_t>(layer_bytes_) * config.layers]),
      pool_(WorkerCount(config)) {}

std::string CpuBackend::device() const { return absl::StrCat(pool_.size() + 1, " threads"); }

absl::Status CpuBackend::Local(int64_t page, int64_t* local) const {
  *local = page - slot_.first_page;
  if (*local < 0 || *local >= pages_) {
    return absl::InternalError(absl::StrCat("page ", page, " is not on this backend's device ",
                                            slot_.ordinal, " (pages ", slot_.first_page, " to ",
                                            slot_.first_page + pages_ - 1, ")"));
  }
  return absl::OkStatus();
}

kernels::KeyPoolView CpuBackend::LayerView(int layer) const {
  return kernels::KeyPoolView{storage_.get() + layer * layer_bytes_, config_.key_storage,
                              config_.head_dim};
}

absl::Status CpuBackend::WriteKeys(const KeyWrite& w) {
  const int d = config_.head_dim;
  // Every page first, so that a bad id writes nothing.
  for (int l = 0; l < w.layer_count && w.num_tokens > 0; ++l) {
    for (int64_t b = w.layer_start[l] / kBlockSize;
         b <= (w.layer_start[l] + w.num_tokens - 1) / kBlockSize; ++b) {
      int64_t local = 0;
      if (absl::Status s = Local(w.block_table[b], &local); !s.ok()) return s;
    }
  }
  for (int64_t j = 0; j < w.num_tokens; ++j) {
    for (int l = 0; l < w.layer_count; ++l) {
      const int64_t t = w.layer_start[l] + j;
      const int64_t page = int64_t{w.block_table[t / kBlockSize]} - slot_.first_page;
      const uint16_t* src = w.keys + (j * w.layer_count + l) * d;
      kernels::StoreKey(storage_.get() + (w.layer_begin + l) * layer_bytes_, config_.key_storage, d,
                        page, static_cast<int>(t % kBlockSize), src);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyPage(int32_t src_page, int32_t dst_page) {
  int64_t src = 0, dst = 0;
  if (absl::Status s = Local(src_page, &src); !s.ok()) return s;
  if (absl::Status s = Local(dst_page, &dst); !s.ok()) return s;
  const int64_t page_bytes = layer_bytes_ / pages_;
  for (int l = 0; l < config_.layers; ++l) {
    uint8_t* base = storage_.get() + l * layer_bytes_;
    std::memcpy(base + dst * page_bytes, base + src * page_bytes, page_bytes);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ReadPages(std::span<const int32_t> pages, uint8_t* dst) {
  const int64_t page_bytes = layer_bytes_ / pages_;
  for (int32_t global : pages) {
    int64_t page = 0;
    if (absl::Status s = Local(global, &page); !s.ok()) return s;
    for (int l = 0; l < config_.layers; ++l, dst += page_bytes) {
      std::memcpy(dst, storage_.get() + l * layer_bytes_ + page * page_bytes, page_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::WritePages(std::span<const int32_t> pages, const uint8_t* src) {
  const int64_t page_bytes = layer_bytes_ / pages_;
  for (int32_t global : pages) {
    int64_t local = 0;
    if (absl::Status s = Local(global, &local); !s.ok()) return s;
  }
  for (int32_t global : pages) {
    const int64_t page = global - slot_.first_page;
    for (int l = 0; l < config_.layers; ++l, src += page_bytes) {
      std::memcpy(storage_.get() + l * layer_bytes_ + page * page_bytes, src, page_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Select(std::span<const SelectTask> global_tasks,
                                const kernels::PageTableParams& page_table) {
  // The kernels index this backend's pool: give them slot-local block tables.
  std::vector<SelectTask> local_tasks;
  std::vector<std::vector<int32_t>> local_tables;
  local_tasks.reserve(global_tasks.size());
  local_tables.reserve(global_tasks.size());
  for (const SelectTask& t : global_tasks) {
    const int64_t blocks = kernels::VisibleBlocks(t.span.start_pos + t.span.num_tokens - 1);
    std::vector<int32_t>& table = local_tables.emplace_back(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t local = 0;
      if (absl::Status s = Local(t.span.block_table[b], &local); !s.ok()) return s;
      table[b] = static_cast<int32_t>(local);
    }
    SelectTask& lt = local_tasks.emplace_back(t);
    lt.span.block_table = table.data();
  }
  const std::span<const SelectTask> tasks = local_tasks;
  // Phase 1: raw block scores, split into units of blocks across every task.
  struct Unit {
    size_t task;
    int64_t block_begin, block_end;
  };
  std::vector<std::vector<float>> raw(tasks.size());
  std::vector<int64_t> v_max(tasks.size());
  std::vector<Unit> units;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const auto& s = tasks[i].span;
    const int rows = s.num_tokens * s.num_heads;
    v_max[i] = kernels::VisibleBlocks(s.start_pos + s.num_tokens - 1);
    raw[i].resize(static_cast<size_t>(rows) * v_max[i]);
    const int64_t step = BlocksPerUnit(rows, config_.head_dim);
    for (int64_t b = 0; b < v_max[i]; b += step) {
      units.push_back({i, b, std::min(b + step, v_max[i])});
    }
  }
  const auto abandoned = [this] { return abandoned_.load(std::memory_order_relaxed); };
  pool_.ParallelFor(static_cast<int64_t>(units.size()), [&](int64_t u) {
    if (abandoned()) return;
    const Unit& unit = units[u];
    const SelectTask& task = tasks[unit.task];
    kernels::ScoreBlocksFast(LayerView(task.layer), task.span, unit.block_begin, unit.block_end,
                         raw[unit.task].data(), v_max[unit.task]);
  });

  if (abandoned()) return SelectionsAbandoned();
  // Phase 2: top-k and page-table rows, one (task, token, head) row at a time.
  std::vector<std::pair<size_t, int>> rows;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int n = tasks[i].span.num_tokens * tasks[i].span.num_heads;
    for (int r = 0; r < n; ++r) rows.emplace_back(i, r);
  }
  pool_.ParallelFor(static_cast<int64_t>(rows.size()), [&](int64_t j) {
    if (abandoned()) return;
    const auto [i, row] = rows[j];
    const kernels::SpanSelect& s = tasks[i].span;
    const int64_t pos = s.start_pos + row / s.num_heads;
    const int k = s.params.topk;
    thread_local std::vector<uint64_t> scratch;
    scratch.resize(v_max[i]);
    int32_t* ids = s.block_ids + int64_t{row} * k;
    kernels::SelectFromScores(&raw[i][static_cast<size_t>(row) * v_max[i]],
                              kernels::VisibleBlocks(pos), s.params, scratch.data(), ids);
    if (s.attn_pages != nullptr) {
      kernels::BuildPageTableRow(ids, k, pos, s.attn_pages, page_table,
                                 s.page_table + int64_t{row} * k * page_table.pages_per_block,
                                 s.context_lens + row);
    }
  });
  return abandoned() ? SelectionsAbandoned() : absl::OkStatus();
}

}  // namespace indexer::engine
