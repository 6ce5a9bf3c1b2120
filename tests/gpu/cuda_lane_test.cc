// Lane::Launch (engine/cuda/cuda_lane.h): which thread launches a step, and what its finish sees.
//  - while the completion thread spins for work, it runs the step's start itself;
//  - once it sleeps, the caller runs the start, and the completion thread still finishes;
//  - a finish that launches the lane's next step runs that start at once, on its own thread;
//  - a start that fails hands its status to the finish, after what it enqueued has run;
//  - a finish runs only once the stream has done the step's work.
// Skips (with a message) where no GPU is usable.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "engine/cuda/cuda_lane.h"
#include "tests/testing/gpu_test.h"

namespace indexer::testing {
namespace {

using engine::Lane;

// Where a step's start and finish ran, and what the finish saw.
struct Ran {
  std::thread::id start;
  std::thread::id finish;
  absl::Status status;
  cudaError_t stream_after = cudaErrorNotReady;  // cudaStreamQuery in the finish
};

class CudaLaneTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    lane_ = std::make_unique<Lane>(0, 4);
    ASSERT_TRUE(lane_->Create(0).ok());
    ASSERT_TRUE(lane_->d_in.Reserve(kBytes).ok());
  }
  void TearDown() override { lane_.reset(); }

  // Launches a step that clears kBytes of device memory (enough work that the stream is busy
  // when the start returns) and waits for its finish.
  Ran Step() {
    // Shared with the finish, which may still be inside set_value when the future is ready.
    auto done = std::make_shared<std::promise<Ran>>();
    std::future<Ran> ran_future = done->get_future();
    auto ran = std::make_shared<Ran>();
    Lane* lane = lane_.get();
    lane->Launch(
        [lane, ran](bool* enqueued) {
          ran->start = std::this_thread::get_id();
          *enqueued = true;
          return cudaMemsetAsync(lane->d_in.get(), 0, kBytes, lane->stream.get()) == cudaSuccess
                     ? absl::OkStatus()
                     : absl::InternalError("cudaMemsetAsync");
        },
        [lane, ran, done](absl::Status synced) {
          ran->finish = std::this_thread::get_id();
          ran->status = std::move(synced);
          ran->stream_after = cudaStreamQuery(lane->stream.get());
          done->set_value(*ran);
        });
    return ran_future.get();
  }

  static constexpr size_t kBytes = size_t{256} << 20;
  std::unique_ptr<Lane> lane_;
};

TEST_F(CudaLaneTest, TheSpinningCompletionThreadLaunchesAndTheFinishSeesTheWorkDone) {
  // Right after a finish the completion thread spins; a step launched then starts there. The
  // thread may not have begun to spin yet when the next call comes: a few tries allow for that.
  const std::thread::id caller = std::this_thread::get_id();
  bool on_completion_thread = false;
  for (int attempt = 0; attempt < 50 && !on_completion_thread; ++attempt) {
    const Ran ran = Step();
    ASSERT_TRUE(ran.status.ok()) << ran.status;
    EXPECT_NE(ran.finish, caller);
    EXPECT_EQ(ran.stream_after, cudaSuccess) << "the finish ran before the stream was done";
    on_completion_thread = ran.start != caller;
    if (on_completion_thread) {
      EXPECT_EQ(ran.start, ran.finish);
    }
  }
  EXPECT_TRUE(on_completion_thread) << "no step was launched by the spinning completion thread";
}

TEST_F(CudaLaneTest, TheCallerLaunchesWhenTheCompletionThreadSleeps) {
  const std::thread::id caller = std::this_thread::get_id();
  (void)Step();
  bool by_caller = false;
  for (int attempt = 0; attempt < 5 && !by_caller; ++attempt) {
    // Far past the completion thread's spin: it waits on its condition variable now.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const Ran ran = Step();
    ASSERT_TRUE(ran.status.ok()) << ran.status;
    EXPECT_NE(ran.finish, caller);
    EXPECT_EQ(ran.stream_after, cudaSuccess) << "the finish ran before the stream was done";
    by_caller = ran.start == caller;
  }
  EXPECT_TRUE(by_caller) << "a sleeping completion thread was woken to launch";
}

TEST_F(CudaLaneTest, AFinishThatLaunchesTheNextStepStartsItAtOnce) {
  // The next step's start runs inside the finish that launches it, not after that finish
  // returns (its callbacks may take long; the device would idle meanwhile).
  struct Seen {
    std::thread::id finishing, started;
    bool finish_returned = false;  // when the start ran
  };
  auto done = std::make_shared<std::promise<Seen>>();
  auto seen = done->get_future();
  auto returned = std::make_shared<std::atomic<bool>>(false);
  Lane* lane = lane_.get();
  lane->Launch(
      [](bool* enqueued) {
        *enqueued = false;
        return absl::OkStatus();
      },
      [lane, done, returned](absl::Status) {
        const std::thread::id finishing = std::this_thread::get_id();
        lane->Launch(
            [lane, finishing, done, returned](bool* enqueued) {
              done->set_value({finishing, std::this_thread::get_id(), returned->load()});
              *enqueued = true;
              return cudaMemsetAsync(lane->d_in.get(), 0, 4096, lane->stream.get()) == cudaSuccess
                         ? absl::OkStatus()
                         : absl::InternalError("cudaMemsetAsync");
            },
            [](absl::Status) {});
        returned->store(true);
      });
  const Seen s = seen.get();
  EXPECT_EQ(s.started, s.finishing);
  EXPECT_FALSE(s.finish_returned) << "the next step started only after the finish returned";
}

TEST_F(CudaLaneTest, AFailedStartReachesTheFinish) {
  for (bool enqueued_some : {false, true}) {
    auto done = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> finished = done->get_future();
    auto idle = std::make_shared<cudaError_t>(cudaErrorNotReady);  // cudaStreamQuery in the finish
    Lane* lane = lane_.get();
    lane->Launch(
        [lane, enqueued_some](bool* enqueued) {
          *enqueued = enqueued_some;
          if (enqueued_some) (void)cudaMemsetAsync(lane->d_in.get(), 0, kBytes, lane->stream.get());
          return absl::InternalError("refused by the test");
        },
        [lane, done, idle](absl::Status synced) {
          *idle = cudaStreamQuery(lane->stream.get());
          done->set_value(std::move(synced));
        });
    const absl::Status status = finished.get();
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << enqueued_some;
    EXPECT_EQ(status.message(), "refused by the test");
    // What a failed start did enqueue still reads the staging: the finish runs after it.
    EXPECT_EQ(*idle, cudaSuccess) << enqueued_some;
  }
}

}  // namespace
}  // namespace indexer::testing
