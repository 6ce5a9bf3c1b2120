// PipelinedStream: several BatchRequests in flight at once over one BatchStream per server, as a
// scheduler running two or more micro-batches keeps them (indexer-bench --stream_inflight). A
// request is split by server (the ShardedClient's ring) and each part written at once; a reader
// thread per server stream takes the answers as they arrive, stamps their arrival time, and
// checks that they come in the order their requests were sent and carry their request_id. The
// caller takes the answers back oldest first, merged in item order.
//
// Failures never throw or block the others: a part whose stream broke carries the stream's final
// status in each of its items (the next request to that server opens a new stream), and an answer
// with the wrong request_id (out of order, or unknown) fails the part it was taken for with
// INTERNAL, its message saying which id came for which.
//
// Threads: Send, Next, Finish and the destructor belong to one thread (the worker); each server
// stream also has its reader thread, owned here.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/bench/pacer.h"
#include "client/cpp/sharded_client.h"

namespace indexer::bench {

class PipelinedStream {
 public:
  explicit PipelinedStream(client::ShardedClient& client);
  ~PipelinedStream();  // cancels every open stream and joins its reader
  PipelinedStream(const PipelinedStream&) = delete;
  PipelinedStream& operator=(const PipelinedStream&) = delete;

  // Writes `request`'s parts to their servers' streams (opened when needed) and returns; the
  // answer comes back through Next(). Request ids should differ between requests in flight.
  void Send(const v1::BatchRequest& request);

  struct Answer {
    v1::BatchResponse response;  // one result per item of the request, in item order
    Clock::time_point done;      // when its last part arrived
  };
  // The oldest request's answer; blocks until every part of it arrived or failed. Call only with
  // in_flight() > 0.
  Answer Next();
  size_t in_flight() const;
  // Answers received whose request_id did not match the request they were taken for.
  int64_t out_of_order() const;

  // Half-closes every stream, waits up to `timeout` for each server to end it (then cancels),
  // and returns the first failed final status. Unanswered requests are dropped.
  absl::Status Finish(absl::Duration timeout);

 private:
  // What a server's stream owes: the part of request `seq` it was sent.
  struct Part {
    uint64_t seq = 0;
    uint64_t request_id = 0;
    std::vector<int> items;  // the request's item indices, in the part's order
  };
  struct Lane {
    std::unique_ptr<client::BatchStream> stream;
    std::thread reader;
    bool reader_done = false;  // Read returned false: the stream ended or broke
    std::deque<Part> expected;
  };
  struct Pending {
    v1::BatchResponse merged;
    int parts_left = 0;
    Clock::time_point done;
  };

  void Open(size_t server);
  void ReadLoop(size_t server);
  // Lane `server` broke: joins its reader, finishes the stream and fails what it still owed.
  // Called with `lock` held; releases it while joining.
  void Settle(size_t server, std::unique_lock<std::mutex>& lock);
  // Fills a part's items of its request with `status` (caller holds mu_).
  void FailPart(const Part& part, const absl::Status& status);
  Pending& PendingOf(uint64_t seq) { return pending_[seq - first_seq_]; }

  client::ShardedClient& client_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Lane> lanes_;     // per server
  std::deque<Pending> pending_;  // requests in flight, oldest first; seq first_seq_ + index
  uint64_t first_seq_ = 0;
  uint64_t next_seq_ = 0;
  int64_t out_of_order_ = 0;
};

}  // namespace indexer::bench
