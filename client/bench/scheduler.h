// SimulatedScheduler: one indexer-bench worker, behaving like one LLM scheduler. It keeps up to
// `batch` sequences live; a sequence is created and prefilled (AppendKeys of every layer, in
// chunks), decoded step by step (each step appends `speculative` tokens' keys of every layer and
// selects blocks for them on each selected layer; rejected speculative tokens are rolled back
// with TruncateSequence) and released after its decode steps, and its slot is refilled with the
// next sequence from the SequenceSource (the stage's first sequences start part-way through their
// steps, so that refills come one at a time; a trace's sequences join when they arrive). With
// `rewind`, every so many steps a sequence is truncated back to its prefill length, so that it
// decodes at a steady length however long the run.
//
// A decode request is one RPC: in the unary style one SelectBlocks for one (sequence, layer) of a
// step (the layer-0 call carries the append), in the batch style one Batch call holding the
// whole step of every live sequence, in the stream style the same batch as one BatchStream
// message; with --stream_inflight=N the sequences form N micro-batches, each one request, and up
// to N are in flight on the stream (PipelinedStream). The load generator (runner.h) decides when
// requests start.
//
// With --shared_memory=system, each request's keys, queries and outputs are in the worker's
// RequestRegion and the request carries only references to them.
//
// With checking on, it keeps a host copy of every key it appended (HostKeys) and checks every
// answer against the CPU reference (checker.h).
//
// Threads: a SimulatedScheduler belongs to one worker thread. SequenceSource is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include "client/bench/checker.h"
#include "client/bench/pipelined_stream.h"
#include "client/bench/recorder.h"
#include "client/bench/request_region.h"
#include "client/bench/workload.h"
#include "client/cpp/sharded_client.h"

namespace indexer::bench {

// Hands out the sequences of a stage in index order; at most `max_sequences` (0: no limit), and
// with a trace at most the trace's, each once it has arrived.
class SequenceSource {
 public:
  SequenceSource(const WorkloadSpec& spec, int64_t max_sequences);

  // The stage's load begins: trace arrivals count from `start`, and the sequences handed out
  // before (the stage's first ones) were staggered. Call once.
  void Begin(Clock::time_point start);

  struct Offer {
    std::optional<SequencePlan> plan;
    // No plan: true when no sequence will come any more; else the next one has not arrived yet,
    // and next_arrival says when (unknown before Begin).
    bool done = false;
    std::optional<Clock::time_point> next_arrival;
    int64_t admission_wait_ns = -1;  // a trace's sequence: arrival to now, once the load began
  };
  Offer Next();
  // No more sequences after this (the stage is ending).
  void Close();

 private:
  const WorkloadSpec& spec_;
  int64_t max_;
  std::mutex mu_;
  int64_t next_ = 0;
  bool closed_ = false;
  bool begun_ = false;
  Clock::time_point start_;
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

  struct RefillState {
    int live = 0;              // sequences with decode steps left
    bool source_done = false;  // and no sequence will come any more
    std::optional<Clock::time_point> next_arrival;  // a trace's next sequence, not arrived yet
  };
  // Releases sequences that finished their decode steps and starts (prefills) new ones in free
  // slots while the source offers any.
  RefillState Refill();
  // Sends one decode request; latency counts from `intended` (closed loop with several requests
  // in flight: from when the request could go). `measured`: outside the warm-up. With
  // --stream_inflight above 1 it returns once the request is written, first taking the oldest
  // answer back when every micro-batch is in flight. False when there was nothing to send.
  bool Decode(Clock::time_point intended, bool measured, bool open_loop);
  // Takes back every answer in flight, releases every live sequence and ends the stream.
  void Drain();

  // The status code of the latest answered call (decode request or prefill), -1 before any, and
  // its message: the workers' view of whether the servers can be reached.
  int last_code() const { return last_code_; }
  const std::string& last_message() const { return last_message_; }

 private:
  struct Slot;
  struct PendingItem;
  struct InFlight;

  std::unique_ptr<Slot> StartSequence(const SequencePlan& plan);
  void Release(Slot& slot);
  v1::SelectBlocksRequest MakeItem(Slot& slot, int slot_index, int layer, PendingItem* pending);
  // A CUDA region's host copy and the GPU memory agree: the request's inputs uploaded before it
  // is sent (upload), or slab `slab`'s outputs downloaded once it is answered, for the checker.
  void SyncRegion(bool upload, int slab);
  // Moves the item's keys and queries into the region and asks its outputs there; the item
  // stays inline when the slab has no room.
  void ByReference(v1::SelectBlocksRequest* item, PendingItem* pending);
  // Applies one item's answer to the slot (lengths, host keys) and checks it. Returns the
  // item's status code.
  int Apply(const PendingItem& item, const v1::BatchItemResult& result, int64_t* selections,
            int64_t* tokens);
  // After a sequence's step: speculative acceptance (TruncateSequence), step counting and
  // --rewind.
  void FinishStep(Slot& slot);
  // TruncateSequence to `length` tokens, recorded; on success the slot follows.
  void Truncate(Slot& slot, int64_t length);
  void Note(int code, const std::string& message);

  bool DecodeUnary(DecodeRecord& record);
  // The step of every live slot of micro-batch `group` (-1: every live slot) as one request.
  std::vector<PendingItem> BuildStep(int group, v1::BatchRequest* request);
  // Applies a step's answer, records the request and finishes its sequences' steps.
  void CompleteStep(std::vector<PendingItem>& items, const v1::BatchResponse& response,
                    DecodeRecord& record);
  bool DecodePipelined(Clock::time_point intended, bool measured, bool open_loop);
  void CompleteOldest();

  const SchedulerContext& ctx_;
  client::ShardedClient& client_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<client::ShardedBatchStream> stream_;
  std::unique_ptr<PipelinedStream> pipeline_;  // --stream_inflight above 1
  std::unique_ptr<RequestRegion> region_;      // --shared_memory=system
  std::vector<bool> group_busy_;               // per micro-batch: a request in flight
  std::deque<InFlight> in_flight_;             // oldest first
  int next_group_ = 0;
  size_t cursor_slot_ = 0;  // unary: the next (slot, layer)
  int cursor_layer_ = 0;
  uint64_t request_id_ = 0;
  int last_code_ = -1;
  std::string last_message_;
};

}  // namespace indexer::bench
