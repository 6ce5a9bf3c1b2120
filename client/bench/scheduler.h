// SimulatedScheduler: one indexer-bench worker, behaving like one LLM scheduler. It keeps up to
// `batch` sequences live; a sequence is created and prefilled (AppendKeys of every layer, in
// chunks), decoded step by step (each step appends `speculative` tokens' keys of every layer and
// selects blocks for them on each selected layer; rejected speculative tokens are rolled back
// with TruncateSequence) and released after its decode steps, and its slot is refilled with the
// next sequence from the SequenceSource. With `rewind`, every so many steps a sequence is
// truncated back to its prefill length, so that it decodes at a steady length however long the
// run.
//
// A decode request is one RPC: in the unary style one SelectBlocks for one (sequence, layer) of a
// step (the layer-0 call carries the append), in the batch style one Batch call holding the
// whole step of every live sequence, in the stream style the same batch as one BatchStream
// message. The load generator (runner.h) decides when requests start.
//
// With checking on, it keeps a host copy of every key it appended (HostKeys) and checks every
// answer against the CPU reference (checker.h).
//
// Threads: a SimulatedScheduler belongs to one worker thread. SequenceSource is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include "client/bench/checker.h"
#include "client/bench/recorder.h"
#include "client/bench/workload.h"
#include "client/cpp/sharded_client.h"

namespace indexer::bench {

// Hands out the sequences of a stage in index order; at most `max_sequences` (0: no limit).
class SequenceSource {
 public:
  SequenceSource(const WorkloadSpec& spec, int64_t max_sequences);
  std::optional<SequencePlan> Next();
  // No more sequences after this (the stage is ending).
  void Close();

 private:
  const WorkloadSpec& spec_;
  const int64_t max_;
  std::mutex mu_;
  int64_t next_ = 0;
  bool closed_ = false;
};

// What every worker of a stage shares (read-only, or thread-safe).
struct SchedulerContext {
  const WorkloadSpec* spec = nullptr;
  const ServerShape* shape = nullptr;
  const ValuePool* pool = nullptr;
  Recorder* recorder = nullptr;
  SequenceSource* source = nullptr;
  client::CallOptions call;  // deadline of each unary call
  bool check = false;
  CheckParams check_params;
  std::atomic<int64_t>* attention_pages = nullptr;  // the next attention page id
};

class SimulatedScheduler {
 public:
  SimulatedScheduler(const SchedulerContext& context, client::ShardedClient& client, uint64_t seed);
  ~SimulatedScheduler();
  SimulatedScheduler(const SimulatedScheduler&) = delete;
  SimulatedScheduler& operator=(const SimulatedScheduler&) = delete;

  // Releases sequences that finished their decode steps and starts (prefills) new ones in free
  // slots while the source has any. False when no sequence is left to decode.
  bool Refill();
  // Sends one decode request; latency counts from `intended`. `measured`: outside the warm-up.
  void Decode(Clock::time_point intended, bool measured, bool open_loop);
  // Releases every live sequence and ends the stream, if any.
  void Drain();

 private:
  struct Slot;
  struct PendingItem;

  std::unique_ptr<Slot> StartSequence(const SequencePlan& plan);
  void Release(Slot& slot);
  v1::SelectBlocksRequest MakeItem(Slot& slot, int slot_index, int layer, PendingItem* pending);
  // Applies one item's answer to the slot (lengths, host keys) and checks it. Returns the
  // item's status code.
  int Apply(const PendingItem& item, const v1::BatchItemResult& result, int64_t* selections,
            int64_t* tokens);
  // After a sequence's step: speculative acceptance (TruncateSequence), step counting and
  // --rewind.
  void FinishStep(Slot& slot);
  // TruncateSequence to `length` tokens, recorded; on success the slot follows.
  void Truncate(Slot& slot, int64_t length);

  const SchedulerContext& ctx_;
  client::ShardedClient& client_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<client::ShardedBatchStream> stream_;
  size_t cursor_slot_ = 0;  // unary: the next (slot, layer)
  int cursor_layer_ = 0;
  uint64_t request_id_ = 0;
};

}  // namespace indexer::bench
