// StepCall: one call that appends and selects -- a unary AppendKeys, SelectBlocks or Batch, or
// one request of a BatchStream -- from its request bytes to its answer bytes, through
// Engine::BatchAsync, without a thread of its own: it runs on the thread that received it until
// the engine has staged its steps, and finishes on the thread that ends them (the device's
// completion thread on CUDA).
//
// Per call: the request is read in place (ReadStepRequest) from its bytes, which the call holds,
// so the engine reads ids, keys and queries where they arrived; the engine writes selection
// outputs straight into the answer's memory (StepAnswer; the call is the engine's OutputSink),
// which is written to the answer's bytes once. Tensors passed by reference are resolved here to
// the caller's regions (CallRegions), and an item whose reference does not resolve is handed to
// the engine already refused. Only translation happens here: every rule is the engine's.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/slice.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "indexer/v1/indexer.pb.h"
#include "server/access_control.h"
#include "server/metrics.h"
#include "server/regions/call_regions.h"
#include "server/regions/region_registry.h"
#include "server/step_answer.h"
#include "server/step_request_reader.h"

namespace indexer::server {

// kBatchStream: one request of a BatchStream, run as a Batch (named so in metrics).
enum class StepRpc { kAppendKeys, kSelectBlocks, kBatch, kBatchStream };

// The RPC's name, for metrics and logs.
const char* StepRpcName(StepRpc rpc);

class StepCall final : public engine::OutputSink {
 public:
  // The call's end: its status and, when OK, the answer serialized into the `answer` buffer.
  // Runs once, on any thread. For a Batch the status is OK unless the call failed whole; the
  // answer's items carry their own statuses.
  using Done = absl::AnyInvocable<void(grpc::Status status) &&>;

  // What a call needs of the server; everything must outlive the call. `metrics` and `regions`
  // may be null (no metrics; no regions, so every reference answers NOT_FOUND).
  struct Services {
    engine::Engine* engine = nullptr;
    ServiceMetrics* metrics = nullptr;
    const RegionRegistry* regions = nullptr;
  };

  // Parses `request` as `rpc`'s message for `caller`: INVALID_ARGUMENT when it does not parse,
  // or a whole-call refusal the engine would give (a SelectBlocks without queries). `ctx` (its
  // deadline and cancellation) and `answer` must outlive the call; `request` is not needed once
  // Parse returns.
  static absl::StatusOr<std::unique_ptr<StepCall>> Parse(StepRpc rpc, const Services& services,
                                                         const Caller& caller,
                                                         grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer& request,
                                                         grpc::ByteBuffer* answer);

  // The call's items (the sequences it names), for callers that order calls.
  const std::vector<engine::StepRequest>& items() const { return wire_.items; }

  // Runs the call; `done` runs once, on any thread, possibly before Run returns. The caller
  // keeps the call (and so the request its items view) until `done` has run, and may delete it
  // from `done`.
  void Run(Done done);

  // Ends a call that could not start, in the metrics as `rpc`.
  static void RecordRefused(ServiceMetrics* metrics, StepRpc rpc, const grpc::Status& status,
                            absl::Time arrived);

  // engine::OutputSink: item `item`'s outputs and lengths go into its answer (reply_).
  engine::SelectOutputs Allocate(size_t item, const engine::SelectShape& shape) override;
  bool KeepLengths(size_t item, std::span<const int64_t> lengths) override;

 private:
  StepCall(StepRpc rpc, const Services& services, const Caller& caller,
           grpc::CallbackServerContext* ctx, grpc::ByteBuffer* answer);
  // Reads the request into the engine's items and makes the answer.
  absl::Status Prepare(const grpc::ByteBuffer& request);
  // The request's bytes in one piece, held by the call (request_bytes_).
  absl::StatusOr<absl::string_view> HoldBytes(const grpc::ByteBuffer& request);
  // Points an item's tensors given by reference (`refs`, all of one item) into their regions;
  // the first reference that does not resolve refuses the item.
  void ResolveRefs(std::span<const ItemRef> refs);
  // Refuses every item whose output reference overlaps another reference of the call.
  void RefuseConflicts();
  // Where an item's provided outputs are written once its references are resolved.
  static void PlaceOutputs(engine::StepRequest& step);
  // The answer, one result per item, its output memory sized for `request_bytes`.
  void MakeAnswer(size_t request_bytes);
  void OnEnd(absl::Status call, std::vector<absl::StatusOr<engine::StepResult>> results);
  // Fills the answer from the results; the call's status.
  grpc::Status Answer(std::vector<absl::StatusOr<engine::StepResult>>& results);
  // Ends the call: metrics, then `done_` (which may delete this).
  void End(grpc::Status status);

  const StepRpc rpc_;
  engine::Engine* const engine_;
  ServiceMetrics* const metrics_;
  grpc::ByteBuffer* const answer_;
  Done done_;
  const std::string tenant_;  // the caller's: the items and regions_ view it
  const absl::Time arrived_;
  absl::Duration parse_;
  grpc::Slice request_bytes_;  // what wire_ views
  StepRequestWire wire_;       // the items, and what they pass by reference
  std::optional<StepAnswer> reply_;  // the answer as the engine fills it, until written to answer_
  engine::CallControl control_;
  CallRegions regions_;  // holds the regions the items view until the call is destroyed
};

}  // namespace indexer::server
