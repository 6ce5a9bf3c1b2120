#include "server/indexer_service.h"

#include <optional>

#include "absl/time/clock.h"
#include "server/authenticated_call.h"
#include "server/batch_stream.h"
#include "server/status_convert.h"
#include "server/wire_messages.h"

namespace indexer::server {
namespace {

template <typename Repeated>
void PutLengths(const std::vector<int64_t>& lengths, Repeated* out) {
  out->Reserve(static_cast<int>(lengths.size()));
  for (int64_t l : lengths) out->Add(static_cast<uint32_t>(l));
}

v1::KeyStorage ToProto(kernels::KeyStorage s) {
  switch (s) {
    case kernels::KeyStorage::kBf16: return v1::KEY_STORAGE_BF16;
    case kernels::KeyStorage::kFp8E4M3: return v1::KEY_STORAGE_FP8_E4M3;
    case kernels::KeyStorage::kFp4E2M1: return v1::KEY_STORAGE_FP4_E2M1;
  }
  return v1::KEY_STORAGE_UNSPECIFIED;
}

absl::Status NoRegions() {
  return absl::FailedPreconditionError("this server takes no shared-memory regions");
}

}  // namespace

template <typename Req, typename Resp, typename Handler>
grpc::ServerUnaryReactor* IndexerService::Defer(Ctx* ctx, absl::string_view rpc, const Bytes* req,
                                                Bytes* resp, Handler handler) {
  return RunAuthenticated(
      ctx, *access_, *executor_, tracker_, rpc,
      [req, resp, handler = std::move(handler)](const Caller& caller) {
        Req request;
        if (absl::Status parsed = ParseMessage(*req, &request); !parsed.ok()) {
          return ToGrpcStatus(parsed);
        }
        Resp response;
        grpc::Status status = handler(caller, request, &response);
        if (status.ok()) SerializeMessage(response, resp);
        return status;
      },
      metrics_);
}

grpc::ServerUnaryReactor* IndexerService::Step(StepRpc rpc, Ctx* ctx, const Bytes* req, Bytes* resp) {
  const absl::Time arrived = absl::Now();
  grpc::ServerUnaryReactor* refused = nullptr;
  std::optional<AdmittedCall> admitted =
      AdmitUnary(ctx, *access_, tracker_, StepRpcName(rpc), metrics_, arrived, &refused);
  if (!admitted) return refused;
  grpc::ServerUnaryReactor* reactor = admitted->reactor;
  absl::StatusOr<std::unique_ptr<StepCall>> call =
      StepCall::Parse(rpc, StepServices(), admitted->caller, ctx, *req, resp);
  if (!call.ok()) {
    const grpc::Status status = ToGrpcStatus(call.status());
    StepCall::RecordRefused(metrics_, rpc, status, arrived);
    reactor->Finish(status);
    return reactor;
  }
  StepCall* running = call->release();
  running->Run([running, reactor](grpc::Status status) {
    reactor->Finish(status);
    delete running;
  });
  return reactor;
}

grpc::ServerUnaryReactor* IndexerService::AppendKeys(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Step(StepRpc::kAppendKeys, ctx, req, resp);
}

grpc::ServerUnaryReactor* IndexerService::SelectBlocks(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Step(StepRpc::kSelectBlocks, ctx, req, resp);
}

grpc::ServerUnaryReactor* IndexerService::Batch(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Step(StepRpc::kBatch, ctx, req, resp);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* IndexerService::BatchStream(Ctx* ctx) {
  return new BatchStreamReactor(this, ctx, CallerOf(*access_, *ctx, "BatchStream"));
}

void IndexerService::Register(BatchStreamReactor* stream) {
  std::lock_guard<std::recursive_mutex> lock(streams_mu_);
  streams_.insert(stream);
  if (shutting_down_) stream->Stop();
}

void IndexerService::Unregister(BatchStreamReactor* stream) {
  std::lock_guard<std::recursive_mutex> lock(streams_mu_);
  streams_.erase(stream);
}

void IndexerService::BeginShutdown() {
  std::lock_guard<std::recursive_mutex> lock(streams_mu_);
  shutting_down_ = true;
  const std::set<BatchStreamReactor*> live = streams_;
  for (BatchStreamReactor* stream : live) {
    if (streams_.count(stream) > 0) stream->Stop();  // it may have finished meanwhile
  }
}

grpc::ServerUnaryReactor* IndexerService::ReleaseSequence(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::ReleaseSequenceRequest, v1::ReleaseSequenceResponse>(
      ctx, "ReleaseSequence", req, resp,
      [this](const Caller& caller, const v1::ReleaseSequenceRequest& r,
             v1::ReleaseSequenceResponse* out) {
    absl::StatusOr<int64_t> freed = engine_->Release(r.sequence_id(), caller.tenant);
    if (!freed.ok()) return ToGrpcStatus(freed.status());
    out->set_pages_freed(static_cast<uint32_t>(*freed));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::TruncateSequence(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::TruncateSequenceRequest, v1::TruncateSequenceResponse>(
      ctx, "TruncateSequence", req, resp,
      [this](const Caller& caller, const v1::TruncateSequenceRequest& q,
             v1::TruncateSequenceResponse* out) {
    absl::StatusOr<engine::TruncateResult> r =
        engine_->Truncate(q.sequence_id(), q.length(), caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    PutLengths(r->lengths, out->mutable_lengths());
    out->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
    out->set_pages_freed(static_cast<uint32_t>(r->pages_freed));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::ForkSequence(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::ForkSequenceRequest, v1::ForkSequenceResponse>(
      ctx, "ForkSequence", req, resp,
      [this](const Caller& caller, const v1::ForkSequenceRequest& q, v1::ForkSequenceResponse* out) {
    std::optional<int64_t> length;
    if (q.has_length()) length = q.length();
    absl::StatusOr<engine::ForkResult> r =
        engine_->Fork(q.source_id(), q.target_id(), length, caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    PutLengths(r->lengths, out->mutable_lengths());
    out->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
    out->set_pages_shared(static_cast<uint32_t>(r->pages_shared));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::GetSequence(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::GetSequenceRequest, v1::GetSequenceResponse>(
      ctx, "GetSequence", req, resp,
      [this](const Caller& caller, const v1::GetSequenceRequest& q, v1::GetSequenceResponse* out) {
    absl::StatusOr<engine::SequenceInfo> r = engine_->Get(q.sequence_id(), caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    out->set_sequence_id(q.sequence_id());
    PutLengths(r->lengths, out->mutable_lengths());
    out->mutable_pages()->Add(r->pages.begin(), r->pages.end());
    out->mutable_attention_pages()->Add(r->attention_pages.begin(), r->attention_pages.end());
    out->set_shared_pages(static_cast<uint32_t>(r->shared_pages));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::GetStats(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::GetStatsRequest, v1::GetStatsResponse>(
      ctx, "GetStats", req, resp,
      [this](const Caller& /*caller*/, const v1::GetStatsRequest& /*q*/, v1::GetStatsResponse* out) {
    if (metrics_ == nullptr) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this server keeps no metrics");
    }
    metrics_->Fill(out);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::ServerInfo(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::ServerInfoRequest, v1::ServerInfoResponse>(
      ctx, "ServerInfo", req, resp,
      [this](const Caller& caller, const v1::ServerInfoRequest& /*q*/, v1::ServerInfoResponse* out) {
    const engine::EngineConfig& c = engine_->config();
    const engine::EngineStats s = engine_->Stats();
    out->set_version(version_);
    out->set_backend(engine_->backend().name());
    out->set_device(engine_->backend().device());
    out->set_head_dim(c.head_dim);
    out->set_layers(c.layers);
    out->set_key_storage(ToProto(c.key_storage));
    out->set_block_size(kernels::kBlockSize);
    out->set_max_index_heads(c.max_index_heads);
    out->set_max_topk(c.max_topk);
    out->set_default_topk(c.defaults.topk);
    out->set_default_init_blocks(c.defaults.init_blocks);
    out->set_default_local_blocks(c.defaults.local_blocks);
    out->set_pages_per_block(c.page_table.pages_per_block);
    out->set_block_page_stride(c.page_table.block_page_stride);
    out->set_total_pages(s.total_pages);
    out->set_free_pages(s.free_pages);
    out->set_bytes_per_page(c.BytesPerPage());
    out->set_live_sequences(s.live_sequences);
    out->set_max_tokens_per_sequence(static_cast<uint32_t>(c.max_tokens_per_sequence));
    out->set_max_message_bytes(max_message_bytes_);
    out->set_max_sequences(static_cast<uint64_t>(c.max_sequences));
    out->set_max_query_tokens(static_cast<uint32_t>(c.max_query_tokens));
    out->set_max_batch_items(static_cast<uint32_t>(c.max_batch_items));
    const engine::TenantUsage usage = engine_->Usage(caller.tenant);
    out->set_tenant(caller.tenant);
    out->set_tenant_pages(static_cast<uint64_t>(usage.pages));
    out->set_tenant_page_quota(static_cast<uint64_t>(usage.page_quota));
    out->set_tenant_sequences(static_cast<uint64_t>(usage.sequences));
    out->set_tenant_max_sequences(static_cast<uint64_t>(usage.max_sequences));
    out->set_max_regions(regions_ != nullptr ? static_cast<uint32_t>(regions_->max_per_tenant()) : 0);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::RegisterSystemRegion(Ctx* ctx, const Bytes* req,
                                                               Bytes* resp) {
  return Defer<v1::RegisterSystemRegionRequest, v1::RegisterSystemRegionResponse>(
      ctx, "RegisterSystemRegion", req, resp,
      [this](const Caller& caller, const v1::RegisterSystemRegionRequest& q,
             v1::RegisterSystemRegionResponse* /*out*/) {
    if (regions_ == nullptr) return ToGrpcStatus(NoRegions());
    return ToGrpcStatus(
        regions_->RegisterSystem(caller.tenant, q.name(), q.key(), q.offset(), q.byte_size()));
  });
}

grpc::ServerUnaryReactor* IndexerService::RegisterCudaRegion(Ctx* ctx, const Bytes* req,
                                                             Bytes* resp) {
  return Defer<v1::RegisterCudaRegionRequest, v1::RegisterCudaRegionResponse>(
      ctx, "RegisterCudaRegion", req, resp,
      [this](const Caller& caller, const v1::RegisterCudaRegionRequest& q,
             v1::RegisterCudaRegionResponse* /*out*/) {
    if (regions_ == nullptr) return ToGrpcStatus(NoRegions());
    return ToGrpcStatus(regions_->RegisterCuda(caller.tenant, q.name(), q.raw_handle(),
                                               q.device_id(), q.offset(), q.byte_size()));
  });
}

grpc::ServerUnaryReactor* IndexerService::UnregisterRegion(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      ctx, "UnregisterRegion", req, resp,
      [this](const Caller& caller, const v1::UnregisterRegionRequest& q,
             v1::UnregisterRegionResponse* out) {
    if (regions_ == nullptr) return ToGrpcStatus(NoRegions());
    absl::StatusOr<int> n = regions_->Unregister(caller.tenant, q.name());
    if (!n.ok()) return ToGrpcStatus(n.status());
    out->set_unregistered(static_cast<uint32_t>(*n));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::ListRegions(Ctx* ctx, const Bytes* req, Bytes* resp) {
  return Defer<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      ctx, "ListRegions", req, resp,
      [this](const Caller& caller, const v1::ListRegionsRequest& q, v1::ListRegionsResponse* out) {
    if (regions_ == nullptr) return ToGrpcStatus(NoRegions());
    absl::StatusOr<std::vector<RegionInfo>> list = regions_->List(caller.tenant, q.name());
    if (!list.ok()) return ToGrpcStatus(list.status());
    for (const RegionInfo& r : *list) {
      v1::RegionStatus* status = out->add_regions();
      status->set_name(r.name);
      status->set_kind(r.kind);
      status->set_key(r.key);
      status->set_offset(r.offset);
      status->set_byte_size(r.byte_size);
      if (r.device >= 0) status->set_device_id(r.device);
      status->set_pinned(r.pinned);
    }
    return grpc::Status::OK;
  });
}

}  // namespace indexer::server
