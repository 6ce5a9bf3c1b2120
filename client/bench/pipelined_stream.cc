#include "client/bench/pipelined_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace indexer::bench {

using client::SplitByServer;
using client::SubRequest;

PipelinedStream::PipelinedStream(client::ShardedClient& client)
    : client_(client), lanes_(client.size()) {}

PipelinedStream::~PipelinedStream() {
  for (Lane& lane : lanes_) {
    if (lane.stream == nullptr) continue;
    lane.stream->Cancel();
    if (lane.reader.joinable()) lane.reader.join();
    lane.stream->Finish().IgnoreError();
  }
}

size_t PipelinedStream::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

int64_t PipelinedStream::out_of_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  return out_of_order_;
}

void PipelinedStream::Open(size_t server) {
  Lane& lane = lanes_[server];
  lane.stream = client_.client(server).OpenBatchStream();
  lane.reader_done = false;
  lane.reader = std::thread(&PipelinedStream::ReadLoop, this, server);
}

void PipelinedStream::Send(const v1::BatchRequest& request) {
  const std::vector<std::vector<int>> parts = SplitByServer(client_, request);
  int nonempty = 0;
  for (const auto& p : parts) nonempty += p.empty() ? 0 : 1;
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t seq = next_seq_++;
  Pending& pending = pending_.emplace_back();
  pending.merged.set_request_id(request.request_id());
  for (int i = 0; i < request.items_size(); ++i) pending.merged.add_results();
  pending.parts_left = nonempty;
  if (nonempty == 0) pending.done = Clock::now();
  for (size_t s = 0; s < parts.size(); ++s) {
    if (parts[s].empty()) continue;
    Lane& lane = lanes_[s];
    if (lane.stream != nullptr && lane.reader_done) Settle(s, lock);
    if (lane.stream == nullptr) Open(s);
    lane.expected.push_back(Part{seq, request.request_id(), parts[s]});
    client::BatchStream* stream = lane.stream.get();
    lock.unlock();
    // A failed write ends the call, so the reader's Read ends too and Next() settles the lane.
    const bool whole = static_cast<int>(parts[s].size()) == request.items_size();
    stream->Write(whole ? request : SubRequest(request, parts[s]));
    lock.lock();
  }
}

void PipelinedStream::ReadLoop(size_t server) {
  client::BatchStream* stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream = lanes_[server].stream.get();
  }
  const std::string& target = client_.targets()[server];
  v1::BatchResponse answer;
  while (stream->Read(&answer)) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    Lane& lane = lanes_[server];
    if (lane.expected.empty()) {
      ++out_of_order_;  // an answer to no request in flight
      continue;
    }
    const Part part = std::move(lane.expected.front());
    lane.expected.pop_front();
    Pending& pending = PendingOf(part.seq);
    if (answer.request_id() != part.request_id) {
      ++out_of_order_;
      FailPart(part, absl::InternalError(absl::StrCat(
                         target, ": the answer for request ", answer.request_id(),
                         " came while request ", part.request_id,
                         " was the oldest unanswered one on the stream (answers out of order)")));
    } else if (answer.results_size() != static_cast<int>(part.items.size())) {
      FailPart(part, absl::InternalError(absl::StrCat(target, " answered ", answer.results_size(),
                                                      " results for ", part.items.size(),
                                                      " items")));
    } else {
      for (size_t k = 0; k < part.items.size(); ++k) {
        *pending.merged.mutable_results(part.items[k]) =
            std::move(*answer.mutable_results(static_cast<int>(k)));
      }
    }
    if (--pending.parts_left == 0) {
      pending.done = now;
      cv_.notify_all();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  lanes_[server].reader_done = true;
  cv_.notify_all();
}

void PipelinedStream::FailPart(const Part& part, const absl::Status& status) {
  Pending& pending = PendingOf(part.seq);
  for (int i : part.items) {
    v1::BatchItemResult* r = pending.merged.mutable_results(i);
    r->Clear();
    r->set_code(static_cast<int>(status.code()));
    r->set_message(std::string(status.message()));
  }
}

void PipelinedStream::Settle(size_t server, std::unique_lock<std::mutex>& lock) {
  Lane& lane = lanes_[server];
  std::thread reader = std::move(lane.reader);
  std::unique_ptr<client::BatchStream> stream = std::move(lane.stream);
  lock.unlock();
  if (reader.joinable()) reader.join();
  absl::Status status = stream->Finish();
  stream.reset();
  lock.lock();
  if (status.ok()) status = absl::UnavailableError("the stream ended before answering");
  status = absl::Status(status.code(),
                        absl::StrCat(client_.targets()[server], ": ", status.message()));
  const Clock::time_point now = Clock::now();
  for (const Part& part : lane.expected) {
    FailPart(part, status);
    Pending& pending = PendingOf(part.seq);
    if (--pending.parts_left == 0) pending.done = now;
  }
  lane.expected.clear();
  lane.reader_done = false;
}

PipelinedStream::Answer PipelinedStream::Next() {
  std::unique_lock<std::mutex> lock(mu_);
  while (pending_.front().parts_left > 0) {
    bool settled = false;
    for (size_t s = 0; s < lanes_.size() && !settled; ++s) {
      const Lane& lane = lanes_[s];
      if (lane.stream != nullptr && lane.reader_done && !lane.expected.empty()) {
        Settle(s, lock);
        settled = true;
      }
    }
    if (!settled) cv_.wait(lock);
  }
  Answer answer{std::move(pending_.front().merged), pending_.front().done};
  pending_.pop_front();
  ++first_seq_;
  return answer;
}

absl::Status PipelinedStream::Finish(absl::Duration timeout) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(timeout));
  for (Lane& lane : lanes_) {
    if (lane.stream != nullptr) lane.stream->WritesDone();
  }
  absl::Status first;
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t s = 0; s < lanes_.size(); ++s) {
    Lane& lane = lanes_[s];
    if (lane.stream == nullptr) continue;
    if (!cv_.wait_until(lock, deadline, [&] { return lane.reader_done; })) lane.stream->Cancel();
    std::thread reader = std::move(lane.reader);
    std::unique_ptr<client::BatchStream> stream = std::move(lane.stream);
    lock.unlock();
    if (reader.joinable()) reader.join();
    absl::Status status = stream->Finish();
    lock.lock();
    if (first.ok() && !status.ok()) {
      first = absl::Status(status.code(), absl::StrCat(client_.targets()[s], ": ", status.message()));
    }
    lane.expected.clear();
    lane.reader_done = false;
  }
  first_seq_ += pending_.size();
  pending_.clear();
  return first;
}

}  // namespace indexer::bench
