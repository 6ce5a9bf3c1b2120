#include "server/step_call.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/status_convert.h"
#include "server/wire_messages.h"

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

engine::AppendRequest ToEngine(const v1::AppendKeysRequest& r, absl::string_view tenant) {
  engine::AppendRequest a;
  a.tenant = tenant;
  a.sequence_id = r.sequence_id();
  a.layer = r.layer();
  a.all_layers = r.all_layers();
  a.dtype = FromProto(r.dtype());
  a.keys = r.keys();
  a.attention_pages = std::span<const int32_t>(r.attention_pages().data(), r.attention_pages_size());
  if (r.has_num_tokens()) a.num_tokens = r.num_tokens();
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
  if (r.has_num_tokens()) s.num_tokens = r.num_tokens();
  return s;
}

engine::CallControl ControlOf(grpc::CallbackServerContext* ctx) {
  engine::CallControl c;
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) c.deadline = absl::FromChrono(deadline);
  c.cancelled = [ctx] { return ctx->IsCancelled(); };
  return c;
}

template <typename Repeated>
void PutLengths(std::span<const int64_t> lengths, Repeated* out) {
  out->Clear();
  out->Reserve(static_cast<int>(lengths.size()));
  for (int64_t l : lengths) out->Add(static_cast<uint32_t>(l));
}

// Everything of a selection's answer but its outputs and lengths (which the engine wrote in
// place, StepCall being its OutputSink).
void PutSelection(const engine::StepResult& r, int pages_per_block, v1::SelectBlocksResponse* out) {
  out->set_num_tokens(r.num_tokens);
  out->set_num_heads(r.num_heads);
  out->set_topk(r.topk);
  out->set_start_position(r.start_position);
  if (r.has_page_table) out->set_pages_per_block(pages_per_block);
}

void LogFailure(const char* rpc, const absl::Status& s) {
  // Client errors are routine; backend failures are worth a louder line.
  if (s.code() == absl::StatusCode::kInternal) {
    spdlog::error("{} failed: {}", rpc, s.ToString());
  } else if (!s.ok()) {
    spdlog::debug("{} refused: {}", rpc, s.ToString());
  }
}

// An int32 output of `values` values in a bytes field.
int32_t* Int32s(std::string* bytes, int64_t values) {
  if (values == 0) return nullptr;
  bytes->resize(static_cast<size_t>(values) * sizeof(int32_t));
  return reinterpret_cast<int32_t*>(bytes->data());
}

google::protobuf::ArenaOptions ArenaFor(const grpc::ByteBuffer& request) {
  google::protobuf::ArenaOptions o;
  // The request's fields and the answer's messages in one block for a decode step.
  o.start_block_size = std::clamp<size_t>(request.Length() + 4096, 4096, size_t{1} << 20);
  o.max_block_size = size_t{1} << 22;
  return o;
}

}  // namespace

const char* StepRpcName(StepRpc rpc) {
  switch (rpc) {
    case StepRpc::kAppendKeys: return "AppendKeys";
    case StepRpc::kSelectBlocks: return "SelectBlocks";
    case StepRpc::kBatch: return "Batch";
    case StepRpc::kBatchStream: return "BatchStream";
  }
  return "?";
}

StepCall::StepCall(StepRpc rpc, const Services& services, const Caller& caller,
                   grpc::CallbackServerContext* ctx, const grpc::ByteBuffer& request,
                   grpc::ByteBuffer* answer)
    : rpc_(rpc),
      engine_(services.engine),
      metrics_(services.metrics),
      answer_(answer),
      tenant_(caller.tenant),
      arrived_(absl::Now()),
      arena_(ArenaFor(request)),
      control_(ControlOf(ctx)),
      regions_(services.regions, tenant_) {}

absl::StatusOr<std::unique_ptr<StepCall>> StepCall::Parse(StepRpc rpc, const Services& services,
                                                         const Caller& caller,
                                                         grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer& request,
                                                         grpc::ByteBuffer* answer) {
  std::unique_ptr<StepCall> call(new StepCall(rpc, services, caller, ctx, request, answer));
  const absl::Status status = call->Prepare(request);
  if (!status.ok()) return status;
  return call;
}

void StepCall::ResolveRefs(size_t item, const v1::SelectBlocksRequest* select,
                           const v1::AppendKeysRequest* append) {
  engine::StepRequest& step = items_[item];
  absl::Status& refused = step.refused;
  auto input = [&](const v1::RegionRef& ref, absl::string_view inline_bytes, absl::string_view field,
                   absl::string_view* out) {
    if (!refused.ok()) return;
    if (!inline_bytes.empty()) {
      refused = absl::InvalidArgumentError(
          absl::StrCat(field, " and its inline bytes are both set; send one of the two"));
      return;
    }
    absl::StatusOr<absl::string_view> bytes = regions_.Input(item, ref, field);
    if (bytes.ok()) *out = *bytes;
    else refused = bytes.status();
  };
  auto output = [&](const v1::RegionRef& ref, absl::string_view field, std::span<int32_t>* out) {
    if (!refused.ok()) return;
    absl::StatusOr<std::span<int32_t>> values = regions_.Output(item, ref, field);
    if (values.ok()) *out = *values;
    else refused = values.status();
  };
  if (append != nullptr && append->has_keys_ref()) {
    input(append->keys_ref(), append->keys(), "keys_ref", &step.append->keys);
  }
  if (select == nullptr) return;
  if (select->has_queries_ref()) {
    input(select->queries_ref(), select->queries(), "queries_ref", &step.queries);
  }
  if (!select->has_output_refs()) return;
  const v1::SelectOutputRefs& refs = select->output_refs();
  engine::ProvidedOutputs& outputs = step.outputs;
  if (refs.has_block_ids()) output(refs.block_ids(), "output_refs.block_ids", &outputs.block_ids);
  if (refs.has_page_table()) output(refs.page_table(), "output_refs.page_table", &outputs.page_table);
  if (refs.has_context_lens()) {
    output(refs.context_lens(), "output_refs.context_lens", &outputs.context_lens);
  }
}

void StepCall::RefuseConflicts() {
  for (auto& [item, status] : regions_.Conflicts()) {
    if (items_[item].refused.ok()) items_[item].refused = std::move(status);
  }
}

absl::Status StepCall::Prepare(const grpc::ByteBuffer& request) {
  absl::Status parsed;
  switch (rpc_) {
    case StepRpc::kAppendKeys: {
      append_request_ = google::protobuf::Arena::CreateMessage<v1::AppendKeysRequest>(&arena_);
      parsed = ParseMessage(request, append_request_);
      if (!parsed.ok()) break;
      engine::StepRequest& step = items_.emplace_back();
      step.tenant = tenant_;
      step.sequence_id = append_request_->sequence_id();
      step.layer = append_request_->all_layers() ? 0 : append_request_->layer();
      step.append = ToEngine(*append_request_, tenant_);
      ResolveRefs(0, nullptr, append_request_);
      append_response_ = google::protobuf::Arena::CreateMessage<v1::AppendKeysResponse>(&arena_);
      break;
    }
    case StepRpc::kSelectBlocks: {
      select_request_ = google::protobuf::Arena::CreateMessage<v1::SelectBlocksRequest>(&arena_);
      parsed = ParseMessage(request, select_request_);
      if (!parsed.ok()) break;
      if (select_request_->queries().empty() && !select_request_->has_queries_ref()) {
        parsed = absl::InvalidArgumentError("queries is empty; a selection needs at least one token");
        break;
      }
      items_.push_back(ToEngine(*select_request_, tenant_));
      ResolveRefs(0, select_request_, select_request_->has_append() ? &select_request_->append()
                                                                    : nullptr);
      select_response_ = google::protobuf::Arena::CreateMessage<v1::SelectBlocksResponse>(&arena_);
      break;
    }
    case StepRpc::kBatch:
    case StepRpc::kBatchStream: {
      batch_request_ = google::protobuf::Arena::CreateMessage<v1::BatchRequest>(&arena_);
      parsed = ParseMessage(request, batch_request_);
      if (!parsed.ok()) break;
      items_.reserve(batch_request_->items_size());
      for (const v1::SelectBlocksRequest& item : batch_request_->items()) {
        items_.push_back(ToEngine(item, tenant_));
        ResolveRefs(items_.size() - 1, &item, item.has_append() ? &item.append() : nullptr);
      }
      batch_response_ = google::protobuf::Arena::CreateMessage<v1::BatchResponse>(&arena_);
      batch_response_->set_request_id(batch_request_->request_id());
      batch_response_->mutable_results()->Reserve(batch_request_->items_size());
      for (int i = 0; i < batch_request_->items_size(); ++i) batch_response_->add_results();
      if (metrics_ != nullptr) metrics_->RecordBatchItems(batch_request_->items_size());
      break;
    }
  }
  if (parsed.ok()) RefuseConflicts();
  parse_ = absl::Now() - arrived_;
  return parsed;
}

void StepCall::Run(Done done) {
  done_ = std::move(done);
  engine_->BatchAsync(
      items_, control_, this,
      [this](absl::Status status, std::vector<absl::StatusOr<engine::StepResult>> results) {
        OnEnd(std::move(status), std::move(results));
      });
}

v1::SelectBlocksResponse* StepCall::ResultOf(size_t item) {
  return batch_response_ != nullptr
             ? batch_response_->mutable_results(static_cast<int>(item))->mutable_result()
             : select_response_;
}

bool StepCall::KeepLengths(size_t item, std::span<const int64_t> lengths) {
  if (append_response_ != nullptr) {
    PutLengths(lengths, append_response_->mutable_lengths());
  } else {
    PutLengths(lengths, ResultOf(item)->mutable_lengths());
  }
  return true;
}

engine::SelectOutputs StepCall::Allocate(size_t item, const engine::SelectShape& shape) {
  v1::SelectBlocksResponse* r = ResultOf(item);
  return engine::SelectOutputs{Int32s(r->mutable_block_ids(), shape.block_ids),
                               Int32s(r->mutable_page_table(), shape.page_table),
                               Int32s(r->mutable_context_lens(), shape.context_lens)};
}

void StepCall::OnEnd(absl::Status call, std::vector<absl::StatusOr<engine::StepResult>> results) {
  const absl::Time start = absl::Now();
  grpc::Status status = call.ok() ? Answer(results) : ToGrpcStatus(call);
  if (!call.ok()) LogFailure(StepRpcName(rpc_), call);
  if (metrics_ != nullptr) metrics_->RecordServerPhases(parse_, absl::Now() - start);
  End(std::move(status));
}

grpc::Status StepCall::Answer(std::vector<absl::StatusOr<engine::StepResult>>& results) {
  const int pages_per_block = engine_->config().page_table.pages_per_block;
  switch (rpc_) {
    case StepRpc::kAppendKeys: {
      const absl::StatusOr<engine::StepResult>& r = results[0];
      LogFailure("AppendKeys", r.status());
      if (!r.ok()) return ToGrpcStatus(r.status());
      append_response_->set_num_blocks(static_cast<uint32_t>(r->num_blocks));
      append_response_->set_created(r->created);
      SerializeMessage(*append_response_, answer_);
      return grpc::Status::OK;
    }
    case StepRpc::kSelectBlocks: {
      const absl::StatusOr<engine::StepResult>& r = results[0];
      LogFailure("SelectBlocks", r.status());
      if (!r.ok()) return ToGrpcStatus(r.status());
      PutSelection(*r, pages_per_block, select_response_);
      SerializeMessage(*select_response_, answer_);
      return grpc::Status::OK;
    }
    case StepRpc::kBatch:
    case StepRpc::kBatchStream: {
      for (size_t i = 0; i < results.size(); ++i) {
        v1::BatchItemResult* out = batch_response_->mutable_results(static_cast<int>(i));
        const absl::StatusOr<engine::StepResult>& r = results[i];
        out->set_code(static_cast<int>(r.status().code()));
        if (!r.ok()) {
          out->clear_result();  // outputs given before a roll-back
          out->set_message(std::string(r.status().message()));
          LogFailure("Batch item", r.status());
          continue;
        }
        PutSelection(*r, pages_per_block, out->mutable_result());
      }
      SerializeMessage(*batch_response_, answer_);
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, "unknown call");
}

void StepCall::RecordRefused(ServiceMetrics* metrics, StepRpc rpc, const grpc::Status& status,
                             absl::Time arrived) {
  if (metrics != nullptr) {
    metrics->RecordRequest(StepRpcName(rpc), status.error_code(), absl::Now() - arrived,
                           absl::ZeroDuration());
  }
}

void StepCall::End(grpc::Status status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest(StepRpcName(rpc_), status.error_code(), absl::Now() - arrived_,
                            absl::ZeroDuration());
  }
  Done done = std::move(done_);
  std::move(done)(std::move(status));  // may delete this
}

}  // namespace indexer::server
