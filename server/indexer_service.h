// IndexerService: the gRPC edge of the engine. It only translates protobuf <-> engine types and
// absl::Status -> grpc::Status; every rule lives in the engine. Handlers run on a
// RequestExecutor so that gRPC's callback threads never block. Every call is authenticated
// first (AccessControl): the caller's tenant goes with each engine request.
#pragma once

#include <mutex>
#include <set>

#include "engine/engine.h"
#include "indexer/v1/indexer.grpc.pb.h"
#include "server/access_control.h"
#include "server/call_tracker.h"
#include "server/metrics.h"
#include "server/request_executor.h"

namespace indexer::server {

class IndexerService final : public indexer::v1::Indexer::CallbackService {
 public:
  // `engine`, `executor`, `access`, `metrics` and `tracker` must outlive the service and every
  // call it serves. `tracker`: where calls are admitted and counted for a graceful shutdown
  // (IndexerServer's); null for in-process tests that drive the handlers without a gRPC server.
  IndexerService(engine::Engine* engine, RequestExecutor* executor, const AccessControl* access,
                 ServiceMetrics* metrics, std::string version, int64_t max_message_bytes,
                 CallTracker* tracker = nullptr)
      : engine_(engine),
        executor_(executor),
        access_(access),
        metrics_(metrics),
        tracker_(tracker),
        version_(std::move(version)),
        max_message_bytes_(max_message_bytes) {}

  grpc::ServerUnaryReactor* AppendKeys(grpc::CallbackServerContext* ctx,
                                       const v1::AppendKeysRequest* req,
                                       v1::AppendKeysResponse* resp) override;
  grpc::ServerUnaryReactor* SelectBlocks(grpc::CallbackServerContext* ctx,
                                         const v1::SelectBlocksRequest* req,
                                         v1::SelectBlocksResponse* resp) override;
  grpc::ServerUnaryReactor* Batch(grpc::CallbackServerContext* ctx, const v1::BatchRequest* req,
                                  v1::BatchResponse* resp) override;
  grpc::ServerBidiReactor<v1::BatchRequest, v1::BatchResponse>* BatchStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* req,
                                            v1::ReleaseSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* TruncateSequence(grpc::CallbackServerContext* ctx,
                                             const v1::TruncateSequenceRequest* req,
                                             v1::TruncateSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* req,
                                         v1::ForkSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx,
                                        const v1::GetSequenceRequest* req,
                                        v1::GetSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* ServerInfo(grpc::CallbackServerContext* ctx,
                                       const v1::ServerInfoRequest* req,
                                       v1::ServerInfoResponse* resp) override;

  // Answers one batch for `caller`; shared by Batch and BatchStream.
  void RunBatch(grpc::CallbackServerContext* ctx, const Caller& caller, const v1::BatchRequest& req,
                v1::BatchResponse* resp);

  // Ends every BatchStream with UNAVAILABLE: idle ones now, busy ones once their current answer
  // is written; streams opened later end at once. Called by IndexerServer::Shutdown, so that
  // idle streams do not hold shutdown up for the whole drain time.
  void BeginShutdown();

 private:
  class BatchStreamReactor;
  void Register(BatchStreamReactor* stream);
  void Unregister(BatchStreamReactor* stream);

  // Authenticates the call, runs `handler(caller)` on the executor and finishes the call with
  // the status it returns.
  template <typename Handler>
  grpc::ServerUnaryReactor* Defer(grpc::CallbackServerContext* ctx, absl::string_view rpc,
                                  Handler handler);

  engine::Engine* engine_;
  RequestExecutor* executor_;
  ServiceMetrics* metrics_;
  const AccessControl* access_;
  CallTracker* tracker_;
  std::string version_;
  int64_t max_message_bytes_;
  // Live streams. Recursive: a stream's OnDone (which unregisters it) may run inside
  // BeginShutdown's call to Finish on the same thread.
  std::recursive_mutex streams_mu_;
  std::set<BatchStreamReactor*> streams_;
  bool shutting_down_ = false;
};

}  // namespace indexer::server
