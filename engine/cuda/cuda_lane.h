// Lane and LanePool: the CUDA backend's units of concurrency. A lane is one stream with its own
// pinned and device staging, score scratch, decode counters, graph cache and step staging, held
// by one step (or one synchronous transfer) at a time; the pool hands lanes out.
//
// A lane also has a completion thread. A step staged and launched on the lane is handed to it
// (Lane::Complete) and the launching thread returns at once; the completion thread waits for the
// stream and runs the step's finish, which releases the lane. The thread spins for a moment
// before it sleeps, so a lane in steady use sees its completion without a thread wake-up.
// Internal to engine/cuda.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "engine/cuda/cuda_errors.h"
#include "engine/cuda/cuda_resources.h"
#include "engine/cuda/select_graph.h"
#include "kernels/cuda/step_staging.h"

namespace indexer::engine {

class Lane {
 public:
  // What the completion thread runs once the stream is idle, with the stream's status. It owns
  // the lane until it releases it to its pool.
  using Finish = absl::AnyInvocable<void(absl::Status synced) &&>;

  // `device`: the CUDA device of the lane's stream, current on the completion thread.
  Lane(int device, int graphs_capacity);
  ~Lane();  // stops and joins the completion thread (no step may be pending)
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  absl::Status Create(int stream_priority) { return stream.Create(stream_priority); }

  // Buffer::Reserve, counting reallocations: graphs hold the buffers' addresses.
  template <typename Buffer>
  absl::Status Reserve(Buffer& buffer, size_t bytes) {
    const void* before = buffer.get();
    const size_t before_bytes = buffer.bytes();
    const absl::Status status = buffer.Reserve(bytes);
    if (buffer.get() != before || buffer.bytes() != before_bytes) ++generation;
    return status;
  }

  // Waits for the stream; on failure also clears state a broken launch may have left behind
  // (not after a sticky error: the device is lost, and the backend will not touch it again).
  absl::Status Sync(const char* what);

  // Hands the work enqueued on the stream to the completion thread: it syncs the stream and runs
  // `finish` with the result, on its own thread. The caller must hold the lane and hands it, by
  // this call, to `finish`.
  void Complete(Finish finish);

  CudaStream stream;
  PinnedBuffer h_in, h_out;
  DeviceBuffer d_in, d_out, d_scores, d_counters;
  SelectGraphCache graphs;
  kernels::cuda::StepStaging staging;
  std::vector<kernels::cuda::StagedSpan> spans;
  // The step being staged: its writes, its page-table shape, and per span the queries' range
  // (host queries) and the layer.
  std::span<const kernels::KeyWrite> staged_writes;
  kernels::PageTableParams page_table;
  std::vector<kernels::cuda::Bf16Range> query_ranges;
  std::vector<int> span_layers;
  uint64_t generation = 0;         // bumped whenever a buffer above is reallocated
  uint64_t graphs_generation = 0;  // the generation the cached graphs were built on
  int graph_failures = 0;

 private:
  void CompletionLoop();

  const int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  Finish pending_;                     // guarded by mu_
  std::atomic<bool> has_pending_{false};
  bool stopping_ = false;              // guarded by mu_
  std::thread completion_;
};

// A fixed set of lanes, each held by one caller at a time.
class LanePool {
 public:
  ~LanePool() { Clear(); }

  absl::Status Add(int device, int graphs_capacity, int stream_priority);
  // Destroys every lane (their completion threads first). No lane may be held.
  void Clear() { lanes_.clear(); }
  int size() const { return static_cast<int>(lanes_.size()); }

  // Waits while every lane is busy; the most recently released lane first (a lone caller keeps
  // one lane, whose graphs stay warm).
  Lane* Acquire();
  void Release(Lane* lane);
  int peak_busy() const { return peak_busy_.load(std::memory_order_relaxed); }

 private:
  std::vector<std::unique_ptr<Lane>> lanes_;  // fixed after Init
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Lane*> free_;  // guarded by mu_
  int busy_ = 0;             // guarded by mu_
  std::atomic<int> peak_busy_{0};
};

// Holds one lane of a pool for a scope (synchronous work: page copies and transfers).
class LaneLease {
 public:
  explicit LaneLease(LanePool& pool) : pool_(pool), lane_(pool.Acquire()) {}
  ~LaneLease() { pool_.Release(lane_); }
  LaneLease(const LaneLease&) = delete;
  LaneLease& operator=(const LaneLease&) = delete;
  Lane& lane() const { return *lane_; }

 private:
  LanePool& pool_;
  Lane* lane_;
};

}  // namespace indexer::engine
