#include "client/bench/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

// Attention page ids wrap here, far below int32 overflow of id * stride + pages_per_block.
constexpr int64_t kAttentionPageWrap = 1 << 20;

int CodeOf(const absl::Status& status) { return static_cast<int>(status.code()); }

}  // namespace

SequenceSource::SequenceSource(const WorkloadSpec& spec, int64_t max_sequences)
    : spec_(spec), max_(max_sequences) {}

std::optional<SequencePlan> SequenceSource::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || (max_ > 0 && next_ >= max_)) return std::nullopt;
  return PlanSequence(spec_, next_++);
}

void SequenceSource::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

struct SimulatedScheduler::Slot {
  SequencePlan plan;
  int64_t length = 0;  // tokens per layer the server holds
  int steps_done = 0;
  bool appended_this_step = false;
  bool finished = false;
  std::vector<int32_t> attn;  // attention page per block (with --attention_pages)
  std::optional<HostKeys> host;
};

struct SimulatedScheduler::PendingItem {
  int slot = 0;
  int layer = 0;
  bool with_append = false;
  int n = 0;
  ValuePool::Slice keys{};
  ValuePool::Slice queries{};
  std::vector<int32_t> new_attn;
};

SimulatedScheduler::SimulatedScheduler(const SchedulerContext& context,
                                       client::ShardedClient& client, uint64_t seed)
    : ctx_(context), client_(client), rng_(seed), slots_(context.spec->batch) {}

SimulatedScheduler::~SimulatedScheduler() = default;

std::unique_ptr<SimulatedScheduler::Slot> SimulatedScheduler::StartSequence(
    const SequencePlan& plan) {
  const WorkloadSpec& spec = *ctx_.spec;
  const ServerShape& shape = *ctx_.shape;
  auto slot = std::make_unique<Slot>();
  slot->plan = plan;
  if (ctx_.check) slot->host.emplace(spec.layers, shape.head_dim, shape.key_storage);
  ctx_.recorder->SequenceStarted();
  const size_t row = static_cast<size_t>(shape.layers) * shape.head_dim;
  while (slot->length < plan.prefill_tokens) {
    const int64_t n = std::min<int64_t>(spec.prefill_chunk, plan.prefill_tokens - slot->length);
    const ValuePool::Slice keys = ctx_.pool->Take(static_cast<size_t>(n) * row, rng_);
    v1::AppendKeysRequest request;
    request.set_sequence_id(plan.id);
    request.set_all_layers(true);
    request.set_dtype(spec.wire_dtype);
    request.set_keys(PackSlice(keys, spec.wire_dtype));
    std::vector<int32_t> fresh;
    if (spec.attention_pages) {
      for (int64_t b = BlocksFor(slot->length); b < BlocksFor(slot->length + n); ++b) {
        fresh.push_back(
            static_cast<int32_t>(ctx_.attention_pages->fetch_add(1) % kAttentionPageWrap));
        request.add_attention_pages(fresh.back());
      }
    }
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<v1::AppendKeysResponse> r = client_.AppendKeys(request, ctx_.call);
    ctx_.recorder->RecordOther(Op::kPrefill, Clock::now() - t0, CodeOf(r.status()), n);
    if (!r.ok()) {
      Release(*slot);  // whatever was appended before the failure
      return nullptr;
    }
    slot->length += n;
    slot->attn.insert(slot->attn.end(), fresh.begin(), fresh.end());
    if (slot->host) slot->host->AppendAllLayers(keys.bits, n, shape.layers);
  }
  return slot;
}

void SimulatedScheduler::Release(Slot& slot) {
  if (slot.length > 0) {  // a sequence never appended to does not exist on the server
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<v1::ReleaseSequenceResponse> r =
        client_.ReleaseSequence(slot.plan.id, ctx_.call);
    ctx_.recorder->RecordOther(Op::kRelease, Clock::now() - t0, CodeOf(r.status()));
  }
  ctx_.recorder->SequenceReleased();
  slot.length = 0;
}

bool SimulatedScheduler::Refill() {
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr && slot->finished) {
      Release(*slot);
      slot.reset();
    }
  }
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr) continue;
    std::optional<SequencePlan> plan = ctx_.source->Next();
    if (!plan) break;
    slot = StartSequence(*plan);
    if (slot == nullptr) break;  // the server refused a prefill: try again next time
  }
  return std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return s != nullptr; });
}

v1::SelectBlocksRequest SimulatedScheduler::MakeItem(Slot& slot, int slot_index, int layer,
                                                     PendingItem* pending) {
  const WorkloadSpec& spec = *ctx_.spec;
  const ServerShape& shape = *ctx_.shape;
  const int n = spec.speculative;
  pending->slot = slot_index;
  pending->layer = layer;
  pending->n = n;
  pending->with_append = layer == 0;
  pending->queries = ctx_.pool->Take(static_cast<size_t>(n) * spec.heads * shape.head_dim, rng_);
  v1::SelectBlocksRequest item;
  item.set_sequence_id(slot.plan.id);
  item.set_layer(static_cast<uint32_t>(layer));
  item.set_num_heads(static_cast<uint32_t>(spec.heads));
  item.set_query_dtype(spec.wire_dtype);
  item.set_queries(PackSlice(pending->queries, spec.wire_dtype));
  item.set_topk(static_cast<uint32_t>(spec.topk));
  if (spec.init_blocks >= 0) item.set_init_blocks(static_cast<uint32_t>(spec.init_blocks));
  if (spec.local_blocks >= 0) item.set_local_blocks(static_cast<uint32_t>(spec.local_blocks));
  if (pending->with_append) {
    pending->keys = ctx_.pool->Take(static_cast<size_t>(n) * shape.layers * shape.head_dim, rng_);
    v1::AppendKeysRequest* append = item.mutable_append();
    append->set_all_layers(true);
    append->set_dtype(spec.wire_dtype);
    append->set_keys(PackSlice(pending->keys, spec.wire_dtype));
    if (spec.attention_pages) {
      for (int64_t b = BlocksFor(slot.length); b < BlocksFor(slot.length + n); ++b) {
        pending->new_attn.push_back(
            static_cast<int32_t>(ctx_.attention_pages->fetch_add(1) % kAttentionPageWrap));
        append->add_attention_pages(pending->new_attn.back());
      }
    }
  }
  return item;
}

int SimulatedScheduler::Apply(const PendingItem& item, const v1::BatchItemResult& result,
                              int64_t* selections, int64_t* tokens) {
  if (result.code() != 0) return result.code();
  Slot& slot = *slots_[item.slot];
  if (item.with_append) {
    slot.length += item.n;
    slot.attn.insert(slot.attn.end(), item.new_attn.begin(), item.new_attn.end());
    if (slot.host) slot.host->AppendAllLayers(item.keys.bits, item.n, ctx_.shape->layers);
    slot.appended_this_step = true;
    *tokens += item.n;
  }
  *selections += static_cast<int64_t>(item.n) * ctx_.spec->heads;
  if (ctx_.check) {
    const std::string where = absl::StrCat("sequence ", slot.plan.id, " layer ", item.layer, ": ");
    absl::StatusOr<client::Selection> got = client::ParseSelection(result.result());
    if (!got.ok()) {
      ctx_.recorder->RecordCheck(0, 0,
                                 absl::StrCat(where, "malformed answer: ", got.status().message()));
    } else {
      const CheckOutcome outcome = CheckSelection(*slot.host, item.layer, slot.attn,
                                                  item.queries.bits, *got, ctx_.check_params);
      ctx_.recorder->RecordCheck(outcome.rows, outcome.tolerated,
                                 outcome.mismatch.empty() ? "" : where + outcome.mismatch);
    }
  }
  return 0;
}

void SimulatedScheduler::FinishStep(Slot& slot) {
  const WorkloadSpec& spec = *ctx_.spec;
  slot.appended_this_step = false;
  if (spec.speculative > 1) {
    // Drafts are accepted in order until the first rejection; the first token always stays.
    int accepted = 1;
    std::bernoulli_distribution accept(spec.accept_rate);
    while (accepted < spec.speculative && accept(rng_)) ++accepted;
    const int drop = spec.speculative - accepted;
    if (drop > 0) Truncate(slot, slot.length - drop);
  }
  if (++slot.steps_done >= slot.plan.decode_steps) {
    slot.finished = true;
  } else if (spec.rewind > 0 && slot.steps_done % spec.rewind == 0 &&
             slot.length > slot.plan.prefill_tokens) {
    Truncate(slot, slot.plan.prefill_tokens);  // back to the prefill: a steady length
  }
}

void SimulatedScheduler::Truncate(Slot& slot, int64_t length) {
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<v1::TruncateSequenceResponse> r =
      client_.TruncateSequence(slot.plan.id, static_cast<uint32_t>(length), ctx_.call);
  ctx_.recorder->RecordOther(Op::kTruncate, Clock::now() - t0, CodeOf(r.status()));
  if (!r.ok()) return;
  slot.length = length;
  if (static_cast<int64_t>(slot.attn.size()) > BlocksFor(length)) {
    slot.attn.resize(static_cast<size_t>(BlocksFor(length)));
  }
  if (slot.host) slot.host->Truncate(length);
}

void SimulatedScheduler::Decode(Clock::time_point intended, bool measured, bool open_loop) {
  const WorkloadSpec& spec = *ctx_.spec;
  DecodeRecord record;
  record.intended = intended;
  record.measured = measured;
  record.open_loop = open_loop;

  if (spec.style == CallStyle::kUnary) {
    // The next live (slot, layer); a step in progress (layer > 0) always continues.
    if (cursor_layer_ == 0 || slots_[cursor_slot_] == nullptr) {
      cursor_layer_ = 0;
      for (size_t k = 0; k < slots_.size(); ++k) {
        const size_t s = (cursor_slot_ + k) % slots_.size();
        if (slots_[s] != nullptr && !slots_[s]->finished) {
          cursor_slot_ = s;
          break;
        }
      }
    }
    Slot* slot = slots_[cursor_slot_].get();
    if (slot == nullptr || slot->finished) return;  // Refill() said there was one: not reached
    PendingItem item;
    const v1::SelectBlocksRequest request =
        MakeItem(*slot, static_cast<int>(cursor_slot_), cursor_layer_, &item);
    record.sent = Clock::now();
    absl::StatusOr<v1::SelectBlocksResponse> r = client_.SelectBlocks(request, ctx_.call);
    record.done = Clock::now();
    v1::BatchItemResult result;
    result.set_code(CodeOf(r.status()));
    if (r.ok()) *result.mutable_result() = std::move(*r);
    record.code = Apply(item, result, &record.selections, &record.tokens);
    record.items = 1;
    record.item_codes[record.code] = 1;
    ctx_.recorder->RecordDecode(record);
    if (record.code != 0 && item.with_append) return;  // the step's append failed: retry it
    if (++cursor_layer_ >= spec.layers) {
      if (slot->appended_this_step) FinishStep(*slot);
      cursor_layer_ = 0;
      cursor_slot_ = (cursor_slot_ + 1) % slots_.size();
    }
    return;
  }

  // Batch and stream: the whole step of every live sequence in one request.
  v1::BatchRequest request;
  request.set_request_id(++request_id_);
  std::vector<PendingItem> items;
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s] == nullptr || slots_[s]->finished) continue;
    for (int layer = 0; layer < spec.layers; ++layer) {
      items.emplace_back();
      *request.add_items() = MakeItem(*slots_[s], static_cast<int>(s), layer, &items.back());
    }
  }
  if (items.empty()) return;
  record.sent = Clock::now();
  v1::BatchResponse response;
  if (spec.style == CallStyle::kStream) {
    if (stream_ == nullptr) stream_ = client_.OpenBatchStream();
    response = stream_->Step(request);
  } else {
    response = client_.Batch(request, ctx_.call);
  }
  record.done = Clock::now();
  record.items = static_cast<int64_t>(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const int code =
        Apply(items[i], response.results(static_cast<int>(i)), &record.selections, &record.tokens);
    ++record.item_codes[code];
    if (code != 0 && record.code == 0) record.code = code;
  }
  ctx_.recorder->RecordDecode(record);
  for (const std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr && slot->appended_this_step) FinishStep(*slot);
  }
}

void SimulatedScheduler::Drain() {
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr) Release(*slot);
    slot.reset();
  }
  if (stream_ != nullptr) {
    stream_->Finish().IgnoreError();  // failures were counted per request already
    stream_.reset();
  }
}

}  // namespace indexer::bench
