// The select batcher (dynamic decode batching): on its own with a fake backend whose launches the
// test holds open, so what merges is decided by the test rather than by thread timing; then
// through the Engine on a real CPU backend -- merged launches, the queue bound, deadlines and
// cancellation while queued (nothing applied), read-your-own-writes, and answers equal to the
// reference under concurrent load, with batching on and off.
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/select_batcher.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/gated_backend.h"

namespace indexer::testing {
namespace {

using engine::CallControl;
using engine::SelectBatcher;
using engine::SelectTask;

// A submitted group's end, waited for by the test.
class SelectTicket {
 public:
  explicit SelectTicket(std::future<engine::StepStatus> done) : done_(std::move(done)) {}
  // The group's selection status.
  absl::Status Wait() { return done_.get().selects; }
  // Whether the group ends within `timeout`.
  bool EndsWithin(absl::Duration timeout) {
    return done_.wait_for(absl::ToChronoMilliseconds(timeout)) == std::future_status::ready;
  }

 private:
  std::future<engine::StepStatus> done_;
};

// Submits `tasks` (no writes) to `batcher` as one group.
SelectTicket SubmitTasks(SelectBatcher& batcher, std::span<const SelectTask> tasks,
                         const CallControl& control, bool may_run_here = false) {
  auto ended = std::make_shared<std::promise<engine::StepStatus>>();
  SelectTicket ticket(ended->get_future());
  batcher.Submit({}, tasks, control, [ended](engine::StepStatus s) { ended->set_value(std::move(s)); },
                 may_run_here);
  return ticket;
}

EngineConfig BatchConfig(int max_tasks = 256, int64_t max_delay_us = 0, int64_t queue_bound = 8192,
                         int max_inflight = 1) {
  EngineConfig c = SmallEngineConfig();
  c.batching.enabled = true;
  c.batching.max_tasks = max_tasks;
  c.batching.max_delay_us = max_delay_us;
  c.batching.queue_bound = queue_bound;
  c.batching.max_inflight = max_inflight;
  return c;
}

// `n` fake decode tasks, each over `blocks` visible blocks (so n * blocks raw scores). The fake
// backend reads none of their pointers.
std::vector<SelectTask> Tasks(int n, int blocks = 1) {
  std::vector<SelectTask> t(n);
  for (SelectTask& task : t) {
    task.span.num_tokens = 1;
    task.span.num_heads = 1;
    task.span.start_pos = int64_t{kernels::kBlockSize} * (blocks - 1);
  }
  return t;
}

// A batcher on a gated fake backend, with helpers to submit groups that stay alive.
class BatcherTest : public ::testing::Test {
 protected:
  void Start(const EngineConfig& config) {
    ASSERT_TRUE(config.Validate().ok()) << config.Validate();
    batcher_ = std::make_unique<SelectBatcher>(backend_, config);
  }
  // Submits a group of `n` tasks (kept alive by the fixture) and returns its ticket.
  SelectTicket Submit(int n, int blocks = 1, const CallControl* control = nullptr) {
    groups_.push_back(std::make_unique<std::vector<SelectTask>>(Tasks(n, blocks)));
    return SubmitTasks(*batcher_, *groups_.back(), control ? *control : no_control_);
  }
  // Holds the backend, submits one group that launches and waits inside Select, so that every
  // group submitted next queues.
  SelectTicket HoldFirstLaunch() {
    backend_.Close();
    SelectTicket first = Submit(1);
    EXPECT_TRUE(backend_.WaitForCalls(1));
    return first;
  }

  GatedBackend backend_;
  CallControl no_control_;
  std::vector<std::unique_ptr<std::vector<SelectTask>>> groups_;
  std::unique_ptr<SelectBatcher> batcher_;  // last: destroyed before what it points to
};

TEST_F(BatcherTest, GroupsQueuedBehindALaunchMergeIntoOne) {
  Start(BatchConfig());
  SelectTicket first = HoldFirstLaunch();
  std::vector<SelectTicket> tickets;
  for (int i = 0; i < 10; ++i) tickets.push_back(Submit(1 + i % 3));
  EXPECT_EQ(batcher_->queued_tasks(), 19);
  backend_.Open();
  EXPECT_TRUE(first.Wait().ok());
  for (SelectTicket& t : tickets) EXPECT_TRUE(t.Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 19}));
  EXPECT_EQ(batcher_->queued_tasks(), 0);
}

TEST_F(BatcherTest, ConcurrentSubmittersShareLaunches) {
  Start(BatchConfig(/*max_tasks=*/64));
  SelectTicket first = HoldFirstLaunch();
  constexpr int kThreads = 32;
  std::vector<std::thread> threads;
  std::vector<absl::Status> got(kThreads);
  std::vector<std::vector<SelectTask>> tasks(kThreads, Tasks(1));
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { got[i] = SubmitTasks(*batcher_, tasks[i], no_control_).Wait(); });
  }
  ASSERT_TRUE(Eventually([&] { return batcher_->queued_tasks() == kThreads; }));
  backend_.Open();
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(first.Wait().ok());
  for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, kThreads}));
}

TEST_F(BatcherTest, LaunchesRespectMaxTasksAndNeverSplitAGroup) {
  Start(BatchConfig(/*max_tasks=*/4));
  SelectTicket first = HoldFirstLaunch();
  std::vector<SelectTicket> tickets;
  for (int n : {1, 1, 1, 1, 1, 3, 3, 6, 2}) tickets.push_back(Submit(n));
  backend_.Open();
  for (SelectTicket& t : tickets) EXPECT_TRUE(t.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  // In order: 1+1+1+1 | 1+3 | 3 (3+6 > 4) | 6 alone | 2.
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 4, 4, 3, 6, 2}));
}

TEST_F(BatcherTest, LaunchesRespectMaxSelectScores) {
  EngineConfig c = BatchConfig();
  c.max_select_scores = 10;
  Start(c);
  SelectTicket first = HoldFirstLaunch();
  std::vector<SelectTicket> tickets;
  for (int i = 0; i < 5; ++i) tickets.push_back(Submit(1, /*blocks=*/4));  // 4 scores each
  backend_.Open();
  for (SelectTicket& t : tickets) EXPECT_TRUE(t.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 2, 2, 1}));
}

TEST_F(BatcherTest, ALoneSelectionWaitsMaxDelay) {
  Start(BatchConfig(/*max_tasks=*/8, /*max_delay_us=*/100000));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(Submit(1).Wait().ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(95));
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1}));
}

TEST_F(BatcherTest, AFullBatchLaunchesBeforeMaxDelay) {
  Start(BatchConfig(/*max_tasks=*/8, /*max_delay_us=*/1000000));
  const absl::Time start = absl::Now();
  std::vector<SelectTicket> tickets;
  for (int i = 0; i < 4; ++i) tickets.push_back(Submit(2));
  for (SelectTicket& t : tickets) EXPECT_TRUE(t.Wait().ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(800));
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{8}));
}

TEST_F(BatcherTest, TheQueueBoundRefusesAtOnce) {
  Start(BatchConfig(/*max_tasks=*/256, 0, /*queue_bound=*/4));
  SelectTicket first = HoldFirstLaunch();
  SelectTicket a = Submit(2);
  SelectTicket b = Submit(2);
  const absl::Status refused = Submit(1).Wait();  // ready at once: the backend is still held
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(Contains(refused.message(), "batch_queue_bound 4")) << refused;
  backend_.Open();
  EXPECT_TRUE(a.Wait().ok());
  EXPECT_TRUE(b.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  // An empty queue takes a group however large.
  EXPECT_TRUE(Submit(9).Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 4, 9}));
}

TEST_F(BatcherTest, ExpiredAndCancelledGroupsAreDroppedBeforeLaunch) {
  Start(BatchConfig());
  SelectTicket first = HoldFirstLaunch();
  CallControl expiring;
  expiring.deadline = absl::Now() + absl::Milliseconds(20);
  std::atomic<bool> cancel{false};
  CallControl cancellable;
  cancellable.cancelled = [&] { return cancel.load(); };
  SelectTicket expired = Submit(3, 1, &expiring);
  SelectTicket cancelled = Submit(5, 1, &cancellable);
  SelectTicket fine = Submit(2);
  absl::SleepFor(absl::Milliseconds(50));
  cancel = true;
  backend_.Open();
  EXPECT_EQ(expired.Wait().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(fine.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 2}));
}

TEST_F(BatcherTest, BackendErrorsReachEveryGroupOfTheLaunch) {
  Start(BatchConfig());
  SelectTicket first = HoldFirstLaunch();
  SelectTicket a = Submit(1);
  SelectTicket b = Submit(2);
  backend_.SetSelectStatus(absl::InternalError("injected"));
  backend_.Open();
  EXPECT_EQ(first.Wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(a.Wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(b.Wait().code(), absl::StatusCode::kInternal);
}

TEST_F(BatcherTest, MaxInflightLaunchesRunAtOnce) {
  Start(BatchConfig(256, 0, 8192, /*max_inflight=*/2));
  backend_.Close();
  SelectTicket a = Submit(1);
  ASSERT_TRUE(backend_.WaitForCalls(1));
  SelectTicket b = Submit(2);  // the second worker launches it while the first is held
  ASSERT_TRUE(backend_.WaitForCalls(2));
  SelectTicket c = Submit(3);  // both busy: queued
  EXPECT_EQ(batcher_->queued_tasks(), 3);
  backend_.Open();
  EXPECT_TRUE(a.Wait().ok());
  EXPECT_TRUE(b.Wait().ok());
  EXPECT_TRUE(c.Wait().ok());
  EXPECT_EQ(backend_.max_running(), 2);
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(BatcherTest, MaxInflightOneRunsOneAtATime) {
  Start(BatchConfig(256, 0, 8192, /*max_inflight=*/1));
  SelectTicket first = HoldFirstLaunch();
  SelectTicket b = Submit(2);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(backend_.calls().size(), 1u);
  EXPECT_EQ(batcher_->queued_tasks(), 2);
  backend_.Open();
  EXPECT_TRUE(b.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  EXPECT_EQ(backend_.max_running(), 1);
}

TEST_F(BatcherTest, BatchingOffSelectsOnTheCallersThread) {
  EngineConfig c = BatchConfig();
  c.batching.enabled = false;
  Start(c);
  EXPECT_TRUE(Submit(3).Wait().ok());
  EXPECT_TRUE(Submit(2).Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{3, 2}));
  for (std::thread::id id : backend_.threads()) EXPECT_EQ(id, std::this_thread::get_id());
}

TEST_F(BatcherTest, AnIdleBatcherLaunchesOnTheCallersThread) {
  Start(BatchConfig(256, 0, 8192, /*max_inflight=*/1));
  std::vector<SelectTask> tasks = Tasks(3);
  EXPECT_TRUE(SubmitTasks(*batcher_, tasks, no_control_, /*may_run_here=*/true).Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{3}));
  EXPECT_EQ(backend_.threads().back(), std::this_thread::get_id());
  // Without permission it goes through a worker.
  EXPECT_TRUE(SubmitTasks(*batcher_, tasks, no_control_).Wait().ok());
  EXPECT_NE(backend_.threads().back(), std::this_thread::get_id());
}

// A worker waiting for a slot runs only when something wakes it: when the slot is held by a
// launch on another thread (here the caller's), that launch's end must wake it for the group
// that queued meanwhile.
TEST_F(BatcherTest, TheEndOfALaunchOnAnotherThreadStartsWhatQueued) {
  Start(BatchConfig(256, 0, 8192, /*max_inflight=*/1));
  backend_.Close();
  std::vector<SelectTask> tasks = Tasks(1);
  absl::Status first;
  std::thread::id caller_id;
  std::thread caller([&] {
    caller_id = std::this_thread::get_id();
    first = SubmitTasks(*batcher_, tasks, no_control_, /*may_run_here=*/true).Wait();
  });
  ASSERT_TRUE(backend_.WaitForCalls(1));
  SelectTicket queued = Submit(2);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(batcher_->queued_tasks(), 2);
  backend_.Open();
  caller.join();
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_EQ(backend_.threads().front(), caller_id);  // the first launch ran on the caller
  EXPECT_TRUE(queued.EndsWithin(absl::Seconds(10))) << "the queued group was never launched";
}

// A call already past its deadline (or cancelled) when it reaches the batcher is not selected on
// any path: not on the caller's thread, not with batching off.
TEST_F(BatcherTest, LateCallsAreRefusedOnEveryPath) {
  CallControl expired;
  expired.deadline = absl::Now() - absl::Milliseconds(1);
  CallControl cancelled;
  cancelled.cancelled = [] { return true; };
  std::vector<SelectTask> tasks = Tasks(2);
  for (const bool batching : {true, false}) {
    EngineConfig c = BatchConfig(256, 0, 8192, /*max_inflight=*/1);
    c.batching.enabled = batching;
    batcher_.reset();
    Start(c);
    EXPECT_EQ(SubmitTasks(*batcher_, tasks, expired, /*may_run_here=*/true).Wait().code(),
              absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(SubmitTasks(*batcher_, tasks, cancelled, /*may_run_here=*/true).Wait().code(),
              absl::StatusCode::kCancelled);
    EXPECT_EQ(SubmitTasks(*batcher_, tasks, expired).Wait().code(), absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_TRUE(backend_.calls().empty());
}

TEST_F(BatcherTest, ABusyBatcherQueuesEvenWhenTheCallerMayRun) {
  Start(BatchConfig(256, 0, 8192, /*max_inflight=*/1));
  SelectTicket first = HoldFirstLaunch();
  std::vector<SelectTask> tasks = Tasks(2);
  // The one launch slot is taken: queued, not run here (Submit returns at once).
  SelectTicket queued = SubmitTasks(*batcher_, tasks, no_control_, /*may_run_here=*/true);
  EXPECT_EQ(batcher_->queued_tasks(), 2);
  backend_.Open();
  EXPECT_TRUE(queued.Wait().ok());
  EXPECT_TRUE(first.Wait().ok());
  EXPECT_EQ(backend_.calls(), (std::vector<int64_t>{1, 2}));
  EXPECT_NE(backend_.threads().back(), std::this_thread::get_id());
}

TEST_F(BatcherTest, AMaxDelayMeansNoLaunchOnTheCallersThread) {
  Start(BatchConfig(2, /*max_delay_us=*/20000));
  std::vector<SelectTask> tasks = Tasks(1);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(SubmitTasks(*batcher_, tasks, no_control_, /*may_run_here=*/true).Wait().ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(19));
  EXPECT_NE(backend_.threads().back(), std::this_thread::get_id());
}

TEST_F(BatcherTest, DestructionLaunchesWhatIsQueued) {
  Start(BatchConfig(/*max_tasks=*/2, /*max_delay_us=*/1000000));
  SelectTicket first = HoldFirstLaunch();
  std::vector<SelectTicket> tickets;
  for (int i = 0; i < 5; ++i) tickets.push_back(Submit(1));
  std::thread destroy([&] { batcher_.reset(); });
  absl::SleepFor(absl::Milliseconds(20));
  backend_.Open();
  destroy.join();  // no hang: queued groups are launched at once, max_delay or not
  EXPECT_TRUE(first.Wait().ok());
  for (SelectTicket& t : tickets) EXPECT_TRUE(t.Wait().ok());
  EXPECT_EQ(backend_.total_tasks(), 6);
}

// ---------------------------------------------------------------------------------------------
// Through the engine, on a real CPU backend.

class EngineBatchingTest : public ::testing::Test {
 protected:
  void Init(const EngineConfig& config) {
    config_ = config;
    ASSERT_TRUE(config.Validate().ok()) << config.Validate();
    auto backend = std::make_unique<GatedBackend>(std::make_unique<engine::CpuBackend>(config));
    backend_ = backend.get();
    engine_ = std::make_unique<Engine>(config, std::move(backend));
  }
  // Appends n random keys to `id` (engine and model).
  void AppendOk(const std::string& id, int64_t n) {
    const std::vector<uint16_t> k = RandomBf16(rng_, static_cast<size_t>(n) * config_.head_dim);
    absl::StatusOr<StepResult> r = AppendKeys(*engine_, id, 0, k);
    ASSERT_TRUE(r.ok()) << r.status();
    auto [it, inserted] = models_.try_emplace(id, 1, config_.head_dim);
    it->second.Append(0, k);
  }
  // Holds the backend and starts a selection on `id` (on its own thread) that waits inside it.
  void HoldOneLaunch(const std::string& id) {
    backend_->Close();
    const size_t before = backend_->calls().size();
    holder_ = std::thread([this, id] {
      std::mt19937_64 rng(7);
      EXPECT_TRUE(SelectQueries(*engine_, id, RandomBf16(rng, config_.head_dim), SelectArgs{}).ok());
    });
    ASSERT_TRUE(backend_->WaitForCalls(before + 1));
  }
  void ReleaseLaunches() {
    backend_->Open();
    if (holder_.joinable()) holder_.join();
  }
  void TearDown() override { ReleaseLaunches(); }

  EngineConfig config_;
  GatedBackend* backend_ = nullptr;
  std::unique_ptr<Engine> engine_;
  std::map<std::string, SeqModel> models_;
  std::mt19937_64 rng_{12345};
  std::thread holder_;
};

// One decode step (append one key, select it) of a thread, and what it returned.
struct Step {
  std::vector<uint16_t> key, query;
  absl::StatusOr<StepResult> result = absl::UnknownError("not run");
};

// One decode step: append s.key, then select with s.query (`heads` index heads).
absl::StatusOr<StepResult> DecodeStep(Engine& e, const std::string& id, const Step& s,
                                      const engine::CallControl& control = {}, int heads = 1) {
  const std::string keys = Bytes(s.key);
  const std::string queries = Bytes(s.query);
  StepRequest r;
  r.sequence_id = id;
  AppendRequest a;
  a.dtype = WireDtype::kBf16;
  a.keys = keys;
  r.append = a;
  r.num_heads = heads;
  r.query_dtype = WireDtype::kBf16;
  r.queries = queries;
  return e.Select(r, control);
}

TEST_F(EngineBatchingTest, ConcurrentDecodeStepsShareOneLaunchAndMatchTheReference) {
  EngineConfig c = BatchConfig();
  c.capacity_pages = 256;
  Init(c);
  constexpr int kSeqs = 24;
  for (int i = 0; i < kSeqs; ++i) ASSERT_NO_FATAL_FAILURE(AppendOk(absl::StrCat("s", i), 100 + 37 * i));
  ASSERT_NO_FATAL_FAILURE(AppendOk("holder", 10));
  ASSERT_NO_FATAL_FAILURE(HoldOneLaunch("holder"));
  std::vector<Step> steps(kSeqs);
  for (Step& s : steps) {
    s.key = RandomBf16(rng_, config_.head_dim);
    s.query = RandomBf16(rng_, config_.head_dim);
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kSeqs; ++i) {
    threads.emplace_back([&, i] { steps[i].result = DecodeStep(*engine_, absl::StrCat("s", i), steps[i]); });
  }
  ASSERT_TRUE(Eventually([&] { return engine_->Stats().queued_selects == kSeqs; }));
  ReleaseLaunches();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(backend_->calls().back(), kSeqs) << "every queued step in one launch";
  for (int i = 0; i < kSeqs; ++i) {
    SeqModel& m = models_[absl::StrCat("s", i)];
    m.Append(0, steps[i].key);
    ASSERT_TRUE(steps[i].result.ok()) << steps[i].result.status();
    EXPECT_EQ(steps[i].result->lengths, m.Lengths());
    ExpectSameSelection(*steps[i].result,
                        ExpectedSelect(config_, m, 0, m.Len(0) - 1, 1, 1, steps[i].query,
                                       config_.defaults));
  }
}

// A call on a sequence another call is using holds no thread: BatchAsync returns at once, the
// call waits (parked on the sequence) until the first has answered, then runs on the thread
// that ended the first, and sees the first call's append.
TEST_F(EngineBatchingTest, ACallOnABusySequenceWaitsWithoutAThreadAndSeesTheEarlierAppend) {
  Init(BatchConfig());
  ASSERT_NO_FATAL_FAILURE(AppendOk("a", 300));
  backend_->Close();
  Step first{RandomBf16(rng_, config_.head_dim), RandomBf16(rng_, config_.head_dim)};
  std::thread holder([&] { first.result = DecodeStep(*engine_, "a", first); });
  ASSERT_TRUE(backend_->WaitForCalls(1));  // the first step is in the backend, "a" locked

  Step second{RandomBf16(rng_, config_.head_dim), RandomBf16(rng_, config_.head_dim)};
  const std::string keys = Bytes(second.key), queries = Bytes(second.query);
  StepRequest r = Bf16Select("a", 0, 1, queries);
  r.append = Bf16Append("", 0, keys);
  std::promise<std::vector<absl::StatusOr<StepResult>>> answered;
  std::future<std::vector<absl::StatusOr<StepResult>>> got = answered.get_future();
  const engine::CallControl control;
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  engine_->BatchAsync(std::span<const StepRequest>(&r, 1), control, nullptr,
                      [&](absl::Status call, std::vector<absl::StatusOr<StepResult>> results) {
                        EXPECT_TRUE(call.ok()) << call;
                        ran_on = std::this_thread::get_id();
                        answered.set_value(std::move(results));
                      });
  // Returned without waiting for "a"; nothing of the second call has reached the backend.
  EXPECT_EQ(got.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  EXPECT_EQ(backend_->calls().size(), 1u);
  ReleaseLaunches();
  holder.join();
  std::vector<absl::StatusOr<StepResult>> results = got.get();
  EXPECT_NE(ran_on, caller);
  ASSERT_TRUE(first.result.ok()) << first.result.status();
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  SeqModel& m = models_["a"];
  m.Append(0, first.key);
  m.Append(0, second.key);
  EXPECT_EQ(results[0]->lengths, m.Lengths());
  ExpectSameSelection(*results[0], ExpectedSelect(config_, m, 0, m.Len(0) - 1, 1, 1, second.query,
                                                  config_.defaults));
}

TEST_F(EngineBatchingTest, TheQueueBoundRefusesAndRollsTheAppendBack) {
  Init(BatchConfig(256, 0, /*queue_bound=*/2));
  for (const char* id : {"holder", "a", "b", "victim"}) ASSERT_NO_FATAL_FAILURE(AppendOk(id, 128));
  ASSERT_NO_FATAL_FAILURE(HoldOneLaunch("holder"));
  std::vector<std::thread> queued;
  for (const char* id : {"a", "b"}) {
    queued.emplace_back([this, id] {
      std::mt19937_64 rng(3);
      EXPECT_TRUE(SelectQueries(*engine_, id, RandomBf16(rng, config_.head_dim), SelectArgs{}).ok());
    });
  }
  ASSERT_TRUE(Eventually([&] { return engine_->Stats().queued_selects == 2; }));
  const engine::EngineStats before = engine_->Stats();
  Step s{RandomBf16(rng_, config_.head_dim), RandomBf16(rng_, config_.head_dim)};
  // Appending one key to a full block opens a new page: that page must come back too.
  absl::StatusOr<StepResult> r = DecodeStep(*engine_, "victim", s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(Contains(r.status().message(), "batch_queue_bound 2")) << r.status();
  // A new sequence refused the same way does not exist afterwards.
  absl::StatusOr<StepResult> fresh = DecodeStep(*engine_, "fresh", s);
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kResourceExhausted) << fresh.status();
  ReleaseLaunches();
  for (std::thread& t : queued) t.join();
  absl::StatusOr<engine::SequenceInfo> info = engine_->Get("victim");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lengths, std::vector<int64_t>{128});
  EXPECT_EQ(info->pages.size(), 1u);
  EXPECT_EQ(engine_->Get("fresh").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().free_pages, before.free_pages);
  EXPECT_EQ(engine_->Stats().live_sequences, before.live_sequences);
  // And the sequence still works, with its own keys only.
  ASSERT_TRUE(CheckSelection(*engine_, config_, "victim", models_["victim"], rng_, SelectArgs{}).ok());
}

TEST_F(EngineBatchingTest, ADeadlineThatPassesWhileQueuedAppliesNothing) {
  Init(BatchConfig());
  ASSERT_NO_FATAL_FAILURE(AppendOk("holder", 10));
  ASSERT_NO_FATAL_FAILURE(AppendOk("old", 128));
  ASSERT_NO_FATAL_FAILURE(HoldOneLaunch("holder"));
  const int64_t free_before = engine_->Stats().free_pages;
  engine::CallControl control;
  control.deadline = absl::Now() + absl::Milliseconds(100);
  Step s{RandomBf16(rng_, config_.head_dim), RandomBf16(rng_, config_.head_dim)};
  absl::StatusOr<StepResult> old_result, new_result;
  std::thread t1([&] { old_result = DecodeStep(*engine_, "old", s, control); });
  std::thread t2([&] { new_result = DecodeStep(*engine_, "new", s, control); });
  ASSERT_TRUE(Eventually([&] { return engine_->Stats().queued_selects == 2; }));
  absl::SleepFor(absl::Milliseconds(150));
  ReleaseLaunches();
  t1.join();
  t2.join();
  EXPECT_EQ(old_result.status().code(), absl::StatusCode::kDeadlineExceeded) << old_result.status();
  EXPECT_EQ(new_result.status().code(), absl::StatusCode::kDeadlineExceeded) << new_result.status();
  EXPECT_EQ(engine_->Get("old")->lengths, std::vector<int64_t>{128});
  EXPECT_EQ(engine_->Get("new").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  EXPECT_EQ(backend_->total_tasks(), 1) << "only the holder's selection was launched";
}

TEST_F(EngineBatchingTest, ACancelledCallIsDroppedWhileQueued) {
  Init(BatchConfig());
  ASSERT_NO_FATAL_FAILURE(AppendOk("holder", 10));
  ASSERT_NO_FATAL_FAILURE(AppendOk("s", 300));
  ASSERT_NO_FATAL_FAILURE(HoldOneLaunch("holder"));
  const int64_t free_before = engine_->Stats().free_pages;
  std::atomic<bool> cancel{false};
  engine::CallControl control;
  control.cancelled = [&] { return cancel.load(); };
  Step s{RandomBf16(rng_, config_.head_dim), RandomBf16(rng_, config_.head_dim)};
  absl::StatusOr<StepResult> r;
  std::thread t([&] { r = DecodeStep(*engine_, "s", s, control); });
  ASSERT_TRUE(Eventually([&] { return engine_->Stats().queued_selects == 1; }));
  cancel = true;
  ReleaseLaunches();
  t.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_EQ(engine_->Get("s")->lengths, std::vector<int64_t>{300});
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
}

// Several threads step the same sequences at once. Each call must see its own append: its
// answer's length says where its key went, and its selection must equal the reference over
// exactly the keys up to and including its own.
void ReadYourOwnWrites(const EngineConfig& config) {
  auto backend = std::make_unique<engine::CpuBackend>(config);
  Engine e(config, std::move(backend));
  constexpr int kSeqs = 3, kThreadsPerSeq = 4, kSteps = 40;
  std::vector<std::vector<Step>> steps(kSeqs * kThreadsPerSeq, std::vector<Step>(kSteps));
  std::mt19937_64 rng(99);
  for (auto& per_thread : steps) {
    for (Step& s : per_thread) {
      s.key = RandomBf16(rng, config.head_dim);
      s.query = RandomBf16(rng, config.head_dim);
    }
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kSeqs * kThreadsPerSeq; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = absl::StrCat("seq", t % kSeqs);
      for (Step& s : steps[t]) s.result = DecodeStep(e, id, s);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int q = 0; q < kSeqs; ++q) {
    // Rebuild the sequence from where each answer says its key went.
    const int64_t total = int64_t{kThreadsPerSeq} * kSteps;
    std::vector<const Step*> at(total, nullptr);
    for (int t = q; t < kSeqs * kThreadsPerSeq; t += kSeqs) {
      for (const Step& s : steps[t]) {
        ASSERT_TRUE(s.result.ok()) << s.result.status();
        const int64_t len = s.result->lengths[0];
        ASSERT_GE(len, 1);
        ASSERT_LE(len, total);
        ASSERT_EQ(at[len - 1], nullptr) << "two calls report length " << len;
        at[len - 1] = &s;
      }
    }
    SeqModel m(1, config.head_dim);
    for (int64_t p = 0; p < total; ++p) {
      m.Append(0, at[p]->key);
      ExpectSameSelection(*at[p]->result,
                          ExpectedSelect(config, m, 0, p, 1, 1, at[p]->query, config.defaults));
    }
  }
}

TEST(EngineBatching, ReadYourOwnWritesWithBatching) { ReadYourOwnWrites(BatchConfig(8, 0, 8192, 2)); }

TEST(EngineBatching, ReadYourOwnWritesWithBatchingAndADelay) {
  ReadYourOwnWrites(BatchConfig(8, /*max_delay_us=*/200, 8192, 2));
}

TEST(EngineBatching, ReadYourOwnWritesWithoutBatching) {
  EngineConfig c = BatchConfig();
  c.batching.enabled = false;
  ReadYourOwnWrites(c);
}

// Random concurrent load -- decode steps, spans, Batch calls over several sequences -- against
// the reference; batching on (several settings) and off give the same answers.
void RandomLoad(const EngineConfig& config, uint64_t seed) {
  SCOPED_TRACE(absl::StrCat("seed ", seed, " max_tasks ", config.batching.max_tasks, " enabled ",
                            config.batching.enabled));
  Engine e(config, std::make_unique<engine::CpuBackend>(config));
  constexpr int kThreads = 8, kOps = 60;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 31 + t);
      std::vector<std::string> ids = {absl::StrCat("t", t, "a"), absl::StrCat("t", t, "b")};
      std::map<std::string, SeqModel> models;
      for (const std::string& id : ids) models.try_emplace(id, 1, config.head_dim);
      for (int op = 0; op < kOps; ++op) {
        const int kind = static_cast<int>(rng() % 3);
        if (kind == 0) {  // a decode step on one sequence
          const std::string& id = ids[rng() % 2];
          Step s{RandomBf16(rng, config.head_dim), RandomBf16(rng, 2 * config.head_dim)};
          absl::StatusOr<StepResult> got = DecodeStep(e, id, s, {}, /*heads=*/2);
          ASSERT_TRUE(got.ok()) << got.status();
          SeqModel& m = models[id];
          m.Append(0, s.key);
          ExpectSameSelection(*got, ExpectedSelect(config, m, 0, m.Len(0) - 1, 1, 2, s.query,
                                                   config.defaults));
        } else if (kind == 1) {  // a prefill chunk
          const std::string& id = ids[rng() % 2];
          const int64_t n = 1 + static_cast<int64_t>(rng() % 200);
          const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(n) * config.head_dim);
          ASSERT_TRUE(AppendKeys(e, id, 0, k).ok());
          models[id].Append(0, k);
        } else {  // a Batch over both sequences: a span on each
          std::vector<std::vector<uint16_t>> qs;
          std::vector<std::string> bytes;
          std::vector<StepRequest> items;
          std::vector<int> ns;
          for (const std::string& id : ids) {
            const int64_t len = models[id].Len(0);
            if (len == 0) continue;
            const int n = 1 + static_cast<int>(rng() % std::min<int64_t>(len, 4));
            qs.push_back(RandomBf16(rng, static_cast<size_t>(n) * config.head_dim));
            ns.push_back(n);
          }
          for (size_t i = 0; i < qs.size(); ++i) bytes.push_back(Bytes(qs[i]));
          size_t j = 0;
          for (const std::string& id : ids) {
            if (models[id].Len(0) == 0) continue;
            StepRequest r;
            r.sequence_id = id;
            r.num_heads = 1;
            r.query_dtype = WireDtype::kBf16;
            r.queries = bytes[j++];
            items.push_back(r);
          }
          std::vector<absl::StatusOr<StepResult>> got = e.Batch(items);
          j = 0;
          for (const std::string& id : ids) {
            if (models[id].Len(0) == 0) continue;
            ASSERT_TRUE(got[j].ok()) << got[j].status();
            const SeqModel& m = models[id];
            ExpectSameSelection(*got[j], ExpectedSelect(config, m, 0, m.Len(0) - ns[j], ns[j], 1,
                                                        qs[j], config.defaults));
            ++j;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(EngineBatching, RandomConcurrentLoadMatchesTheReference) {
  const uint64_t seed = std::random_device{}();
  EngineConfig c = BatchConfig(256, 0, 8192, 2);
  c.capacity_pages = 512;
  RandomLoad(c, seed);
  c.batching.max_tasks = 3;
  c.batching.max_inflight = 1;
  RandomLoad(c, seed);
  c.batching.max_delay_us = 300;
  RandomLoad(c, seed);
  c.batching.enabled = false;
  RandomLoad(c, seed);
}

}  // namespace
}  // namespace indexer::testing
