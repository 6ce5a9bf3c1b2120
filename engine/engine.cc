#include "engine/engine.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;

constexpr size_t kMaxIdBytes = 256;
// init/local block counts past any sequence's block count mean "every block"; clamping keeps
// arithmetic in int.
constexpr int64_t kMaxForcedBlocks = int64_t{1} << 30;

int64_t BlocksFor(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

// Raw block scores a span's selection holds: one per (token, head, visible block).
int64_t SpanScores(const kernels::SpanSelect& span) {
  return int64_t{span.num_tokens} * span.num_heads *
         kernels::VisibleBlocks(span.start_pos + span.num_tokens - 1);
}

absl::Status CheckId(absl::string_view id, absl::string_view field) {
  if (id.empty() || id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", id.size(),
                                                   " bytes; it must have 1 to ", kMaxIdBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value, "; it must be in [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

// Why a new sequence could not be made: the table is full (FindOrCreate and Insert fail only so).
absl::Status SequenceLimitError(absl::string_view id, int64_t max_sequences) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "sequence '", id, "' cannot be created: the server holds max_sequences ", max_sequences,
      " sequences; release some first"));
}

// The sequence's state before an append, to undo it when the selection that follows fails.
struct AppendUndo {
  std::vector<int64_t> lengths;
  size_t pages = 0;
  size_t attn_pages = 0;
  bool attn_decided = false;
  std::vector<std::pair<int64_t, int32_t>> replaced;  // copied-on-write blocks, original pages
};

}  // namespace

absl::Status CallControl::Check() const {
  if (cancelled && cancelled()) return absl::CancelledError("the call was cancelled");
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError("the call's deadline passed before it was applied");
  }
  return absl::OkStatus();
}

struct Engine::PreparedAppend {
  int layer_begin = 0;
  int layer_count = 1;
  int64_t num_tokens = 0;
  std::vector<uint16_t> keys;
  std::vector<int32_t> attn;
};

struct Engine::PreparedStep {
  size_t index = 0;
  absl::string_view tenant;
  absl::string_view sequence_id;
  int layer = 0;
  bool has_append = false;
  PreparedAppend append;
  bool has_select = false;
  std::optional<int64_t> start_position;
  int num_heads = 0;
  int num_tokens = 0;
  std::vector<uint16_t> queries;
  kernels::SelectParams params;
  // Set while the step runs.
  std::shared_ptr<Sequence> seq;
  bool created = false;
  int64_t start_pos = 0;
  int64_t charged = 0;  // answer bytes taken from the call's budget (given back on roll-back)
};

namespace {

std::vector<DeviceBackend> OneDevice(const EngineConfig& config,
                                     std::unique_ptr<KeyCacheBackend> backend) {
  std::vector<DeviceBackend> devices;
  devices.push_back(DeviceBackend{DeviceSlot{0, 0, config.capacity_pages}, std::move(backend)});
  return devices;
}

}  // namespace

Engine::Engine(const EngineConfig& config, std::unique_ptr<KeyCacheBackend> backend,
               PageQuotas quotas)
    : Engine(config, OneDevice(config, std::move(backend)), std::move(quotas)) {}

Engine::Engine(const EngineConfig& config, std::vector<DeviceBackend> devices, PageQuotas quotas)
    : config_(config),
      pool_(config.capacity_pages, std::move(quotas), static_cast<int>(devices.size())),
      sequences_(config.max_sequences) {
  for (DeviceBackend& d : devices) {
    Device& device = devices_.emplace_back();
    device.slot = d.slot;
    device.backend = std::move(d.backend);
    device.batcher = std::make_unique<SelectBatcher>(*device.backend, config_);
  }
}

// Each device's batcher drains and joins before its backend goes (Device's member order).
Engine::~Engine() = default;

void Engine::SetObserver(EngineObserver* observer) {
  for (Device& d : devices_) d.batcher->SetObserver(observer);
}

int Engine::PlaceNew(int64_t blocks, std::vector<int64_t>& free,
                     std::vector<int64_t>& planned) const {
  if (devices_.size() == 1) return 0;
  if (free.empty()) {
    free = pool_.FreePagesPerDevice();
    planned.assign(free.size(), 0);
  }
  // A failed device would refuse every call on the sequence: place it elsewhere while we can.
  int best = -1;
  for (int d = 0; d < static_cast<int>(free.size()); ++d) {
    if (!devices_[d].backend->Health().ok()) continue;
    if (best < 0 || free[d] - planned[d] > free[best] - planned[best]) best = d;
  }
  (void)blocks;
  return best < 0 ? 0 : best;
}

absl::Status Engine::ReadPagesAnyDevice(std::span<const int32_t> pages, uint8_t* dst) {
  const int64_t page_bytes = config_.BytesPerPage();
  for (size_t begin = 0; begin < pages.size();) {
    const int device = pool_.DeviceOf(pages[begin]);
    size_t end = begin + 1;
    while (end < pages.size() && pool_.DeviceOf(pages[end]) == device) ++end;
    INDEXER_RETURN_IF_ERROR(devices_[device].backend->ReadPages(
        pages.subspan(begin, end - begin), dst + static_cast<int64_t>(begin) * page_bytes));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status Engine::WritePagesAnyDevice(std::span<const int32_t> pages, const uint8_t* src) {
  const int64_t page_bytes = config_.BytesPerPage();
  for (size_t begin = 0; begin < pages.size();) {
    const int device = pool_.DeviceOf(pages[begin]);
    size_t end = begin + 1;
    while (end < pages.size() && pool_.DeviceOf(pages[end]) == device) ++end;
    INDEXER_RETURN_IF_ERROR(devices_[device].backend->WritePages(
        pages.subspan(begin, end - begin), src + static_cast<int64_t>(begin) * page_bytes));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status Engine::PrepareAppend(const AppendRequest& r, absl::string_view step_sequence_id,
                                   PreparedAppend* out) const {
  if (!r.sequence_id.empty() && r.sequence_id != step_sequence_id) {
    return absl::InvalidArgumentError(absl::StrCat("append.sequence_id '", r.sequence_id,
                                                   "' differs from the request's sequence_id '",
                                                   step_sequence_id, "'"));
  }
  if (r.all_layers) {
    out->layer_begin = 0;
    out->layer_count = config_.layers;
  } else {
    INDEXER_RETURN_IF_ERROR(CheckRange("layer", r.layer, 0, config_.layers - 1));
    out->layer_begin = static_cast<int>(r.layer);
    out->layer_count = 1;
  }
  const int64_t row = int64_t{out->layer_count} * config_.head_dim;
  INDEXER_RETURN_IF_ERROR(DecodeRows(r.keys, r.dtype, row, "keys", &out->keys, &out->num_tokens));
  if (out->num_tokens > config_.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys hold ", out->num_tokens, " tokens; max_tokens_per_sequence is ",
                     config_.max_tokens_per_sequence));
  }
  const int64_t max_attn =
      (int64_t{std::numeric_limits<int32_t>::max()} - config_.page_table.pages_per_block + 1) /
      config_.page_table.block_page_stride;
  for (size_t i = 0; i < r.attention_pages.size(); ++i) {
    INDEXER_RETURN_IF_ERROR(
        CheckRange(absl::StrCat("attention_pages[", i, "]"), r.attention_pages[i], 0, max_attn));
  }
  out->attn.assign(r.attention_pages.begin(), r.attention_pages.end());
  return absl::OkStatus();
}

absl::Status Engine::PrepareStep(const StepRequest& r, PreparedStep* out) const {
  INDEXER_RETURN_IF_ERROR(CheckId(r.sequence_id, "sequence_id"));
  INDEXER_RETURN_IF_ERROR(CheckRange("layer", r.layer, 0, config_.layers - 1));
  out->tenant = r.tenant;
  out->sequence_id = r.sequence_id;
  out->layer = static_cast<int>(r.layer);
  out->has_append = r.append.has_value();
  if (out->has_append) INDEXER_RETURN_IF_ERROR(PrepareAppend(*r.append, r.sequence_id, &out->append));
  out->has_select = !r.queries.empty();
  if (!out->has_select) {
    if (!out->has_append) {
      return absl::InvalidArgumentError("queries is empty and there is no append: nothing to do");
    }
    return absl::OkStatus();
  }
  INDEXER_RETURN_IF_ERROR(CheckRange("num_heads", r.num_heads, 1, config_.max_index_heads));
  out->num_heads = static_cast<int>(r.num_heads);
  int64_t n = 0;
  INDEXER_RETURN_IF_ERROR(DecodeRows(r.queries, r.query_dtype, r.num_heads * config_.head_dim,
                                     "queries", &out->queries, &n));
  INDEXER_RETURN_IF_ERROR(CheckRange("query tokens (queries rows)", n, 1, config_.max_query_tokens));
  out->num_tokens = static_cast<int>(n);
  if (r.start_position && *r.start_position < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("start_position is ", *r.start_position, "; it must be >= 0"));
  }
  out->start_position = r.start_position;
  const int64_t topk = r.topk.value_or(config_.defaults.topk);
  INDEXER_RETURN_IF_ERROR(CheckRange("topk", topk, 1, config_.max_topk));
  const int64_t init = r.init_blocks.value_or(config_.defaults.init_blocks);
  const int64_t local = r.local_blocks.value_or(config_.defaults.local_blocks);
  INDEXER_RETURN_IF_ERROR(CheckRange("init_blocks", init, 0, std::numeric_limits<int64_t>::max()));
  INDEXER_RETURN_IF_ERROR(CheckRange("local_blocks", local, 0, std::numeric_limits<int64_t>::max()));
  out->params.topk = static_cast<int>(topk);
  out->params.init_blocks = static_cast<int>(std::min(init, kMaxForcedBlocks));
  out->params.local_blocks = static_cast<int>(std::min(local, kMaxForcedBlocks));
  return absl::OkStatus();
}

absl::Status Engine::CheckSpan(const Sequence& seq, PreparedStep& step) const {
  int64_t len = seq.lengths[step.layer];
  if (step.has_append && step.layer >= step.append.layer_begin &&
      step.layer < step.append.layer_begin + step.append.layer_count) {
    len += step.append.num_tokens;
  }
  const int64_t n = step.num_tokens;
  const int64_t p0 = step.start_position.value_or(len - n);
  if (p0 < 0 || p0 > len - n) {  // not p0 + n > len: p0 may be near INT64_MAX
    return absl::FailedPreconditionError(absl::StrCat(
        "the query span of ", n, " tokens from start_position ", p0, " of sequence '", seq.id,
        "' is not inside layer ", step.layer, "'s ", len,
        " tokens; every position must be < the layer's length"));
  }
  // Both backends hold a raw score per (row, visible block) while selecting.
  const int64_t scores = n * step.num_heads * kernels::VisibleBlocks(p0 + n - 1);
  if (scores > config_.max_select_scores) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the query span of ", n, " tokens x ", step.num_heads, " heads over ",
        kernels::VisibleBlocks(p0 + n - 1), " blocks needs ", scores, " block scores; the limit is ",
        config_.max_select_scores, ": split the span into smaller chunks"));
  }
  step.start_pos = p0;
  return absl::OkStatus();
}

absl::Status Engine::ApplyAppend(Sequence& seq, const PreparedAppend& a,
                                 std::vector<std::pair<int64_t, int32_t>>* replaced,
                                 DeferredWrite* deferred) {
  std::vector<int64_t> lengths = seq.lengths;
  for (int l = a.layer_begin; l < a.layer_begin + a.layer_count; ++l) {
    lengths[l] += a.num_tokens;
    if (lengths[l] > config_.max_tokens_per_sequence) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence '", seq.id, "' would hold ", lengths[l], " tokens in layer ", l,
          "; max_tokens_per_sequence is ", config_.max_tokens_per_sequence));
    }
  }
  const int64_t needed = BlocksFor(*std::max_element(lengths.begin(), lengths.end()));
  const int64_t old_blocks = static_cast<int64_t>(seq.pages.size());
  const int64_t fresh = needed - old_blocks;
  const bool has_attn = seq.attn_decided ? seq.has_attn_pages : !a.attn.empty();
  if (has_attn && static_cast<int64_t>(a.attn.size()) != fresh) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention_pages has ", a.attn.size(), " ids; this append opens ", fresh,
        " new blocks of sequence '", seq.id, "', which has attention pages, so it needs ", fresh));
  }
  if (!has_attn && !a.attn.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence '", seq.id, "' was created without attention pages; attention_pages must be empty"));
  }

  // Existing pages this append writes into that another sequence shares: copy them first.
  std::vector<int64_t> cow_blocks;
  for (int l = a.layer_begin; l < a.layer_begin + a.layer_count; ++l) {
    const int64_t last = std::min(BlocksFor(lengths[l]), old_blocks);
    for (int64_t b = seq.lengths[l] / kBlockSize; b < last; ++b) {
      if (pool_.RefCount(seq.pages[b]) > 1 &&
          std::find(cow_blocks.begin(), cow_blocks.end(), b) == cow_blocks.end()) {
        cow_blocks.push_back(b);
      }
    }
  }
  absl::StatusOr<std::vector<int32_t>> fresh_pages = pool_.Allocate(
      fresh + static_cast<int64_t>(cow_blocks.size()), seq.tenant, true, seq.device);
  if (!fresh_pages.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("append to sequence '", seq.id, "': ", fresh_pages.status().message()));
  }
  const std::vector<int32_t>& got = *fresh_pages;
  std::vector<int32_t> table = seq.pages;
  table.resize(needed);
  for (size_t i = 0; i < cow_blocks.size(); ++i) table[cow_blocks[i]] = got[i];
  for (int64_t j = 0; j < fresh; ++j) table[old_blocks + j] = got[cow_blocks.size() + j];

  // Until the commit below, everything written lands in pages only this call holds or in
  // positions past the sequence's lengths, so a failure leaves the sequence as it was.
  absl::Status status;
  for (size_t i = 0; i < cow_blocks.size() && status.ok(); ++i) {
    status = BackendOf(seq).CopyPage(seq.pages[cow_blocks[i]], got[i]);
  }
  std::vector<int64_t> starts(seq.lengths.begin() + a.layer_begin,
                              seq.lengths.begin() + a.layer_begin + a.layer_count);
  if (status.ok() && deferred == nullptr) {
    status = BackendOf(seq).WriteKeys(KeyWrite{table.data(), a.num_tokens, a.layer_begin,
                                          a.layer_count, starts.data(), a.keys.data()});
  }
  if (!status.ok()) {
    pool_.Release(got);
    return status;
  }
  for (int64_t b : cow_blocks) replaced->emplace_back(b, seq.pages[b]);
  seq.pages = std::move(table);
  if (deferred != nullptr) {
    deferred->starts = std::move(starts);
    deferred->write = KeyWrite{seq.pages.data(), a.num_tokens, a.layer_begin, a.layer_count,
                               deferred->starts.data(), a.keys.data()};
  }
  seq.lengths = std::move(lengths);
  if (!seq.attn_decided) {
    seq.attn_decided = true;
    seq.has_attn_pages = has_attn;
  }
  seq.attn_pages.insert(seq.attn_pages.end(), a.attn.begin(), a.attn.end());
  return absl::OkStatus();
}

void Engine::ReleaseReplaced(const std::vector<std::pair<int64_t, int32_t>>& replaced) {
  for (const auto& [block, original] : replaced) {
    pool_.Release(std::span<const int32_t>(&original, 1));
  }
}

int64_t Engine::AnswerBytes(const PreparedStep& s, bool attn_pages) const {
  // Results are packed int32; allow for field tags, lengths and the per-item envelope.
  int64_t bytes = 64 + int64_t{8} * config_.layers;
  if (s.has_select) {
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    bytes += 4 * rows * s.params.topk;
    if (attn_pages) bytes += 4 * rows * (int64_t{s.params.topk} * config_.page_table.pages_per_block + 1);
  }
  return bytes;
}

void Engine::RunWave(std::span<PreparedStep*> wave,
                     std::vector<absl::StatusOr<StepResult>>& results, int64_t& budget,
                     const CallControl& control) {
  // Resolve and lock the wave's sequences (distinct by construction) in address order, so that
  // concurrent waves cannot deadlock. A sequence released between lookup and lock is looked up
  // again: an append then creates it anew.
  std::vector<PreparedStep*> pending(wave.begin(), wave.end());
  std::vector<PreparedStep*> live;
  std::vector<std::unique_lock<std::mutex>> locks;
  std::vector<int64_t> free_per_device, planned;  // for placing new sequences
  for (int attempt = 0;; ++attempt) {
    live.clear();
    for (PreparedStep* s : pending) {
      if (s->seq == nullptr) {
        s->seq = sequences_.Find(s->tenant, s->sequence_id);
        if (s->seq == nullptr && s->has_append) {
          const int device = PlaceNew(BlocksFor(s->append.num_tokens), free_per_device, planned);
          bool created = false;
          s->seq = sequences_.FindOrCreate(s->tenant, s->sequence_id, config_.layers, &created,
                                           device);
          s->created = s->created || created;
          // Pages promised to a sequence this wave creates count against its device for the
          // next placement (a sequence found, or created by another call, takes none here).
          if (created && !planned.empty()) planned[device] += BlocksFor(s->append.num_tokens);
        }
      }
      if (s->seq == nullptr) {
        results[s->index] =
            s->has_append
                ? SequenceLimitError(s->sequence_id, config_.max_sequences)
                : absl::NotFoundError(absl::StrCat("sequence '", s->sequence_id, "' does not exist"));
        continue;
      }
      live.push_back(s);
    }
    std::sort(live.begin(), live.end(),
              [](PreparedStep* a, PreparedStep* b) { return a->seq.get() < b->seq.get(); });
    for (PreparedStep* s : live) locks.emplace_back(s->seq->mu);
    const int64_t now = SteadyNowNs();
    for (PreparedStep* s : live) s->seq->last_used_ns = now;
    bool stale = false;
    for (PreparedStep* s : live) stale = stale || s->seq->released;
    if (!stale || attempt == 2) break;
    locks.clear();
    for (PreparedStep* s : live) {
      if (s->seq->released) s->seq = nullptr;
    }
    pending = live;
  }

  // Takes back an applied append (its keys may or may not have been written), so that nothing
  // of a failed step stays.
  auto undo_step = [&](PreparedStep* s, const AppendUndo& u, const absl::Status& status) {
    Sequence& seq = *s->seq;
    for (const auto& [block, original] : u.replaced) {
      pool_.Release(std::span<const int32_t>(&seq.pages[block], 1));  // the copy
      seq.pages[block] = original;  // its reference was kept
    }
    if (seq.pages.size() > u.pages) {
      pool_.Release(std::span<const int32_t>(seq.pages.data() + u.pages, seq.pages.size() - u.pages));
      seq.pages.resize(u.pages);
    }
    seq.lengths = u.lengths;
    seq.attn_pages.resize(u.attn_pages);
    seq.attn_decided = u.attn_decided;
    if (!u.attn_decided) seq.has_attn_pages = false;
    if (s->created && seq.Empty() && sequences_.EraseIfSame(s->seq)) seq.released = true;
    results[s->index] = status;
    budget += s->charged;  // nothing of this step is answered
    s->charged = 0;
  };

  std::vector<SelectTask> tasks;
  std::vector<PreparedStep*> selecting;
  std::vector<AppendUndo> undo;
  // Appends without a selection, and every append's key write, settled after the loop.
  std::vector<PreparedStep*> appending;
  std::vector<AppendUndo> append_undo;
  std::vector<DeferredWrite> writes;
  std::vector<PreparedStep*> writers;
  writes.reserve(live.size());
  for (PreparedStep* s : live) {
    Sequence& seq = *s->seq;
    absl::Status status;
    if (seq.released) {
      status = absl::NotFoundError(absl::StrCat("sequence '", s->sequence_id, "' does not exist"));
    }
    if (status.ok() && s->has_select) status = CheckSpan(seq, *s);
    if (status.ok() && budget >= 0) {
      const bool attn = seq.attn_decided ? seq.has_attn_pages : s->has_append && !s->append.attn.empty();
      const int64_t bytes = AnswerBytes(*s, attn);
      if (bytes > budget) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "the answer for sequence '", s->sequence_id, "' would take about ", bytes,
            " bytes and the call has ", budget, " of max_response_bytes ", config_.max_response_bytes,
            " left; ask for fewer tokens, heads or topk per call"));
      } else {
        budget -= bytes;
        s->charged = bytes;
      }
    }
    AppendUndo before{seq.lengths, seq.pages.size(), seq.attn_pages.size(), seq.attn_decided, {}};
    if (status.ok() && s->has_append) {
      DeferredWrite w;
      status = ApplyAppend(seq, s->append, &before.replaced, &w);
      if (status.ok()) {
        writes.push_back(std::move(w));
        writers.push_back(s);
      }
    }
    if (!status.ok()) {
      results[s->index] = status;
      budget += s->charged;
      s->charged = 0;
      if (s->created && !seq.released && seq.Empty() && sequences_.EraseIfSame(s->seq)) {
        seq.released = true;
      }
      continue;
    }
    StepResult r;
    r.created = s->created;
    r.lengths = seq.lengths;
    r.num_blocks = static_cast<int64_t>(seq.pages.size());
    if (s->has_select) {
      r.num_tokens = s->num_tokens;
      r.num_heads = s->num_heads;
      r.topk = s->params.topk;
      r.start_position = s->start_pos;
      const int64_t rows = int64_t{s->num_tokens} * s->num_heads;
      r.block_ids.resize(rows * s->params.topk);
      SelectTask task;
      task.layer = s->layer;
      kernels::SpanSelect& span = task.span;
      span.block_table = seq.pages.data();
      span.start_pos = s->start_pos;
      span.num_tokens = s->num_tokens;
      span.num_heads = s->num_heads;
      span.queries = s->queries.data();
      span.params = s->params;
      if (seq.has_attn_pages) {
        r.page_table.resize(rows * s->params.topk * config_.page_table.pages_per_block);
        r.context_lens.resize(rows);
        span.attn_pages = seq.attn_pages.data();
      }
      results[s->index] = std::move(r);
      StepResult& placed = *results[s->index];
      span.block_ids = placed.block_ids.data();
      span.page_table = placed.page_table.empty() ? nullptr : placed.page_table.data();
      span.context_lens = placed.context_lens.empty() ? nullptr : placed.context_lens.data();
      tasks.push_back(task);
      selecting.push_back(s);
      undo.push_back(std::move(before));
    } else {
      results[s->index] = std::move(r);
      appending.push_back(s);
      append_undo.push_back(std::move(before));
    }
  }
  // The wave's key writes: one backend call per device. A device whose writes fail fails every
  // step that wrote to it, and those steps are taken back.
  absl::flat_hash_map<PreparedStep*, absl::Status> write_failed;
  if (!writes.empty()) {
    std::vector<KeyWrite> batch;
    for (size_t d = 0; d < devices_.size(); ++d) {
      batch.clear();
      for (size_t i = 0; i < writes.size(); ++i) {
        if (static_cast<size_t>(writers[i]->seq->device) == d) batch.push_back(writes[i].write);
      }
      if (batch.empty()) continue;
      const absl::Status status = devices_[d].backend->WriteKeysBatch(batch);
      if (status.ok()) continue;
      for (PreparedStep* w : writers) {
        if (static_cast<size_t>(w->seq->device) == d) write_failed.emplace(w, status);
      }
    }
  }
  for (size_t i = 0; i < appending.size(); ++i) {
    const auto failed = write_failed.find(appending[i]);
    if (failed == write_failed.end()) {
      ReleaseReplaced(append_undo[i].replaced);
    } else {
      undo_step(appending[i], append_undo[i], failed->second);
    }
  }
  if (!write_failed.empty()) {
    size_t kept = 0;
    for (size_t i = 0; i < tasks.size(); ++i) {
      const auto failed = write_failed.find(selecting[i]);
      if (failed != write_failed.end()) {
        undo_step(selecting[i], undo[i], failed->second);
        continue;
      }
      tasks[kept] = tasks[i];
      selecting[kept] = selecting[i];
      if (kept != i) undo[kept] = std::move(undo[i]);
      ++kept;
    }
    tasks.resize(kept);
    selecting.resize(kept);
    undo.resize(kept);
  }
  // Per device, one group per chunk of tasks that need at most max_select_scores raw block
  // scores together (one span may need them all): a launch's scratch memory stays bounded
  // however many long spans a Batch carries. Decode-sized waves are one group per device. Every
  // group is submitted before any is waited on, so devices select in parallel; the batchers may
  // merge the groups with other calls' into one launch. The sequences stay locked until answered.
  if (devices_.size() > 1) {
    std::vector<size_t> order(tasks.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return selecting[a]->seq->device < selecting[b]->seq->device;
    });
    std::vector<SelectTask> sorted_tasks;
    std::vector<PreparedStep*> sorted_selecting;
    std::vector<AppendUndo> sorted_undo;
    for (size_t i : order) {
      sorted_tasks.push_back(tasks[i]);
      sorted_selecting.push_back(selecting[i]);
      sorted_undo.push_back(std::move(undo[i]));
    }
    tasks = std::move(sorted_tasks);
    selecting = std::move(sorted_selecting);
    undo = std::move(sorted_undo);
  }
  struct Chunk {
    size_t begin, end;
    SelectTicket ticket;
  };
  std::vector<Chunk> chunks;
  for (size_t begin = 0; begin < tasks.size();) {
    const int device = selecting[begin]->seq->device;
    size_t end = begin + 1;
    int64_t scores = SpanScores(tasks[begin].span);
    while (end < tasks.size() && selecting[end]->seq->device == device &&
           scores + SpanScores(tasks[end].span) <= config_.max_select_scores) {
      scores += SpanScores(tasks[end++].span);
    }
    chunks.push_back(Chunk{begin, end, {}});
    begin = end;
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    Chunk& c = chunks[i];
    SelectBatcher& batcher = *devices_[selecting[c.begin]->seq->device].batcher;
    // Only the last group may run on this thread (the batcher's fast path): the others are
    // queued first, so that they run meanwhile.
    c.ticket = batcher.Submit(std::span<const SelectTask>(tasks).subspan(c.begin, c.end - c.begin),
                              control, /*may_run_here=*/i + 1 == chunks.size());
  }
  for (Chunk& c : chunks) {
    const absl::Status status = c.ticket.Wait();
    for (size_t i = c.begin; i < c.end; ++i) {
      if (status.ok()) {
        ReleaseReplaced(undo[i].replaced);
        continue;
      }
      // The selection failed (or was refused or dropped): take back the step's append so
      // nothing is half-applied.
      undo_step(selecting[i], undo[i], status);
    }
  }
}

std::vector<absl::StatusOr<StepResult>> Engine::Batch(std::span<const StepRequest> items,
                                                      const CallControl& control) {
  CallGate::Pass pass(gate_);
  std::vector<absl::StatusOr<StepResult>> results(items.size(),
                                                  absl::InternalError("step was not run"));
  if (static_cast<int64_t>(items.size()) > config_.max_batch_items) {
    const absl::Status too_many = absl::InvalidArgumentError(absl::StrCat(
        "the batch has ", items.size(), " items; max_batch_items is ", config_.max_batch_items));
    for (auto& r : results) r = too_many;
    return results;
  }
  std::vector<PreparedStep> steps(items.size());
  std::vector<PreparedStep*> ready;
  for (size_t i = 0; i < items.size(); ++i) {
    steps[i].index = i;
    const absl::Status status = PrepareStep(items[i], &steps[i]);
    if (status.ok()) {
      ready.push_back(&steps[i]);
    } else {
      results[i] = status;
    }
  }
  // Waves: maximal runs of items on distinct sequences, so a sequence's steps apply in order.
  int64_t budget = config_.max_response_bytes > 0 ? config_.max_response_bytes : -1;
  size_t begin = 0;
  while (begin < ready.size()) {
    absl::flat_hash_set<std::pair<absl::string_view, absl::string_view>> ids;
    size_t end = begin;
    while (end < ready.size() &&
           ids.insert({ready[end]->tenant, ready[end]->sequence_id}).second) {
      ++end;
    }
    const absl::Status status = control.Check();
    if (!status.ok()) {
      for (size_t i = begin; i < ready.size(); ++i) results[ready[i]->index] = status;
      break;
    }
    RunWave(std::span<PreparedStep*>(ready.data() + begin, end - begin), results, budget, control);
    begin = end;
  }
  return results;
}

absl::StatusOr<StepResult> Engine::Append(const AppendRequest& request,
                                          const CallControl& control) {
  StepRequest step;
  step.tenant = request.tenant;
  step.sequence_id = request.sequence_id;
  step.layer = request.all_layers ? 0 : request.layer;
  step.append = request;
  return std::move(Batch(std::span<const StepRequest>(&step, 1), control)[0]);
}

absl::StatusOr<StepResult> Engine::Select(const StepRequest& request, const CallControl& control) {
  if (request.queries.empty()) {
    return absl::InvalidArgumentError("queries is empty; a selection needs at least one token");
  }
  return std::move(Batch(std::span<const StepRequest>(&request, 1), control)[0]);
}

absl::StatusOr<int64_t> Engine::Release(absl::string_view sequence_id, absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  std::shared_ptr<Sequence> seq = sequences_.Erase(tenant, sequence_id);
  if (seq == nullptr) {
    return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
  }
  std::lock_guard<std::mutex> lock(seq->mu);
  seq->released = true;
  const int64_t freed = pool_.Release(seq->pages);
  seq->pages.clear();
  return freed;
}

absl::StatusOr<TruncateResult> Engine::Truncate(absl::string_view sequence_id, int64_t length,
                                                absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  INDEXER_RETURN_IF_ERROR(CheckRange("length", length, 0, std::numeric_limits<int64_t>::max()));
  std::shared_ptr<Sequence> seq = sequences_.Find(tenant, sequence_id);
  if (seq != nullptr) {
    std::lock_guard<std::mutex> lock(seq->mu);
    if (!seq->released) {
      seq->last_used_ns = SteadyNowNs();
      for (int64_t& len : seq->lengths) len = std::min(len, length);
      const size_t keep = static_cast<size_t>(BlocksFor(seq->MaxLength()));
      TruncateResult r;
      if (seq->pages.size() > keep) {
        r.pages_freed = pool_.Release(
            std::span<const int32_t>(seq->pages.data() + keep, seq->pages.size() - keep));
        seq->pages.resize(keep);
      }
      if (seq->attn_pages.size() > keep) seq->attn_pages.resize(keep);
      r.lengths = seq->lengths;
      r.num_blocks = static_cast<int64_t>(keep);
      return r;
    }
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
}

absl::StatusOr<ForkResult> Engine::Fork(absl::string_view source_id, absl::string_view target_id,
                                        std::optional<int64_t> length,
                                        absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(source_id, "source_id"));
  INDEXER_RETURN_IF_ERROR(CheckId(target_id, "target_id"));
  if (source_id == target_id) {
    return absl::InvalidArgumentError("target_id must differ from source_id");
  }
  if (length) {
    INDEXER_RETURN_IF_ERROR(CheckRange("length", *length, 0, std::numeric_limits<int64_t>::max()));
  }
  std::shared_ptr<Sequence> src = sequences_.Find(tenant, source_id);
  if (src == nullptr) {
    return absl::NotFoundError(absl::StrCat("sequence '", source_id, "' does not exist"));
  }
  // A fork shares its source's pages, so it lives on its source's device.
  auto fork = std::make_shared<Sequence>(std::string(tenant), std::string(target_id),
                                         config_.layers, src->device);
  {
    std::lock_guard<std::mutex> lock(src->mu);
    src->last_used_ns = SteadyNowNs();
    if (src->released) {
      return absl::NotFoundError(absl::StrCat("sequence '", source_id, "' does not exist"));
    }
    for (int l = 0; l < config_.layers; ++l) {
      fork->lengths[l] = std::min(src->lengths[l], length.value_or(src->lengths[l]));
    }
    const size_t keep = static_cast<size_t>(BlocksFor(fork->MaxLength()));
    fork->pages.assign(src->pages.begin(), src->pages.begin() + keep);
    fork->attn_decided = src->attn_decided;
    fork->has_attn_pages = src->has_attn_pages;
    if (src->has_attn_pages) {
      fork->attn_pages.assign(src->attn_pages.begin(), src->attn_pages.begin() + keep);
    }
    // References are taken under the source's lock, so its pages cannot be freed meanwhile.
    pool_.AddRef(fork->pages);
  }
  const SequenceTable::InsertResult inserted = sequences_.Insert(fork);
  if (inserted != SequenceTable::InsertResult::kInserted) {
    pool_.Release(fork->pages);
    if (inserted == SequenceTable::InsertResult::kFull) {
      return SequenceLimitError(target_id, config_.max_sequences);
    }
    return absl::AlreadyExistsError(absl::StrCat("sequence '", target_id, "' already exists"));
  }
  ForkResult r;
  r.lengths = fork->lengths;
  r.num_blocks = static_cast<int64_t>(fork->pages.size());
  r.pages_shared = r.num_blocks;
  return r;
}

absl::StatusOr<SequenceInfo> Engine::Get(absl::string_view sequence_id,
                                         absl::string_view tenant) const {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  std::shared_ptr<Sequence> seq = sequences_.Find(tenant, sequence_id);
  if (seq != nullptr) {
    std::lock_guard<std::mutex> lock(seq->mu);
    if (!seq->released) {
      SequenceInfo info;
      info.device = seq->device;
      info.lengths = seq->lengths;
      info.pages = seq->pages;
      info.attention_pages = seq->attn_pages;
      for (int32_t p : seq->pages) info.shared_pages += pool_.RefCount(p) > 1 ? 1 : 0;
      return info;
    }
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
}

int64_t Engine::ReclaimIdle(absl::Duration idle) {
  CallGate::Pass pass(gate_);
  const int64_t now = SteadyNowNs();
  const int64_t limit = absl::ToInt64Nanoseconds(idle);
  int64_t reclaimed = 0;
  for (const std::shared_ptr<Sequence>& seq : sequences_.All()) {
    std::lock_guard<std::mutex> lock(seq->mu);
    if (seq->released || now - seq->last_used_ns < limit) continue;
    if (!sequences_.EraseIfSame(seq)) continue;
    seq->released = true;
    pool_.Release(seq->pages);
    seq->pages.clear();
    ++reclaimed;
  }
  return reclaimed;
}

EngineStats Engine::Stats() const {
  EngineStats s;
  s.live_sequences = static_cast<int64_t>(sequences_.size());
  const std::vector<int64_t> free = pool_.FreePagesPerDevice();
  for (size_t d = 0; d < devices_.size(); ++d) {
    DeviceStats& ds = s.devices.emplace_back();
    ds.slot = devices_[d].slot;
    ds.total_pages = pool_.pages_per_device();
    ds.free_pages = free[d];
    ds.queued_selects = devices_[d].batcher->queued_tasks();
    ds.health = devices_[d].backend->Health();
    s.total_pages += ds.total_pages;
    s.free_pages += ds.free_pages;
    s.queued_selects += ds.queued_selects;
  }
  return s;
}

absl::Status Engine::Health() const {
  for (const Device& d : devices_) {
    absl::Status health = d.backend->Health();
    if (!health.ok()) return health;
  }
  return absl::OkStatus();
}

TenantUsage Engine::Usage(absl::string_view tenant) const {
  return TenantUsage{pool_.TenantPages(tenant), pool_.TenantQuota(tenant)};
}

}  // namespace indexer::engine
