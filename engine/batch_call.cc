#include "engine/batch_call.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace indexer::engine {

void BatchCall::Start(EngineCore& core, CallGate& gate, std::span<const StepRequest> items,
                      const CallControl& control, OutputSink* sink, EngineObserver* observer,
                      BatchDone done) {
  auto* call = new BatchCall(core, gate, items, control, sink, observer, std::move(done));
  if (call->Prepare()) call->RunWaves();
}

BatchCall::BatchCall(EngineCore& core, CallGate& gate, std::span<const StepRequest> items,
                     const CallControl& control, OutputSink* sink, EngineObserver* observer,
                     BatchDone done)
    : pass_(gate),
      core_(core),
      items_(items),
      control_(control),
      sink_(sink),
      observer_(observer),
      done_(std::move(done)),
      budget_(core.config.max_response_bytes) {}

bool BatchCall::Prepare() {
  const absl::Time start = absl::Now();
  const EngineConfig& config = core_.config;
  results_.assign(items_.size(), absl::InternalError("step was not run"));
  if (static_cast<int64_t>(items_.size()) > config.max_batch_items) {
    const absl::Status too_many = absl::InvalidArgumentError(absl::StrCat(
        "the batch has ", items_.size(), " items; max_batch_items is ", config.max_batch_items));
    for (auto& r : results_) r = too_many;
    Finish(absl::OkStatus());
    return false;
  }
  steps_.resize(items_.size());
  ready_.reserve(items_.size());
  int64_t reserved = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    steps_[i].index = i;
    const absl::Status status = PrepareStep(config, items_[i], &steps_[i]);
    if (status.ok()) {
      ready_.push_back(&steps_[i]);
      reserved += LateErrorReservation(items_[i].sequence_id);
    } else {
      results_[i] = status;
      reserved += ErrorAnswerBytes(status);
    }
  }
  phases_.validate = absl::Now() - start;
  if (!budget_.Take(reserved)) {
    Finish(absl::ResourceExhaustedError(absl::StrCat(
        "the answer to these ", items_.size(), " items could take ", reserved,
        " bytes even if every item failed, more than max_response_bytes ", budget_.limit(),
        "; send fewer items per call")));
    return false;
  }
  return true;
}

void BatchCall::RunWaves() {
  while (next_ < ready_.size()) {
    const absl::Time forming = absl::Now();
    if (const absl::Status late = control_.Check(); !late.ok()) {
      for (size_t i = next_; i < ready_.size(); ++i) results_[ready_[i]->index] = late;
      break;
    }
    size_t end = next_ + 1;  // a lone item is a wave of its own
    if (ready_.size() - next_ > 1) {
      absl::flat_hash_set<std::pair<absl::string_view, absl::string_view>> ids;
      ids.reserve(ready_.size() - next_);
      end = next_;
      while (end < ready_.size() &&
             ids.insert({ready_[end]->tenant, ready_[end]->sequence_id}).second) {
        ++end;
      }
    }
    const std::span<PreparedStep* const> steps(ready_.data() + next_, end - next_);
    next_ = end;
    wave_ = std::make_unique<Wave>(core_, steps,
                                   CallContext{results_, budget_, control_, sink_, phases_},
                                   [this] { OnWaveDone(); });
    phases_.wave += absl::Now() - forming;
    wave_state_.store(kStarting, std::memory_order_release);
    wave_->Start();
    if (wave_state_.exchange(kIdle, std::memory_order_acq_rel) != kEnded) return;
    // The wave ended while it started: run the next one here.
  }
  Finish(absl::OkStatus());
}

void BatchCall::OnWaveDone() {
  // Ended while its starter is still in Start: the starter runs the next wave.
  if (wave_state_.exchange(kEnded, std::memory_order_acq_rel) == kStarting) return;
  RunWaves();
}

void BatchCall::Finish(absl::Status call) {
  if (!call.ok()) {
    for (auto& r : results_) r = call;
  }
  if (observer_ != nullptr) observer_->OnCallPhases(phases_);
  BatchDone done = std::move(done_);
  std::vector<absl::StatusOr<StepResult>> results = std::move(results_);
  // The call's pass and state go before its answer, so that a snapshot or shutdown waiting on
  // the engine's calls never sees this one after its caller was answered.
  delete this;
  std::move(done)(std::move(call), std::move(results));
}

}  // namespace indexer::engine
