#include "engine/wave.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;

int64_t BlocksFor(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

absl::Status NotFound(absl::string_view id) {
  return absl::NotFoundError(absl::StrCat("sequence '", id, "' does not exist"));
}

void KeepSlowest(absl::Duration& slowest, absl::Duration d) { slowest = std::max(slowest, d); }

}  // namespace

Wave::Wave(EngineCore& core, std::span<PreparedStep* const> steps, CallContext call, Done done)
    : core_(core), call_(call), done_(std::move(done)), steps_(steps.size()) {
  for (size_t i = 0; i < steps.size(); ++i) steps_[i].request = steps[i];
}

void Wave::Start() {
  phase_start_ = absl::Now();
  Proceed();
}

void Wave::Proceed() {
  if (!Lock()) return;  // parked: Proceed runs again, off the unlocking thread, once it may succeed
  const absl::Time locked = absl::Now();
  call_.phases.lock += locked - phase_start_;
  for (Step* s : live_) Charge(*s);
  for (Step* s : live_) Apply(*s);
  call_.phases.apply += absl::Now() - locked;
  Submit();
}

void Wave::Resolve(std::vector<int64_t>& free, std::vector<int64_t>& planned) {
  live_.clear();
  unresolved_.clear();
  for (Step& s : steps_) {
    if (!s.failed && s.seq == nullptr) unresolved_.push_back(&s);
  }
  core_.sequences.FindAll(
      unresolved_.size(),
      [&](size_t i) {
        const PreparedStep& r = *unresolved_[i]->request;
        return SequenceTable::Name{r.tenant, r.sequence_id};
      },
      [&](size_t i, std::shared_ptr<Sequence> seq) { unresolved_[i]->seq = std::move(seq); });
  for (Step& s : steps_) {
    if (s.failed) continue;
    const PreparedStep& r = *s.request;
    SequenceTable::InsertResult refused = SequenceTable::InsertResult::kFull;
    if (s.seq == nullptr && r.has_append) {
      const int device = core_.PlaceNew(free, planned);
      bool created = false;
      s.seq = core_.sequences.FindOrCreate(r.tenant, r.sequence_id, core_.config.layers,
                                           &created, device, &refused);
      s.created = s.created || created;
      // Pages promised to a sequence this wave creates count against its device for the next
      // placement (a sequence found, or created by another call, takes none here).
      if (created && !planned.empty()) planned[device] += BlocksFor(r.append.num_tokens);
    }
    if (s.seq == nullptr) {
      Fail(s, r.has_append ? core_.sequences.RefusalStatus(refused, r.sequence_id)
                           : NotFound(r.sequence_id));
      continue;
    }
    live_.push_back(&s);
  }
  std::sort(live_.begin(), live_.end(),
            [](const Step* a, const Step* b) { return a->seq.get() < b->seq.get(); });
}

bool Wave::Lock() {
  // A sequence released between lookup and lock is looked up again (an append then creates it
  // anew), at most twice; after that its step fails NOT_FOUND under the lock.
  std::vector<int64_t> free, planned;  // for placing new sequences
  if (live_.empty()) Resolve(free, planned);
  for (;;) {
    for (size_t i = 0; i < live_.size(); ++i) {
      SequenceMutex::Wake resume = [this] { core_.resume.Post([this] { Proceed(); }); };
      if (!live_[i]->seq->mu.TryLockOrNotify(resume)) {
        for (size_t j = 0; j < i; ++j) live_[j]->seq->mu.unlock();
        return false;
      }
    }
    const int64_t now = SteadyNowNs();
    bool stale = false;
    for (Step* s : live_) {
      s->seq->last_used_ns = now;
      stale = stale || s->seq->released;
      s->seq->PrefetchState();
    }
    if (!stale || stale_retries_ == 2) return true;
    ++stale_retries_;
    Unlock();
    for (Step* s : live_) {
      if (s->seq->released) s->seq = nullptr;
    }
    Resolve(free, planned);
  }
}

void Wave::Charge(Step& s) {
  const PreparedStep& r = *s.request;
  Sequence& seq = *s.seq;
  if (seq.released) return Fail(s, NotFound(r.sequence_id));
  if (r.has_select) {
    const int64_t len = seq.lengths[r.layer] + r.AppendedTo(r.layer);
    const int64_t n = r.num_tokens;
    const int64_t p0 = r.start_position.value_or(len - n);
    if (p0 < 0 || p0 > len - n) {  // not p0 + n > len: p0 may be near INT64_MAX
      return Fail(s, absl::FailedPreconditionError(absl::StrCat(
                         "the query span of ", n, " tokens from start_position ", p0,
                         " of sequence '", seq.id, "' is not inside layer ", r.layer, "'s ", len,
                         " tokens; every position must be < the layer's length")));
    }
    const int64_t scores = kernels::SpanScores(n, r.num_heads, p0);
    if (scores > core_.config.max_select_scores) {
      return Fail(s, absl::ResourceExhaustedError(absl::StrCat(
                         "the query span of ", n, " tokens x ", r.num_heads, " heads over ",
                         kernels::VisibleBlocks(p0 + n - 1),
                         " blocks needs ", scores, " block scores; the limit is ",
                         core_.config.max_select_scores, ": split the span into smaller chunks")));
    }
    s.start_pos = p0;
  }
  const bool attn = seq.attn_decided ? seq.has_attn_pages : r.has_append && !r.append.attn.empty();
  // The item's reservation covers an error answer; a success may need more.
  const int64_t bytes =
      AnswerBytes(core_.config, r, attn) - LateErrorReservation(r.sequence_id);
  if (bytes > 0 && !call_.budget.Take(bytes)) {
    return Fail(s, absl::ResourceExhaustedError(absl::StrCat(
                       "the answer for sequence '", r.sequence_id, "' needs ",
                       bytes + LateErrorReservation(r.sequence_id), " bytes; the call has ",
                       call_.budget.left(), " of max_response_bytes ", call_.budget.limit(),
                       " left: ask for fewer tokens, heads or topk per call")));
  }
  s.charged = std::max<int64_t>(bytes, 0);
}

absl::Status Wave::CheckDeviceTensors(const Step& s) const {
  const PreparedStep& r = *s.request;
  const int devices[] = {r.has_append ? r.append.keys_device : kHostTensor,
                         r.has_select ? r.queries_device : kHostTensor,
                         r.has_select ? r.outputs.device : kHostTensor};
  const EngineDevice& home = core_.devices[s.seq->device];
  for (int device : devices) {
    if (device == kHostTensor || home.backend->TakesDeviceTensors(device)) continue;
    if (!home.backend->TakesDeviceTensors(home.slot.ordinal)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the ", home.backend->name(), " backend cannot read tensors in CUDA regions"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence '", s.seq->id, "' is on GPU ", home.slot.ordinal,
        "; its tensors are in a CUDA region on GPU ", device,
        " (a step's CUDA regions must be on its sequence's GPU)"));
  }
  return absl::OkStatus();
}

void Wave::Apply(Step& s) {
  if (s.failed) return;
  const PreparedStep& r = *s.request;
  if (absl::Status placed = CheckDeviceTensors(s); !placed.ok()) return Fail(s, placed);
  if (r.has_append) {
    const absl::Status status = ApplyAppend(s);
    if (!status.ok()) return Fail(s, status);
    s.applied = true;
  }
  Sequence& seq = *s.seq;
  StepResult result;
  result.created = s.created;
  if (call_.sink == nullptr || !call_.sink->KeepLengths(r.index, seq.lengths)) {
    result.lengths.assign(seq.lengths.begin(), seq.lengths.end());
  }
  result.num_blocks = static_cast<int64_t>(seq.pages.size());
  call_.results[r.index] = std::move(result);
  if (r.has_select) PrepareSelect(s);
}

absl::Status Wave::ApplyAppend(Step& s) {
  const PreparedAppend& a = s.request->append;
  Sequence& seq = *s.seq;
  const EngineConfig& config = core_.config;
  absl::InlinedVector<int64_t, 4> lengths(seq.lengths.begin(), seq.lengths.end());
  for (int l = a.layer_begin; l < a.layer_begin + a.layer_count; ++l) {
    lengths[l] += a.num_tokens;
    if (lengths[l] > config.max_tokens_per_sequence) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence '", seq.id, "' would hold ", lengths[l], " tokens in layer ", l,
          "; max_tokens_per_sequence is ", config.max_tokens_per_sequence));
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
  absl::InlinedVector<int64_t, 2> cow_blocks;
  for (int l = a.layer_begin; l < a.layer_begin + a.layer_count; ++l) {
    const int64_t last = std::min(BlocksFor(lengths[l]), old_blocks);
    for (int64_t b = seq.lengths[l] / kBlockSize; b < last; ++b) {
      if (core_.pool.RefCount(seq.pages[b]) > 1 &&
          std::find(cow_blocks.begin(), cow_blocks.end(), b) == cow_blocks.end()) {
        cow_blocks.push_back(b);
      }
    }
  }
  // Most decode steps open no block and share no page: they take nothing from the pool.
  const int64_t wanted = fresh + static_cast<int64_t>(cow_blocks.size());
  std::vector<int32_t> got;
  if (wanted > 0) {
    absl::StatusOr<std::vector<int32_t>> allocated =
        core_.pool.Allocate(wanted, seq.tenant, true, seq.device);
    if (!allocated.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("append to sequence '", seq.id, "': ", allocated.status().message()));
    }
    got = *std::move(allocated);
  }
  // Until the commit below, everything written lands in pages only this call holds or in
  // positions past the sequence's lengths, so a failure leaves the sequence as it was.
  for (size_t i = 0; i < cow_blocks.size(); ++i) {
    const absl::Status copied = core_.BackendOf(seq).CopyPage(seq.pages[cow_blocks[i]], got[i]);
    if (!copied.ok()) {
      core_.pool.Release(got);
      return copied;
    }
  }
  AppendUndo& undo = s.undo;
  undo.lengths.assign(seq.lengths.begin(), seq.lengths.end());
  undo.pages = seq.pages.size();
  undo.attn_pages = seq.attn_pages.size();
  undo.attn_decided = seq.attn_decided;
  s.write_starts.assign(seq.lengths.begin() + a.layer_begin,
                        seq.lengths.begin() + a.layer_begin + a.layer_count);
  seq.pages.resize(needed);
  for (size_t i = 0; i < cow_blocks.size(); ++i) {
    undo.replaced.emplace_back(cow_blocks[i], seq.pages[cow_blocks[i]]);
    seq.pages[cow_blocks[i]] = got[i];
  }
  for (int64_t j = 0; j < fresh; ++j) seq.pages[old_blocks + j] = got[cow_blocks.size() + j];
  seq.lengths.assign(lengths.begin(), lengths.end());
  if (!seq.attn_decided) {
    seq.attn_decided = true;
    seq.has_attn_pages = has_attn;
  }
  seq.attn_pages.insert(seq.attn_pages.end(), a.attn.begin(), a.attn.end());
  // The block table is read by the backend while the sequence stays locked and unchanged.
  s.writes = true;
  s.write = KeyWrite{seq.pages.data(), a.num_tokens, a.layer_begin, a.layer_count,
                     s.write_starts.data(), a.keys.data};
  s.write.keys_on_device = a.keys_device != kHostTensor;
  s.write.keys_nonfinite = &s.keys_nonfinite;
  s.write.keys_summary = a.keys.summary;
  return absl::OkStatus();
}

void Wave::PrepareSelect(Step& s) {
  const PreparedStep& r = *s.request;
  Sequence& seq = *s.seq;
  StepResult& result = *call_.results[r.index];
  result.num_tokens = r.num_tokens;
  result.num_heads = r.num_heads;
  result.topk = r.params.topk;
  result.start_position = s.start_pos;
  result.has_page_table = seq.has_attn_pages;
  const int64_t rows = int64_t{r.num_tokens} * r.num_heads;
  SelectShape shape;
  shape.block_ids = rows * r.params.topk;
  if (seq.has_attn_pages) {
    shape.page_table = shape.block_ids * core_.config.page_table.pages_per_block;
    shape.context_lens = rows;
  }
  // Outputs with provided memory go there; the sink (or the result) holds the others.
  const ProvidedOutputs& given = r.outputs;
  if (!given.block_ids.empty()) shape.block_ids = 0;
  if (!given.page_table.empty()) shape.page_table = 0;
  if (!given.context_lens.empty()) shape.context_lens = 0;
  SelectOutputs out;
  if (call_.sink != nullptr) {
    out = call_.sink->Allocate(r.index, shape);
  } else {
    result.block_ids.resize(shape.block_ids);
    result.page_table.resize(shape.page_table);
    result.context_lens.resize(shape.context_lens);
    out = SelectOutputs{result.block_ids.data(),
                        seq.has_attn_pages ? result.page_table.data() : nullptr,
                        seq.has_attn_pages ? result.context_lens.data() : nullptr};
  }
  if (!given.block_ids.empty()) out.block_ids = given.block_ids.data();
  if (seq.has_attn_pages && !given.page_table.empty()) out.page_table = given.page_table.data();
  if (seq.has_attn_pages && !given.context_lens.empty()) {
    out.context_lens = given.context_lens.data();
  }
  s.selects = true;
  s.task.layer = r.layer;
  kernels::SpanSelect& span = s.task.span;
  span.block_table = seq.pages.data();
  span.attn_pages = seq.has_attn_pages ? seq.attn_pages.data() : nullptr;
  span.start_pos = s.start_pos;
  span.num_tokens = r.num_tokens;
  span.num_heads = r.num_heads;
  span.queries = r.queries.data;
  span.params = r.params;
  span.block_ids = out.block_ids;
  span.page_table = out.page_table;
  span.context_lens = out.context_lens;
  span.queries_on_device = r.queries_device != kHostTensor;
  span.outputs_on_device = given.device != kHostTensor;
  span.queries_nonfinite = &s.queries_nonfinite;
  span.queries_summary = r.queries.summary;
}

void Wave::Submit() {
  // Per device, chunks of steps whose selections need at most max_select_scores raw block scores
  // together (one span may need them all): a launch's scratch memory stays bounded however many
  // long spans a Batch carries. A chunk holds its own steps' writes, so chunks are independent.
  chunks_.reserve(live_.size());
  for (size_t d = 0; d < core_.devices.size(); ++d) {
    int64_t scores = 0;
    int open = -1;
    for (Step* s : live_) {
      if (s->failed || static_cast<size_t>(s->seq->device) != d || (!s->writes && !s->selects)) {
        continue;
      }
      const int64_t cost = s->selects ? s->task.Scores() : 0;
      if (open < 0 || (scores > 0 && scores + cost > core_.config.max_select_scores)) {
        open = static_cast<int>(chunks_.size());
        Chunk& fresh = chunks_.emplace_back();
        fresh.device = static_cast<int>(d);
        fresh.steps.reserve(live_.size());
        fresh.writes.reserve(live_.size());
        fresh.selects.reserve(live_.size());
        scores = 0;
      }
      Chunk& c = chunks_[open];
      scores += cost;
      s->chunk = open;
      c.steps.push_back(s);
      if (s->writes) c.writes.push_back(s->write);
      if (s->selects) c.selects.push_back(s->task);
    }
  }
  if (chunks_.empty()) return Complete();
  pending_.store(chunks_.size());
  // Every chunk is handed over before any may run on this thread (only the last may: the
  // batcher's fast path), so that other devices' chunks run meanwhile. A chunk may end, and the
  // wave with it, inside Submit.
  const size_t n = chunks_.size();
  for (size_t i = 0; i < n; ++i) {
    Chunk& c = chunks_[i];
    core_.devices[c.device].batcher->Submit(
        c.writes, c.selects, call_.control,
        [this, i](StepStatus status) { OnChunkDone(i, std::move(status)); },
        /*may_run_here=*/i + 1 == n);
  }
}

void Wave::OnChunkDone(size_t chunk, StepStatus status) {
  chunks_[chunk].status = std::move(status);
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) Complete();
}

void Wave::Complete() {
  const absl::Time start = absl::Now();
  StepTiming slowest;
  for (Chunk& c : chunks_) {
    KeepSlowest(slowest.queue, c.status.timing.queue);
    KeepSlowest(slowest.stage, c.status.timing.stage);
    KeepSlowest(slowest.launch, c.status.timing.launch);
    KeepSlowest(slowest.device, c.status.timing.device);
    KeepSlowest(slowest.scatter, c.status.timing.scatter);
    for (Step* s : c.steps) {
      const absl::Status& status = !c.status.writes.ok() || !s->selects ? c.status.writes
                                                                         : c.status.selects;
      if (!status.ok()) {
        Rollback(*s, status);
        continue;
      }
      if (s->keys_nonfinite != 0 || s->queries_nonfinite != 0) {
        Rollback(*s, absl::InvalidArgumentError(absl::StrCat(
                         s->keys_nonfinite != 0 ? "keys" : "queries",
                         " (read by the device) hold a value that is not finite; every value must "
                         "be finite")));
        continue;
      }
      for (const auto& [block, original] : s->undo.replaced) {
        core_.pool.Release(std::span<const int32_t>(&original, 1));
      }
    }
  }
  Unlock();
  call_.phases.queue += slowest.queue;
  call_.phases.stage += slowest.stage;
  call_.phases.launch += slowest.launch;
  call_.phases.device += slowest.device;
  call_.phases.scatter += slowest.scatter;
  call_.phases.complete += absl::Now() - start;
  Done done = std::move(done_);
  std::move(done)();  // may destroy this wave
}

void Wave::Rollback(Step& s, const absl::Status& status) {
  Sequence& seq = *s.seq;
  if (s.applied) {
    const AppendUndo& u = s.undo;
    for (const auto& [block, original] : u.replaced) {
      core_.pool.Release(std::span<const int32_t>(&seq.pages[block], 1));  // the copy
      seq.pages[block] = original;  // its reference was kept
    }
    if (seq.pages.size() > u.pages) {
      core_.pool.Release(
          std::span<const int32_t>(seq.pages.data() + u.pages, seq.pages.size() - u.pages));
      seq.pages.resize(u.pages);
    }
    seq.lengths.assign(u.lengths.begin(), u.lengths.end());
    seq.attn_pages.resize(u.attn_pages);
    seq.attn_decided = u.attn_decided;
    if (!u.attn_decided) seq.has_attn_pages = false;
    s.applied = false;
  }
  Fail(s, status);
}

void Wave::Fail(Step& s, const absl::Status& status) {
  s.failed = true;
  call_.results[s.request->index] = LimitLateMessage(status, s.request->sequence_id);
  call_.budget.Give(s.charged);  // nothing of this step is answered
  s.charged = 0;
  if (s.seq != nullptr && s.created && !s.seq->released && s.seq->Empty() &&
      core_.sequences.EraseIfSame(s.seq)) {
    s.seq->released = true;
  }
}

void Wave::Unlock() {
  for (Step* s : live_) s->seq->mu.unlock();
}

}  // namespace indexer::engine
