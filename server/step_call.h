// StepCall: one call that appends and selects -- a unary AppendKeys, SelectBlocks or Batch, or
// one request of a BatchStream -- from its request bytes to its answer bytes, through
// Engine::BatchAsync, without a thread of its own: it runs on the thread that received it until
// the engine has staged its steps, and finishes on the thread that ends them (the device's
// completion thread on CUDA).
//
// Per call: one arena holds the parsed request and the answer; the engine reads keys and queries
// in place from the request, and writes selection outputs straight into the answer's bytes (the
// call is the engine's OutputSink). Tensors passed by reference are resolved here to the
// caller's regions (CallRegions), and an item whose reference does not resolve is handed to the
// engine already refused. Only translation happens here: every rule is the engine's.
#pragma once

#include <grpcpp/grpcpp.h>
#include <google/protobuf/arena.h>

#include <memory>
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
  const std::vector<engine::StepRequest>& items() const { return items_; }

  // Runs the call; `done` runs once, on any thread, possibly before Run returns. The caller
  // keeps the call (and so the request its items view) until `done` has run, and may delete it
  // from `done`.
  void Run(Done done);

  // Ends a call that could not start, in the metrics as `rpc`.
  static void RecordRefused(ServiceMetrics* metrics, StepRpc rpc, const grpc::Status& status,
                            absl::Time arrived);

  // engine::OutputSink: item `item`'s outputs go into its answer's bytes fields, its lengths
  // into the answer's lengths.
  engine::SelectOutputs Allocate(size_t item, const engine::SelectShape& shape) override;
  bool KeepLengths(size_t item, std::span<const int64_t> lengths) override;

 private:
  StepCall(StepRpc rpc, const Services& services, const Caller& caller,
           grpc::CallbackServerContext* ctx, const grpc::ByteBuffer& request,
           grpc::ByteBuffer* answer);
  // Parses the request and builds the engine's items.
  absl::Status Prepare(const grpc::ByteBuffer& request);
  // Points item `item`'s tensors given by reference into their regions; the first reference that
  // does not resolve refuses the item.
  void ResolveRefs(size_t item, const v1::SelectBlocksRequest* select,
                   const v1::AppendKeysRequest* append);
  // Refuses every item whose output reference overlaps another reference of the call.
  void RefuseConflicts();
  void OnEnd(absl::Status call, std::vector<absl::StatusOr<engine::StepResult>> results);
  // Fills the answer from the results; the call's status.
  grpc::Status Answer(std::vector<absl::StatusOr<engine::StepResult>>& results);
  // Ends the call: metrics, then `done_` (which may delete this).
  void End(grpc::Status status);
  // The answer message whose outputs item `item` fills.
  v1::SelectBlocksResponse* ResultOf(size_t item);

  const StepRpc rpc_;
  engine::Engine* const engine_;
  ServiceMetrics* const metrics_;
  grpc::ByteBuffer* const answer_;
  Done done_;
  const std::string tenant_;  // the caller's: the items and regions_ view it
  const absl::Time arrived_;
  absl::Duration parse_;
  google::protobuf::Arena arena_;
  // The request and the answer, on arena_ (one of each, by rpc_).
  v1::AppendKeysRequest* append_request_ = nullptr;
  v1::SelectBlocksRequest* select_request_ = nullptr;
  v1::BatchRequest* batch_request_ = nullptr;
  v1::AppendKeysResponse* append_response_ = nullptr;
  v1::SelectBlocksResponse* select_response_ = nullptr;
  v1::BatchResponse* batch_response_ = nullptr;
  std::vector<engine::StepRequest> items_;
  engine::CallControl control_;
  CallRegions regions_;  // holds the regions the items view until the call is destroyed
};

}  // namespace indexer::server
