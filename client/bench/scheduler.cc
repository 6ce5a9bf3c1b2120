#include "client/bench/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

// Attention page ids wrap here, far below int32 overflow of id * stride + pages_per_block.
constexpr int64_t kAttentionPageWrap = 1 << 20;

int CodeOf(const absl::Status& status) { return static_cast<int>(status.code()); }

}  // namespace

SequenceSource::SequenceSource(const WorkloadSpec& spec, int64_t max_sequences)
    : spec_(spec), max_(max_sequences) {
  if (spec.trace != nullptr) {
    const int64_t n = static_cast<int64_t>(spec.trace->size());
    max_ = max_ > 0 ? std::min(max_, n) : n;
  }
}

void SequenceSource::Begin(Clock::time_point start) {
  std::lock_guard<std::mutex> lock(mu_);
  begun_ = true;
  start_ = start;
}

SequenceSource::Offer SequenceSource::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  Offer offer;
  if (closed_ || (max_ > 0 && next_ >= max_)) {
    offer.done = true;
    return offer;
  }
  if (spec_.trace != nullptr) {
    const double at_s = (*spec_.trace)[static_cast<size_t>(next_)].at_s;
    const Clock::time_point at =
        start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at_s));
    const Clock::time_point now = Clock::now();
    if (at_s > 0 && (!begun_ || at > now)) {
      if (begun_) offer.next_arrival = at;
      return offer;
    }
    if (begun_) offer.admission_wait_ns = std::max<int64_t>(0, Nanos(now - at));
  }
  offer.plan = PlanSequence(spec_, next_++, /*staggered=*/!begun_);
  return offer;
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
  client::OutputsInMemory outputs;  // where the outputs were asked, by reference
};

struct SimulatedScheduler::InFlight {
  int group = 0;
  std::vector<PendingItem> items;
  DecodeRecord record;
};

SimulatedScheduler::SimulatedScheduler(const SchedulerContext& context,
                                       client::ShardedClient& client, uint64_t seed)
    : ctx_(context), client_(client), rng_(seed), slots_(context.spec->batch) {
  if (context.spec->style == CallStyle::kStream && context.spec->stream_inflight > 1) {
    pipeline_ = std::make_unique<PipelinedStream>(client);
    group_busy_.assign(static_cast<size_t>(context.spec->stream_inflight), false);
  }
  if (context.spec->shared_memory != SharedMemory::kNone) {
    // The run checked that the servers take regions; a worker that cannot have one says so and
    // sends inline.
    absl::StatusOr<std::unique_ptr<RequestRegion>> region =
        RequestRegion::Create(client, SlabBytes(*context.spec, *context.shape),
                              std::max(1, context.spec->stream_inflight), context.call,
                              context.spec->shared_memory, context.spec->cuda_device);
    if (region.ok()) {
      region_ = *std::move(region);
    } else {
      std::fprintf(stderr, "indexer-bench: a worker sends inline: %s\n",
                   region.status().ToString().c_str());
    }
  }
}

SimulatedScheduler::~SimulatedScheduler() = default;

std::unique_ptr<SimulatedScheduler::Slot> SimulatedScheduler::StartSequence(
    const SequencePlan& plan) {
  const WorkloadSpec& spec = *ctx_.spec;
  const ServerShape& shape = *ctx_.shape;
  auto slot = std::make_unique<Slot>();
  slot->plan = plan;
  slot->steps_done = plan.start_step;
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
    request.set_num_tokens(static_cast<uint32_t>(n));
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
    Note(CodeOf(r.status()), std::string(r.status().message()));
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

void SimulatedScheduler::Note(int code, const std::string& message) {
  last_code_ = code;
  last_message_ = message;
}

SimulatedScheduler::RefillState SimulatedScheduler::Refill() {
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr && slot->finished) {
      Release(*slot);
      slot.reset();
    }
  }
  RefillState state;
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr) continue;
    SequenceSource::Offer offer = ctx_.source->Next();
    if (!offer.plan) {
      state.source_done = offer.done;
      state.next_arrival = offer.next_arrival;
      break;
    }
    if (offer.admission_wait_ns >= 0) ctx_.recorder->RecordAdmission(offer.admission_wait_ns);
    slot = StartSequence(*offer.plan);
    if (slot == nullptr) break;  // the server refused a prefill: try again next time
  }
  for (const std::unique_ptr<Slot>& slot : slots_) state.live += slot != nullptr ? 1 : 0;
  // A full batch has not asked the source: more may come.
  if (state.live > 0) state.source_done = false;
  return state;
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
  item.set_num_tokens(static_cast<uint32_t>(n));
  item.set_topk(static_cast<uint32_t>(spec.topk));
  if (spec.init_blocks >= 0) item.set_init_blocks(static_cast<uint32_t>(spec.init_blocks));
  if (spec.local_blocks >= 0) item.set_local_blocks(static_cast<uint32_t>(spec.local_blocks));
  if (pending->with_append) {
    pending->keys = ctx_.pool->Take(static_cast<size_t>(n) * shape.layers * shape.head_dim, rng_);
    v1::AppendKeysRequest* append = item.mutable_append();
    append->set_all_layers(true);
    append->set_dtype(spec.wire_dtype);
    append->set_keys(PackSlice(pending->keys, spec.wire_dtype));
    append->set_num_tokens(static_cast<uint32_t>(n));
    if (spec.attention_pages) {
      for (int64_t b = BlocksFor(slot.length); b < BlocksFor(slot.length + n); ++b) {
        pending->new_attn.push_back(
            static_cast<int32_t>(ctx_.attention_pages->fetch_add(1) % kAttentionPageWrap));
        append->add_attention_pages(pending->new_attn.back());
      }
    }
  }
  if (region_ != nullptr) ByReference(&item, pending);
  return item;
}

void SimulatedScheduler::ByReference(v1::SelectBlocksRequest* item, PendingItem* pending) {
  const int64_t rows = int64_t{pending->n} * ctx_.spec->heads;
  const int64_t ids = rows * ctx_.spec->topk;
  std::optional<v1::RegionRef> queries = region_->Put(item->queries());
  std::optional<v1::RegionRef> keys;
  if (item->has_append()) keys = region_->Put(item->append().keys());
  std::optional<v1::RegionRef> block_ids = region_->Room(static_cast<size_t>(ids));
  std::optional<v1::RegionRef> table, lens;
  if (ctx_.spec->attention_pages || region_->on_gpu()) {
    table = region_->Room(static_cast<size_t>(ids * ctx_.shape->page_table.pages_per_block));
    lens = region_->Room(static_cast<size_t>(rows));
  }
  if (!queries || (item->has_append() && !keys) || !block_ids ||
      ((ctx_.spec->attention_pages || region_->on_gpu()) && (!table || !lens))) {
    return;  // SlabBytes bounds every request: not reached
  }
  *item->mutable_queries_ref() = *queries;
  item->clear_queries();
  if (keys) {
    *item->mutable_append()->mutable_keys_ref() = *keys;
    item->mutable_append()->clear_keys();
  }
  v1::SelectOutputRefs* outputs = item->mutable_output_refs();
  *outputs->mutable_block_ids() = *block_ids;
  pending->outputs.block_ids = region_->At(*block_ids);
  if (table) {
    *outputs->mutable_page_table() = *table;
    *outputs->mutable_context_lens() = *lens;
    pending->outputs.page_table = region_->At(*table);
    pending->outputs.context_lens = region_->At(*lens);
  }
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
    absl::StatusOr<client::Selection> got = client::ParseSelection(result.result(), item.outputs);
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

bool SimulatedScheduler::DecodeUnary(DecodeRecord& record) {
  const WorkloadSpec& spec = *ctx_.spec;
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
  if (slot == nullptr || slot->finished) return false;
  if (region_ != nullptr) region_->Begin(0);  // one call at a time
  PendingItem item;
  const v1::SelectBlocksRequest request =
      MakeItem(*slot, static_cast<int>(cursor_slot_), cursor_layer_, &item);
  SyncRegion(/*upload=*/true, 0);
  record.sent = Clock::now();
  absl::StatusOr<v1::SelectBlocksResponse> r = client_.SelectBlocks(request, ctx_.call);
  record.done = Clock::now();
  SyncRegion(/*upload=*/false, 0);
  v1::BatchItemResult result;
  result.set_code(CodeOf(r.status()));
  if (r.ok()) *result.mutable_result() = std::move(*r);
  record.code = Apply(item, result, &record.selections, &record.tokens);
  record.items = 1;
  record.item_codes[record.code] = 1;
  if (record.code != 0) record.message = std::string(r.status().message());
  ctx_.recorder->RecordDecode(record);
  Note(record.code, record.message);
  if (record.code != 0 && item.with_append) return true;  // the step's append failed: retry it
  if (++cursor_layer_ >= spec.layers) {
    if (slot->appended_this_step) FinishStep(*slot);
    cursor_layer_ = 0;
    cursor_slot_ = (cursor_slot_ + 1) % slots_.size();
  }
  return true;
}

std::vector<SimulatedScheduler::PendingItem> SimulatedScheduler::BuildStep(
    int group, v1::BatchRequest* request) {
  const WorkloadSpec& spec = *ctx_.spec;
  request->set_request_id(++request_id_);
  if (region_ != nullptr) region_->Begin(std::max(group, 0));  // a group's slab is free again
  std::vector<PendingItem> items;
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s] == nullptr || slots_[s]->finished) continue;
    if (group >= 0 && static_cast<int>(s) % spec.stream_inflight != group) continue;
    for (int layer = 0; layer < spec.layers; ++layer) {
      items.emplace_back();
      *request->add_items() = MakeItem(*slots_[s], static_cast<int>(s), layer, &items.back());
    }
  }
  return items;
}

void SimulatedScheduler::CompleteStep(std::vector<PendingItem>& items,
                                      const v1::BatchResponse& response, DecodeRecord& record) {
  record.items = static_cast<int64_t>(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const v1::BatchItemResult& result = response.results(static_cast<int>(i));
    const int code = Apply(items[i], result, &record.selections, &record.tokens);
    ++record.item_codes[code];
    if (code != 0 && record.code == 0) {
      record.code = code;
      record.message = result.message();
    }
  }
  ctx_.recorder->RecordDecode(record);
  Note(record.code, record.message);
  for (const PendingItem& item : items) {
    Slot* slot = slots_[item.slot].get();
    if (item.with_append && slot != nullptr && slot->appended_this_step) FinishStep(*slot);
  }
}

bool SimulatedScheduler::Decode(Clock::time_point intended, bool measured, bool open_loop) {
  if (pipeline_ != nullptr) return DecodePipelined(intended, measured, open_loop);
  DecodeRecord record;
  record.intended = intended;
  record.measured = measured;
  record.open_loop = open_loop;
  if (ctx_.spec->style == CallStyle::kUnary) return DecodeUnary(record);

  // Batch and stream: the whole step of every live sequence in one request.
  v1::BatchRequest request;
  std::vector<PendingItem> items = BuildStep(-1, &request);
  if (items.empty()) return false;
  SyncRegion(/*upload=*/true, 0);
  record.sent = Clock::now();
  v1::BatchResponse response;
  if (ctx_.spec->style == CallStyle::kStream) {
    if (stream_ == nullptr) stream_ = client_.OpenBatchStream();
    response = stream_->Step(request);
  } else {
    response = client_.Batch(request, ctx_.call);
  }
  record.done = Clock::now();
  SyncRegion(/*upload=*/false, 0);
  CompleteStep(items, response, record);
  return true;
}

bool SimulatedScheduler::DecodePipelined(Clock::time_point intended, bool measured,
                                         bool open_loop) {
  const int groups = ctx_.spec->stream_inflight;
  const auto has_work = [&](int g) {
    for (size_t s = static_cast<size_t>(g); s < slots_.size(); s += static_cast<size_t>(groups)) {
      if (slots_[s] != nullptr && !slots_[s]->finished) return true;
    }
    return false;
  };
  int group = -1;
  while (group < 0) {
    for (int k = 0; k < groups && group < 0; ++k) {
      const int g = (next_group_ + k) % groups;
      if (!group_busy_[static_cast<size_t>(g)] && has_work(g)) group = g;
    }
    if (group >= 0) break;
    if (in_flight_.empty()) return false;
    CompleteOldest();  // every micro-batch with work is in flight: its answer frees one
  }
  InFlight& f = in_flight_.emplace_back();
  f.group = group;
  f.record.intended = open_loop ? intended : Clock::now();
  f.record.measured = measured;
  f.record.open_loop = open_loop;
  v1::BatchRequest request;
  f.items = BuildStep(group, &request);
  SyncRegion(/*upload=*/true, group);
  f.record.sent = Clock::now();
  pipeline_->Send(request);
  group_busy_[static_cast<size_t>(group)] = true;
  next_group_ = (group + 1) % groups;
  return true;
}

void SimulatedScheduler::CompleteOldest() {
  PipelinedStream::Answer answer = pipeline_->Next();
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  f.record.done = answer.done;
  group_busy_[static_cast<size_t>(f.group)] = false;
  SyncRegion(/*upload=*/false, f.group);
  CompleteStep(f.items, answer.response, f.record);
}

void SimulatedScheduler::SyncRegion(bool upload, int slab) {
  if (region_ == nullptr || !region_->on_gpu()) return;
  if (!upload && !ctx_.check) return;  // only the checker reads the outputs
  const absl::Status synced = upload ? region_->Flush() : region_->Fetch(slab);
  if (!synced.ok()) {
    std::fprintf(stderr, "indexer-bench: the worker's CUDA region: %s\n",
                 synced.ToString().c_str());
  }
}

void SimulatedScheduler::Drain() {
  while (!in_flight_.empty()) CompleteOldest();
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot != nullptr) Release(*slot);
    slot.reset();
  }
  // Failures were counted per request already.
  if (stream_ != nullptr) {
    stream_->Finish().IgnoreError();
    stream_.reset();
  }
  if (pipeline_ != nullptr) pipeline_->Finish(ctx_.call.timeout.value_or(absl::Seconds(30))).IgnoreError();
}

}  // namespace indexer::bench
