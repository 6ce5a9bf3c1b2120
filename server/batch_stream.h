// BatchStreamReactor: one BatchStream call. A scheduler may keep several requests in flight on
// one stream (say two micro-batches); the reactor answers each with one BatchResponse, in
// request order.
//
// It reads while fewer than kMaxInFlight requests are unanswered, starting the next read after
// the request just read has started (a read's start costs gRPC microseconds that a step waiting
// for the device can cover). Each request runs at once as a StepCall, unless it names a
// sequence that an earlier unanswered request of the stream names: then it waits until those
// have ended, so a stream's requests on one sequence apply in the order they were sent. Answers
// are written one at a time, in order, each as soon as it and every earlier one are done.
//
// It ends the stream with OK once the client has finished sending and every answer is written;
// with INVALID_ARGUMENT when a request does not parse (after answering the requests before it:
// the one that failed and any after it are not applied); with the status of a request that
// failed whole; with UNAVAILABLE when the server shuts down (Stop: answers in progress are
// written first, requests not yet started are dropped unapplied). Deletes itself in OnDone.
#pragma once

#include <grpcpp/grpcpp.h>

#include <deque>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/access_control.h"
#include "server/step_call.h"

namespace indexer::server {

class IndexerService;

class BatchStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Requests a stream may have unanswered at once; it stops reading until one is answered.
  static constexpr int kMaxInFlight = 8;

  // `caller`: the stream's authenticated caller, or why it was refused (the stream then ends at
  // once with that status).
  BatchStreamReactor(IndexerService* service, grpc::CallbackServerContext* ctx,
                     absl::StatusOr<Caller> caller);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

  // Ends the stream for shutdown: at once when nothing is in flight, else once the requests
  // already running are answered.
  void Stop();

 private:
  // One request, from its read to its answer's write.
  struct Slot {
    std::unique_ptr<StepCall> call;
    grpc::ByteBuffer answer;
    bool started = false;
    bool done = false;
    grpc::Status status;
  };

  // Whether `slot` names a sequence that an earlier unanswered, unfinished request names.
  bool WaitsForEarlierLocked(const Slot& slot) const;
  // Calls to start, collected under the lock and started after it (a call may end inside Run).
  // Once the lock is released a reactor with no call running may be finished and deleted by
  // another thread, so StartCalls is called only with a non-empty list: those calls are running
  // and keep the reactor alive until the last one ends.
  using StartList = std::vector<Slot*>;
  void StartWaitingLocked(StartList* start);
  void StartCalls(const StartList& start);
  void OnCallDone(Slot* slot, grpc::Status status);
  void ReadNextLocked();
  void WriteNextLocked();
  void MaybeFinishLocked();
  void FinishLocked(const grpc::Status& status);
  bool RunningLocked() const;

  IndexerService* const service_;
  grpc::CallbackServerContext* const ctx_;
  Caller caller_;
  grpc::ByteBuffer request_;
  std::mutex mu_;
  std::deque<std::unique_ptr<Slot>> slots_;  // unanswered requests, in order
  int64_t requests_read_ = 0;
  bool reading_ = false;      // a read is outstanding
  bool reads_ended_ = false;  // the client finished sending, or the stream stops reading
  bool writing_ = false;      // a write is outstanding
  bool stopping_ = false;     // the server is shutting down
  bool finished_ = false;     // Finish was called
  bool tracked_ = false;      // admitted to the service's CallTracker
  grpc::Status end_;          // the stream's end status once decided (OK until then)
};

}  // namespace indexer::server
