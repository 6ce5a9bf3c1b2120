#include "engine/cuda/cuda_lane.h"

#include <chrono>
#include <utility>

namespace indexer::engine {
namespace {

// How long an idle completion thread polls for the next step before it sleeps: longer than a
// scheduler's round trip between decode steps, so a lane in steady use never needs a wake-up.
constexpr auto kSpin = std::chrono::microseconds(200);

}  // namespace

Lane::Lane(int device, int graphs_capacity)
    : graphs(static_cast<size_t>(graphs_capacity)), device_(device) {
  completion_ = std::thread([this] { CompletionLoop(); });
}

Lane::~Lane() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  completion_.join();
}

absl::Status Lane::Sync(const char* what) {
  const cudaError_t err = cudaStreamSynchronize(stream.get());
  const absl::Status status = CudaStatus(err, what);
  if (!status.ok() && !IsStickyCudaError(err) && d_counters.get() != nullptr) {
    // A failed decode launch can leave span counters set; later launches need them at zero.
    (void)cudaGetLastError();
    if (cudaMemsetAsync(d_counters.get(), 0, d_counters.bytes(), stream.get()) == cudaSuccess) {
      (void)cudaStreamSynchronize(stream.get());
    }
    (void)cudaGetLastError();
  }
  return status;
}

void Lane::Launch(Start start, Finish finish) {
  Pending step{std::move(start), std::move(finish), absl::OkStatus(), false};
  // The completion thread does not spin while it runs a finish: a finish that starts the lane's
  // next step launches it at once below, rather than after its own callbacks.
  if (spinning_.load(std::memory_order_acquire)) return Hand(std::move(step));
  step.launch = std::move(step.start)(&step.enqueued);
  step.start = nullptr;
  Hand(std::move(step));
}

void Lane::Hand(Pending step) {
  // Notified under the lock: once the step is taken its finish may release the lane, and the
  // lane may be destroyed, before a notify made after unlocking would run.
  std::lock_guard<std::mutex> lock(mu_);
  pending_ = std::move(step);
  has_pending_.store(true, std::memory_order_release);
  cv_.notify_one();
}

void Lane::CompletionLoop() {
  // The completion thread launches steps, and a finish may launch the next one here.
  (void)cudaSetDevice(device_);
  (void)cudaGetLastError();
  for (;;) {
    const auto spin_end = std::chrono::steady_clock::now() + kSpin;
    spinning_.store(true, std::memory_order_release);
    while (!has_pending_.load(std::memory_order_acquire) &&
           std::chrono::steady_clock::now() < spin_end) {
    }
    spinning_.store(false, std::memory_order_release);
    Pending step;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || has_pending_.load(std::memory_order_relaxed); });
      if (!has_pending_.load(std::memory_order_relaxed)) return;  // stopping, nothing pending
      step = std::move(pending_);
      has_pending_.store(false, std::memory_order_relaxed);
    }
    if (step.start) step.launch = std::move(step.start)(&step.enqueued);
    absl::Status result = std::move(step.launch);
    // Wait even after a failed enqueue: work already queued still reads the staging buffers.
    if (step.enqueued) {
      const absl::Status synced = Sync("step");
      if (result.ok()) result = synced;
    }
    std::move(step.finish)(std::move(result));
  }
}

absl::Status LanePool::Add(int device, int graphs_capacity, int stream_priority) {
  auto lane = std::make_unique<Lane>(device, graphs_capacity);
  if (absl::Status s = lane->Create(stream_priority); !s.ok()) return s;
  free_.push_back(lane.get());
  lanes_.push_back(std::move(lane));
  return absl::OkStatus();
}

Lane* LanePool::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  Lane* lane = free_.back();
  free_.pop_back();
  ++busy_;
  if (busy_ > peak_busy_.load(std::memory_order_relaxed)) {
    peak_busy_.store(busy_, std::memory_order_relaxed);
  }
  return lane;
}

void LanePool::Release(Lane* lane) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(lane);
    --busy_;
  }
  cv_.notify_one();
}

}  // namespace indexer::engine
