// Lane and LanePool: the CUDA backend's units of concurrency. A lane is one stream with its own
// pinned and device staging, score scratch, decode counters, graph cache and step staging, held
// by one step (or one synchronous transfer) at a time; the pool hands lanes out.
//
// A lane also has a completion thread. A step staged on the lane is handed to it (Lane::Launch)
// and the staging thread returns at once; the completion thread waits for the stream and runs
// the step's finish, which releases the lane. The thread spins for a moment before it sleeps, so
// a lane in steady use sees its next step without a thread wake-up; while it spins it also
// launches the step itself: the thread that launches and waits on every step of its stream finds
// the driver's launch path in its cache, where the thread that staged the request comes to it
// cold. A caller that finds the completion thread not spinning launches the step itself.
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
#include "absl/time/time.h"
#include "engine/cuda/cuda_errors.h"
#include "engine/cuda/cuda_resources.h"
#include "engine/cuda/select_graph.h"
#include "kernels/cuda/step_staging.h"

namespace indexer::engine {

class Lane {
 public:
  // Enqueues a step's work on the lane's stream; `*enqueued` says whether anything reached it.
  using Start = absl::AnyInvocable<absl::Status(bool* enqueued) &&>;
  // What the completion thread runs once the stream is idle: with the enqueue's failure, else
  // the stream's status. It owns the lane until it releases it to its pool.
  using Finish = absl::AnyInvocable<void(absl::Status synced) &&>;

  // `device`: the CUDA device of the lane's stream, made current on the completion thread when
  // it starts (a finish may make another current there later).
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

  // Launches a staged step and hands it to the completion thread: `start` enqueues its work (on
  // the completion thread while that one spins, else on the caller's; it must make its device
  // current, as a finish may leave another one current there), then the completion
  // thread syncs the stream and runs `finish`. The caller must hold the lane and hands it, by this
  // call, to `finish`. Work it enqueued on the stream before (staging) runs before the step's.
  void Launch(Start start, Finish finish);

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
  absl::Time launched;  // when the step's enqueue returned (set by its Start)
  uint64_t generation = 0;         // bumped whenever a buffer above is reallocated
  uint64_t graphs_generation = 0;  // the generation the cached graphs were built on
  int graph_failures = 0;

 private:
  // A step handed to the completion thread: still to launch (`start` set), or launched by its
  // caller with `launch` its enqueue's status.
  struct Pending {
    Start start;
    Finish finish;
    absl::Status launch;
    bool enqueued = false;
  };

  void Hand(Pending step);
  void CompletionLoop();

  const int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  Pending pending_;                    // guarded by mu_
  std::atomic<bool> has_pending_{false};
  std::atomic<bool> spinning_{false};  // the completion thread polls for a step
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
