#include "server/batch_stream.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/authenticated_call.h"
#include "server/indexer_service.h"
#include "server/status_convert.h"

namespace indexer::server {

BatchStreamReactor::BatchStreamReactor(IndexerService* service, grpc::CallbackServerContext* ctx,
                                       absl::StatusOr<Caller> caller)
    : service_(service), ctx_(ctx) {
  // Counted until OnDone, so that shutdown waits for the stream's last answer and its status to
  // be sent. A stream opened once shutdown has begun is not admitted, and ends at once.
  tracked_ = service_->tracker_ != nullptr && service_->tracker_->Admit();
  service_->Register(this);  // may Stop() this stream at once when shutting down
  if (service_->tracker_ != nullptr && !tracked_) Stop();
  std::lock_guard<std::mutex> lock(mu_);
  if (!caller.ok()) {
    FinishLocked(ToGrpcStatus(caller.status()));
    return;
  }
  caller_ = *std::move(caller);
  ReadNextLocked();
}

void BatchStreamReactor::ReadNextLocked() {
  if (reading_ || reads_ended_ || stopping_ || finished_ || !end_.ok() ||
      static_cast<int>(slots_.size()) >= kMaxInFlight) {
    return;
  }
  reading_ = true;
  StartRead(&request_);
}

void BatchStreamReactor::OnReadDone(bool ok) {
  StartList start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (finished_) return;  // stopped while the read was pending: nothing is applied
    if (!ok || stopping_) {  // the client finished sending (or the call ended), or shutdown
      reads_ended_ = true;
      MaybeFinishLocked();
      return;
    }
    ++requests_read_;
    auto slot = std::make_unique<Slot>();
    absl::StatusOr<std::unique_ptr<StepCall>> call =
        StepCall::Parse(StepRpc::kBatchStream, service_->StepServices(), caller_, ctx_, request_,
                        &slot->answer);
    if (!call.ok()) {
      // The proto promises one answer per request; a request that does not parse has none, so
      // the stream ends with why, once the requests before it are answered.
      end_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("BatchStream request ", requests_read_, ": ",
                                       call.status().message(),
                                       "; the requests before it are answered, it is not applied"));
      reads_ended_ = true;
      StepCall::RecordRefused(service_->metrics_, StepRpc::kBatchStream, end_, absl::Now());
      MaybeFinishLocked();
      return;
    }
    slot->call = *std::move(call);
    Slot* raw = slot.get();
    slots_.push_back(std::move(slot));
    if (!WaitsForEarlierLocked(*raw)) {
      raw->started = true;
      start.push_back(raw);
    }
    // Starting a read costs gRPC several microseconds: a request that can run starts first, and
    // the next read is started after it (the call's own end starts it if that comes first).
    if (start.empty()) ReadNextLocked();
  }
  if (start.empty()) return;
  StartCalls(start);
  // Still inside this reaction, so gRPC has not called OnDone: the reactor is alive, and
  // ReadNextLocked reads nothing once the stream is finished or its reads have ended.
  std::lock_guard<std::mutex> lock(mu_);
  ReadNextLocked();
}

bool BatchStreamReactor::WaitsForEarlierLocked(const Slot& slot) const {
  // Only a stream with another request unanswered pays for the comparison. The stream has one
  // tenant, so sequence ids alone tell.
  absl::flat_hash_set<absl::string_view> ids;
  for (const std::unique_ptr<Slot>& earlier : slots_) {
    if (earlier.get() == &slot) break;
    if (earlier->done) continue;
    if (ids.empty()) {
      for (const engine::StepRequest& item : slot.call->items()) ids.insert(item.sequence_id);
    }
    for (const engine::StepRequest& item : earlier->call->items()) {
      if (ids.contains(item.sequence_id)) return true;
    }
  }
  return false;
}

void BatchStreamReactor::StartWaitingLocked(StartList* start) {
  if (stopping_ || !end_.ok()) return;
  for (const std::unique_ptr<Slot>& slot : slots_) {
    if (slot->started || WaitsForEarlierLocked(*slot)) continue;
    slot->started = true;
    start->push_back(slot.get());
  }
}

void BatchStreamReactor::StartCalls(const StartList& start) {
  for (Slot* slot : start) {
    slot->call->Run([this, slot](grpc::Status status) { OnCallDone(slot, std::move(status)); });
  }
}

void BatchStreamReactor::OnCallDone(Slot* slot, grpc::Status status) {
  StartList start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot->done = true;
    slot->status = std::move(status);
    StartWaitingLocked(&start);
    WriteNextLocked();
    ReadNextLocked();
    MaybeFinishLocked();
  }
  if (!start.empty()) StartCalls(start);
}

void BatchStreamReactor::WriteNextLocked() {
  if (writing_ || finished_ || slots_.empty() || !slots_.front()->done) return;
  Slot& head = *slots_.front();
  if (!head.status.ok()) {
    // The request failed whole (its answer could not fit max_message_bytes): it has no answer,
    // so the stream ends with its status.
    if (end_.ok()) end_ = head.status;
    reads_ended_ = true;
    return;
  }
  writing_ = true;
  StartWrite(&head.answer);
}

void BatchStreamReactor::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  writing_ = false;
  slots_.pop_front();
  if (!ok) {
    if (end_.ok()) {
      end_ = grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed while writing");
    }
    reads_ended_ = true;
  } else {
    WriteNextLocked();
    ReadNextLocked();
  }
  MaybeFinishLocked();
}

void BatchStreamReactor::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopping_ = true;
  // Requests read but not started are dropped unapplied; the client sees UNAVAILABLE.
  slots_.erase(std::remove_if(slots_.begin(), slots_.end(),
                              [](const std::unique_ptr<Slot>& s) { return !s->started; }),
               slots_.end());
  MaybeFinishLocked();
}

bool BatchStreamReactor::RunningLocked() const {
  return std::any_of(slots_.begin(), slots_.end(),
                     [](const std::unique_ptr<Slot>& s) { return s->started && !s->done; });
}

void BatchStreamReactor::MaybeFinishLocked() {
  if (finished_ || !(reads_ended_ || stopping_ || !end_.ok())) return;
  // Calls still running point into this reactor; an answer being written must complete.
  if (writing_ || RunningLocked()) return;
  WriteNextLocked();  // answers ready in order go out first
  if (writing_) return;
  const bool answered_all = slots_.empty() || !end_.ok() || stopping_ ||
                            std::none_of(slots_.begin(), slots_.end(),
                                         [](const std::unique_ptr<Slot>& s) { return !s->started; });
  if (!answered_all) return;  // requests waiting for earlier ones start when those end
  if (!end_.ok()) return FinishLocked(end_);
  FinishLocked(stopping_ ? ShuttingDownStatus() : grpc::Status::OK);
}

void BatchStreamReactor::FinishLocked(const grpc::Status& status) {
  if (finished_) return;
  finished_ = true;
  Finish(status);
}

void BatchStreamReactor::OnDone() {
  service_->Unregister(this);
  if (tracked_) service_->tracker_->Done();
  delete this;
}

}  // namespace indexer::server
