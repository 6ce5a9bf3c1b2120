#include "server/indexer_service.h"

#include <chrono>
#include <spdlog/spdlog.h>

#include "absl/time/clock.h"
#include "server/authenticated_call.h"
#include "server/status_convert.h"

namespace indexer::server {
namespace {

using engine::WireDtype;

WireDtype FromProto(v1::ValueDtype d) {
  switch (d) {
    case v1::VALUE_DTYPE_BF16: return WireDtype::kBf16;
    case v1::VALUE_DTYPE_FP32: return WireDtype::kFp32;
    default: return WireDtype::kUnspecified;
  }
}

engine::CallControl ControlOf(grpc::CallbackServerContext* ctx) {
  engine::CallControl c;
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) c.deadline = absl::FromChrono(deadline);
  c.cancelled = [ctx] { return ctx->IsCancelled(); };
  return c;
}

engine::AppendRequest ToEngine(const v1::AppendKeysRequest& r, absl::string_view tenant) {
  engine::AppendRequest a;
  a.tenant = tenant;
  a.sequence_id = r.sequence_id();
  a.layer = r.layer();
  a.all_layers = r.all_layers();
  a.dtype = FromProto(r.dtype());
  a.keys = r.keys();
  a.attention_pages = std::span<const int32_t>(r.attention_pages().data(), r.attention_pages_size());
  return a;
}

engine::StepRequest ToEngine(const v1::SelectBlocksRequest& r, absl::string_view tenant) {
  engine::StepRequest s;
  s.tenant = tenant;
  s.sequence_id = r.sequence_id();
  s.layer = r.layer();
  if (r.has_append()) s.append = ToEngine(r.append(), tenant);
  if (r.has_start_position()) s.start_position = r.start_position();
  s.num_heads = r.num_heads();
  s.query_dtype = FromProto(r.query_dtype());
  s.queries = r.queries();
  if (r.has_topk()) s.topk = r.topk();
  if (r.has_init_blocks()) s.init_blocks = r.init_blocks();
  if (r.has_local_blocks()) s.local_blocks = r.local_blocks();
  return s;
}

template <typename T>
void PutInt32s(const std::vector<int32_t>& v, T* bytes) {
  bytes->assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
}

template <typename Repeated>
void PutLengths(const std::vector<int64_t>& lengths, Repeated* out) {
  out->Reserve(static_cast<int>(lengths.size()));
  for (int64_t l : lengths) out->Add(static_cast<uint32_t>(l));
}

void ToProto(const engine::StepResult& r, int pages_per_block, v1::SelectBlocksResponse* out) {
  out->set_num_tokens(r.num_tokens);
  out->set_num_heads(r.num_heads);
  out->set_topk(r.topk);
  out->set_start_position(r.start_position);
  PutInt32s(r.block_ids, out->mutable_block_ids());
  if (!r.page_table.empty()) {
    PutInt32s(r.page_table, out->mutable_page_table());
    PutInt32s(r.context_lens, out->mutable_context_lens());
    out->set_pages_per_block(pages_per_block);
  }
  PutLengths(r.lengths, out->mutable_lengths());
}

void LogFailure(const char* rpc, const absl::Status& s) {
  // Client errors are routine; backend failures are worth a louder line.
  if (s.code() == absl::StatusCode::kInternal) {
    spdlog::error("{} failed: {}", rpc, s.ToString());
  } else if (!s.ok()) {
    spdlog::debug("{} refused: {}", rpc, s.ToString());
  }
}

}  // namespace

template <typename Handler>
grpc::ServerUnaryReactor* IndexerService::Defer(grpc::CallbackServerContext* ctx,
                                                absl::string_view rpc, Handler handler) {
  return RunAuthenticated(ctx, *access_, *executor_, tracker_, rpc, std::move(handler), metrics_);
}

grpc::ServerUnaryReactor* IndexerService::AppendKeys(grpc::CallbackServerContext* ctx,
                                                     const v1::AppendKeysRequest* req,
                                                     v1::AppendKeysResponse* resp) {
  return Defer(ctx, "AppendKeys", [this, ctx, req, resp](const Caller& caller) {
    absl::StatusOr<engine::StepResult> r =
        engine_->Append(ToEngine(*req, caller.tenant), ControlOf(ctx));
    LogFailure("AppendKeys", r.status());
    if (!r.ok()) return ToGrpcStatus(r.status());
    PutLengths(r->lengths, resp->mutable_lengths());
    resp->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
    resp->set_created(r->created);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::SelectBlocks(grpc::CallbackServerContext* ctx,
                                                       const v1::SelectBlocksRequest* req,
                                                       v1::SelectBlocksResponse* resp) {
  return Defer(ctx, "SelectBlocks", [this, ctx, req, resp](const Caller& caller) {
    absl::StatusOr<engine::StepResult> r =
        engine_->Select(ToEngine(*req, caller.tenant), ControlOf(ctx));
    LogFailure("SelectBlocks", r.status());
    if (!r.ok()) return ToGrpcStatus(r.status());
    ToProto(*r, engine_->config().page_table.pages_per_block, resp);
    return grpc::Status::OK;
  });
}

void IndexerService::RunBatch(grpc::CallbackServerContext* ctx, const Caller& caller,
                              const v1::BatchRequest& req, v1::BatchResponse* resp) {
  std::vector<engine::StepRequest> items;
  items.reserve(req.items_size());
  for (const auto& item : req.items()) items.push_back(ToEngine(item, caller.tenant));
  if (metrics_ != nullptr) metrics_->RecordBatchItems(req.items_size());
  std::vector<absl::StatusOr<engine::StepResult>> results = engine_->Batch(items, ControlOf(ctx));
  resp->set_request_id(req.request_id());
  resp->mutable_results()->Reserve(static_cast<int>(results.size()));
  for (const auto& r : results) {
    v1::BatchItemResult* out = resp->add_results();
    out->set_code(static_cast<int>(r.status().code()));
    if (!r.ok()) {
      out->set_message(std::string(r.status().message()));
      LogFailure("Batch item", r.status());
      continue;
    }
    ToProto(*r, engine_->config().page_table.pages_per_block, out->mutable_result());
  }
}

grpc::ServerUnaryReactor* IndexerService::Batch(grpc::CallbackServerContext* ctx,
                                                const v1::BatchRequest* req,
                                                v1::BatchResponse* resp) {
  return Defer(ctx, "Batch", [this, ctx, req, resp](const Caller& caller) {
    RunBatch(ctx, caller, *req, resp);
    return grpc::Status::OK;
  });
}

// Reads one BatchRequest, answers it, writes the answer, reads the next: answers stay in order
// and each stream has at most one request in the engine at a time.
class IndexerService::BatchStreamReactor final
    : public grpc::ServerBidiReactor<v1::BatchRequest, v1::BatchResponse> {
 public:
  // `caller`: the stream's authenticated caller, or why it was refused (the stream then ends
  // at once with that status).
  BatchStreamReactor(IndexerService* service, grpc::CallbackServerContext* ctx,
                     absl::StatusOr<Caller> caller)
      : service_(service), ctx_(ctx) {
    // Counted until OnDone, so that shutdown waits for the stream's last answer and its status
    // to be sent. A stream opened once shutdown has begun is not admitted, and ends at once.
    tracked_ = service_->tracker_ != nullptr && service_->tracker_->Admit();
    service_->Register(this);  // may Stop() this stream at once when shutting down
    if (service_->tracker_ != nullptr && !tracked_) Stop();
    if (!caller.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FinishLocked(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *std::move(caller);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;  // stopped while the read was pending: nothing is applied
    if (!ok) {  // the client finished sending (or the call ended)
      FinishLocked(grpc::Status::OK);
      return;
    }
    busy_ = true;
    const absl::Time arrived = absl::Now();
    service_->executor_->Submit([this, arrived] {
      const absl::Time started = absl::Now();
      response_.Clear();
      service_->RunBatch(ctx_, caller_, request_, &response_);
      if (service_->metrics_ != nullptr) {
        service_->metrics_->RecordRequest("BatchStream", grpc::StatusCode::OK,
                                          absl::Now() - arrived, started - arrived);
      }
      // Under mu_, like every other step of the stream: the answer written here is then seen to
      // happen before OnWriteDone and the next request's handler (which clears it) by the
      // reactor's own lock, not only through gRPC's internals.
      std::lock_guard<std::mutex> lock(mu_);
      StartWrite(&response_);
    });
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed while writing"));
    } else if (stopping_) {
      FinishLocked(ShuttingDownStatus());
    } else {
      StartRead(&request_);
    }
  }

  // Ends the stream: now when idle, after the answer being written when busy.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (!busy_) FinishLocked(ShuttingDownStatus());
  }

  void OnDone() override {
    service_->Unregister(this);
    if (tracked_) service_->tracker_->Done();
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  IndexerService* service_;
  grpc::CallbackServerContext* ctx_;
  Caller caller_;
  v1::BatchRequest request_;
  v1::BatchResponse response_;
  std::mutex mu_;
  bool busy_ = false;      // a request is in the engine or its answer is being written
  bool stopping_ = false;  // the server is shutting down
  bool finished_ = false;  // Finish was called
  bool tracked_ = false;   // admitted to the service's CallTracker
};

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

grpc::ServerBidiReactor<v1::BatchRequest, v1::BatchResponse>* IndexerService::BatchStream(
    grpc::CallbackServerContext* ctx) {
  return new BatchStreamReactor(this, ctx, CallerOf(*access_, *ctx, "BatchStream"));
}

grpc::ServerUnaryReactor* IndexerService::ReleaseSequence(grpc::CallbackServerContext* ctx,
                                                          const v1::ReleaseSequenceRequest* req,
                                                          v1::ReleaseSequenceResponse* resp) {
  return Defer(ctx, "ReleaseSequence", [this, req, resp](const Caller& caller) {
    absl::StatusOr<int64_t> freed = engine_->Release(req->sequence_id(), caller.tenant);
    if (!freed.ok()) return ToGrpcStatus(freed.status());
    resp->set_pages_freed(static_cast<uint32_t>(*freed));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::TruncateSequence(grpc::CallbackServerContext* ctx,
                                                           const v1::TruncateSequenceRequest* req,
                                                           v1::TruncateSequenceResponse* resp) {
  return Defer(ctx, "TruncateSequence", [this, req, resp](const Caller& caller) {
    absl::StatusOr<engine::TruncateResult> r =
        engine_->Truncate(req->sequence_id(), req->length(), caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    PutLengths(r->lengths, resp->mutable_lengths());
    resp->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
    resp->set_pages_freed(static_cast<uint32_t>(r->pages_freed));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::ForkSequence(grpc::CallbackServerContext* ctx,
                                                       const v1::ForkSequenceRequest* req,
                                                       v1::ForkSequenceResponse* resp) {
  return Defer(ctx, "ForkSequence", [this, req, resp](const Caller& caller) {
    std::optional<int64_t> length;
    if (req->has_length()) length = req->length();
    absl::StatusOr<engine::ForkResult> r =
        engine_->Fork(req->source_id(), req->target_id(), length, caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    PutLengths(r->lengths, resp->mutable_lengths());
    resp->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
    resp->set_pages_shared(static_cast<uint32_t>(r->pages_shared));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::GetSequence(grpc::CallbackServerContext* ctx,
                                                      const v1::GetSequenceRequest* req,
                                                      v1::GetSequenceResponse* resp) {
  return Defer(ctx, "GetSequence", [this, req, resp](const Caller& caller) {
    absl::StatusOr<engine::SequenceInfo> r = engine_->Get(req->sequence_id(), caller.tenant);
    if (!r.ok()) return ToGrpcStatus(r.status());
    resp->set_sequence_id(req->sequence_id());
    PutLengths(r->lengths, resp->mutable_lengths());
    resp->mutable_pages()->Add(r->pages.begin(), r->pages.end());
    resp->mutable_attention_pages()->Add(r->attention_pages.begin(), r->attention_pages.end());
    resp->set_shared_pages(static_cast<uint32_t>(r->shared_pages));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::GetStats(grpc::CallbackServerContext* ctx,
                                                   const v1::GetStatsRequest* /*req*/,
                                                   v1::GetStatsResponse* resp) {
  return Defer(ctx, "GetStats", [this, resp](const Caller& /*caller*/) {
    if (metrics_ == nullptr) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this server keeps no metrics");
    }
    metrics_->Fill(resp);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* IndexerService::ServerInfo(grpc::CallbackServerContext* ctx,
                                                     const v1::ServerInfoRequest* /*req*/,
                                                     v1::ServerInfoResponse* resp) {
  return Defer(ctx, "ServerInfo", [this, resp](const Caller& caller) {
    const engine::EngineConfig& c = engine_->config();
    const engine::EngineStats s = engine_->Stats();
    resp->set_version(version_);
    resp->set_backend(engine_->backend().name());
    resp->set_device(engine_->backend().device());
    resp->set_head_dim(c.head_dim);
    resp->set_layers(c.layers);
    resp->set_key_storage(c.key_storage == kernels::KeyStorage::kBf16 ? v1::KEY_STORAGE_BF16
                                                                      : v1::KEY_STORAGE_FP8_E4M3);
    resp->set_block_size(kernels::kBlockSize);
    resp->set_max_index_heads(c.max_index_heads);
    resp->set_max_topk(c.max_topk);
    resp->set_default_topk(c.defaults.topk);
    resp->set_default_init_blocks(c.defaults.init_blocks);
    resp->set_default_local_blocks(c.defaults.local_blocks);
    resp->set_pages_per_block(c.page_table.pages_per_block);
    resp->set_block_page_stride(c.page_table.block_page_stride);
    resp->set_total_pages(s.total_pages);
    resp->set_free_pages(s.free_pages);
    resp->set_bytes_per_page(c.BytesPerPage());
    resp->set_live_sequences(s.live_sequences);
    resp->set_max_tokens_per_sequence(static_cast<uint32_t>(c.max_tokens_per_sequence));
    resp->set_max_message_bytes(max_message_bytes_);
    resp->set_max_sequences(static_cast<uint64_t>(c.max_sequences));
    const engine::TenantUsage usage = engine_->Usage(caller.tenant);
    resp->set_tenant(caller.tenant);
    resp->set_tenant_pages(static_cast<uint64_t>(usage.pages));
    resp->set_tenant_page_quota(static_cast<uint64_t>(usage.page_quota));
    return grpc::Status::OK;
  });
}

}  // namespace indexer::server
