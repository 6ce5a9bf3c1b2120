// IndexerService: the gRPC edge of the engine. It only translates protobuf <-> engine types and
// absl::Status -> grpc::Status; every rule lives in the engine. Every call is authenticated
// first (AccessControl): the caller's tenant goes with each engine request.
//
// Methods take their requests as raw bytes and parse them here (wire_messages.h), so a request
// that does not parse is answered INVALID_ARGUMENT. The calls that append and select
// (AppendKeys, SelectBlocks, Batch, BatchStream) run on the thread gRPC gives them until the
// engine has staged their steps, and finish from the device's completion (StepCall): no thread
// waits for them. The other calls, which may wait for a busy sequence or a snapshot, run on the
// RequestExecutor so that gRPC's callback threads never block.
#pragma once

#include <mutex>
#include <set>
#include <string>

#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "indexer/v1/indexer.grpc.pb.h"
#include "server/access_control.h"
#include "server/call_tracker.h"
#include "server/metrics.h"
#include "server/regions/region_registry.h"
#include "server/request_executor.h"
#include "server/step_call.h"

namespace indexer::server {

class BatchStreamReactor;

// The generated service with every method taking and answering raw bytes.
using RawIndexerService = v1::Indexer::WithRawCallbackMethod_AppendKeys<
    v1::Indexer::WithRawCallbackMethod_SelectBlocks<v1::Indexer::WithRawCallbackMethod_Batch<
        v1::Indexer::WithRawCallbackMethod_BatchStream<
            v1::Indexer::WithRawCallbackMethod_ReleaseSequence<
                v1::Indexer::WithRawCallbackMethod_TruncateSequence<
                    v1::Indexer::WithRawCallbackMethod_ForkSequence<
                        v1::Indexer::WithRawCallbackMethod_GetSequence<
                            v1::Indexer::WithRawCallbackMethod_ServerInfo<
                                v1::Indexer::WithRawCallbackMethod_GetStats<
                                    v1::Indexer::WithRawCallbackMethod_RegisterSystemRegion<
                                        v1::Indexer::WithRawCallbackMethod_RegisterCudaRegion<
                                            v1::Indexer::WithRawCallbackMethod_UnregisterRegion<
                                                v1::Indexer::WithRawCallbackMethod_ListRegions<
                                                    v1::Indexer::Service>>>>>>>>>>>>>>;

class IndexerService final : public RawIndexerService {
 public:
  // `engine`, `executor`, `access`, `metrics`, `tracker` and `regions` must outlive the service
  // and every call it serves. `tracker`: where calls are admitted and counted for a graceful
  // shutdown (IndexerServer's); null for in-process tests that drive the handlers without a gRPC
  // server. `regions`: the clients' shared-memory regions; null for a server that takes none.
  IndexerService(engine::Engine* engine, RequestExecutor* executor, const AccessControl* access,
                 ServiceMetrics* metrics, std::string version, int64_t max_message_bytes,
                 CallTracker* tracker = nullptr, RegionRegistry* regions = nullptr)
      : engine_(engine),
        executor_(executor),
        access_(access),
        metrics_(metrics),
        tracker_(tracker),
        regions_(regions),
        version_(std::move(version)),
        max_message_bytes_(max_message_bytes) {}

  using Unary = grpc::ServerUnaryReactor;
  using Ctx = grpc::CallbackServerContext;
  using Bytes = grpc::ByteBuffer;
  Unary* AppendKeys(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* SelectBlocks(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* Batch(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerBidiReactor<Bytes, Bytes>* BatchStream(Ctx* ctx) override;
  Unary* ReleaseSequence(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* TruncateSequence(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* ForkSequence(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* GetSequence(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* GetStats(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* ServerInfo(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* RegisterSystemRegion(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* RegisterCudaRegion(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* UnregisterRegion(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  Unary* ListRegions(Ctx* ctx, const Bytes* req, Bytes* resp) override;

  // Ends every BatchStream with UNAVAILABLE: idle ones now, busy ones once their answers in
  // progress are written; streams opened later end at once. Called by IndexerServer::Shutdown,
  // so that idle streams do not hold shutdown up for the whole drain time.
  void BeginShutdown();

 private:
  friend class BatchStreamReactor;
  void Register(BatchStreamReactor* stream);
  void Unregister(BatchStreamReactor* stream);
  StepCall::Services StepServices() const { return {engine_, metrics_, regions_}; }

  // An append-and-select call: admitted, parsed and run through a StepCall on this thread.
  Unary* Step(StepRpc rpc, Ctx* ctx, const Bytes* req, Bytes* resp);
  // Any other call: admitted, then parsed as Req and answered by
  // `handler(const Caller&, const Req&, Resp*) -> grpc::Status` on the executor.
  template <typename Req, typename Resp, typename Handler>
  Unary* Defer(Ctx* ctx, absl::string_view rpc, const Bytes* req, Bytes* resp, Handler handler);

  engine::Engine* engine_;
  RequestExecutor* executor_;
  const AccessControl* access_;
  ServiceMetrics* metrics_;
  CallTracker* tracker_;
  RegionRegistry* regions_;
  std::string version_;
  int64_t max_message_bytes_;
  // Live streams. Recursive: a stream's OnDone (which unregisters it) may run inside
  // BeginShutdown's call to Finish on the same thread.
  std::recursive_mutex streams_mu_;
  std::set<BatchStreamReactor*> streams_;
  bool shutting_down_ = false;
};

}  // namespace indexer::server
