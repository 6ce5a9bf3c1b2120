#include "server/step_call.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/status_convert.h"

namespace indexer::server {
namespace {

engine::CallControl ControlOf(grpc::CallbackServerContext* ctx) {
  engine::CallControl c;
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) c.deadline = absl::FromChrono(deadline);
  c.cancelled = [ctx] { return ctx->IsCancelled(); };
  return c;
}

void LogFailure(const char* rpc, const absl::Status& s) {
  // Client errors are routine; backend failures are worth a louder line.
  if (s.code() == absl::StatusCode::kInternal) {
    spdlog::error("{} failed: {}", rpc, s.ToString());
  } else if (!s.ok()) {
    spdlog::debug("{} refused: {}", rpc, s.ToString());
  }
}

StepMessage MessageOf(StepRpc rpc) {
  switch (rpc) {
    case StepRpc::kAppendKeys: return StepMessage::kAppendKeys;
    case StepRpc::kSelectBlocks: return StepMessage::kSelectBlocks;
    case StepRpc::kBatch:
    case StepRpc::kBatchStream: return StepMessage::kBatch;
  }
  return StepMessage::kBatch;
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
                   grpc::CallbackServerContext* ctx, grpc::ByteBuffer* answer)
    : rpc_(rpc),
      engine_(services.engine),
      metrics_(services.metrics),
      answer_(answer),
      tenant_(caller.tenant),
      arrived_(absl::Now()),
      control_(ControlOf(ctx)),
      regions_(services.regions, tenant_) {}

absl::StatusOr<std::unique_ptr<StepCall>> StepCall::Parse(StepRpc rpc, const Services& services,
                                                         const Caller& caller,
                                                         grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer& request,
                                                         grpc::ByteBuffer* answer) {
  std::unique_ptr<StepCall> call(new StepCall(rpc, services, caller, ctx, answer));
  const absl::Status status = call->Prepare(request);
  if (!status.ok()) return status;
  return call;
}

void StepCall::ResolveRefs(std::span<const ItemRef> refs) {
  const size_t item = refs.front().item;
  engine::StepRequest& step = wire_.items[item];
  absl::Status& refused = step.refused;
  auto input = [&](const RegionRefView& ref, absl::string_view field, engine::WireDtype dtype,
                   absl::string_view* bytes, int* device) {
    if (!bytes->empty()) {
      refused = absl::InvalidArgumentError(
          absl::StrCat(field, " and its inline bytes are both set; send one of the two"));
      return;
    }
    absl::StatusOr<ResolvedInput> resolved = regions_.Input(item, ref, field);
    if (!resolved.ok()) {
      refused = resolved.status();
      return;
    }
    *bytes = resolved->bytes;
    *device = resolved->device;
    // A pinned system region is read in place by the device where the device can (bf16 at
    // aligned addresses), else on the host like any system region.
    if (*device == engine::kMappedHostTensor &&
        (dtype != engine::WireDtype::kBf16 ||
         reinterpret_cast<uintptr_t>(bytes->data()) % engine::kDeviceTensorAlignment != 0)) {
      *device = engine::kHostTensor;
    }
  };
  auto in_host = [](int device) { return device < 0; };
  bool any_output = false;
  auto output = [&](const RegionRefView& ref, absl::string_view field, std::span<int32_t>* out) {
    absl::StatusOr<ResolvedOutput> resolved = regions_.Output(item, ref, field);
    if (!resolved.ok()) {
      refused = resolved.status();
      return;
    }
    // The three outputs go to one kind of memory: host, or one GPU's.
    if (any_output && resolved->device != step.outputs.device &&
        !(in_host(resolved->device) && in_host(step.outputs.device))) {
      refused = absl::InvalidArgumentError(absl::StrCat(
          field, " is in ", in_host(resolved->device) ? "host memory" : "a CUDA region",
          " and an earlier output reference is not: an item's outputs must all be in system "
          "regions or all in CUDA regions of one GPU"));
      return;
    }
    *out = resolved->values;
    // Host outputs of both kinds together are written on the host.
    step.outputs.device = any_output && resolved->device != step.outputs.device
                              ? engine::kHostTensor
                              : resolved->device;
    any_output = true;
  };
  // Field by field in a fixed order, so that an item with several bad references is refused
  // for the same one however its fields were ordered on the wire.
  for (int f = ItemRef::kKeys; f <= ItemRef::kContextLens && refused.ok(); ++f) {
    const auto named = std::find_if(refs.begin(), refs.end(),
                                    [f](const ItemRef& r) { return r.field == f; });
    if (named == refs.end()) continue;
    const RegionRefView& ref = named->ref;
    switch (named->field) {
      case ItemRef::kKeys:
        input(ref, "keys_ref", step.append->dtype, &step.append->keys, &step.append->keys_device);
        break;
      case ItemRef::kQueries:
        input(ref, "queries_ref", step.query_dtype, &step.queries, &step.queries_device);
        break;
      case ItemRef::kBlockIds: output(ref, "output_refs.block_ids", &step.outputs.block_ids); break;
      case ItemRef::kPageTable:
        output(ref, "output_refs.page_table", &step.outputs.page_table);
        break;
      case ItemRef::kContextLens:
        output(ref, "output_refs.context_lens", &step.outputs.context_lens);
        break;
    }
  }
  PlaceOutputs(step);
}

void StepCall::PlaceOutputs(engine::StepRequest& step) {
  // The device writes pinned host outputs in place only when it writes all three (the rule for
  // device-written outputs); otherwise they are written on the host.
  engine::ProvidedOutputs& o = step.outputs;
  if (o.device == engine::kMappedHostTensor &&
      (o.block_ids.empty() || o.page_table.empty() || o.context_lens.empty())) {
    o.device = engine::kHostTensor;
  }
}

void StepCall::RefuseConflicts() {
  for (auto& [item, status] : regions_.Conflicts()) {
    if (wire_.items[item].refused.ok()) wire_.items[item].refused = std::move(status);
  }
}

absl::StatusOr<absl::string_view> StepCall::HoldBytes(const grpc::ByteBuffer& request) {
  if (!request.Valid() || request.Length() == 0) return absl::string_view();
  // A message gRPC received in pieces is copied once into one; most decode steps arrive whole.
  if (!request.TrySingleSlice(&request_bytes_).ok() &&
      !request.DumpToSingleSlice(&request_bytes_).ok()) {
    return absl::InvalidArgumentError("the request's bytes could not be read");
  }
  return absl::string_view(reinterpret_cast<const char*>(request_bytes_.begin()),
                           request_bytes_.size());
}

absl::Status StepCall::Prepare(const grpc::ByteBuffer& request) {
  absl::Status parsed;
  absl::StatusOr<absl::string_view> bytes = HoldBytes(request);
  parsed = bytes.ok() ? ReadStepRequest(MessageOf(rpc_), *bytes, tenant_, &wire_) : bytes.status();
  if (parsed.ok() && rpc_ == StepRpc::kSelectBlocks && wire_.items[0].queries.empty() &&
      std::none_of(wire_.refs.begin(), wire_.refs.end(),
                   [](const ItemRef& r) { return r.field == ItemRef::kQueries; })) {
    parsed = absl::InvalidArgumentError("queries is empty; a selection needs at least one token");
  }
  if (parsed.ok()) {
    const std::span<const ItemRef> refs(wire_.refs);
    for (size_t begin = 0, end = 0; begin < refs.size(); begin = end) {
      while (end < refs.size() && refs[end].item == refs[begin].item) ++end;
      ResolveRefs(refs.subspan(begin, end - begin));
    }
    RefuseConflicts();
    MakeAnswer(bytes->size());
  }
  parse_ = absl::Now() - arrived_;
  return parsed;
}

void StepCall::MakeAnswer(size_t request_bytes) {
  const size_t items = wire_.items.size();
  // A decode step's outputs take less than half its request's bytes (the keys and queries).
  reply_.emplace(MessageOf(rpc_), items, wire_.request_id, request_bytes / 2 + 4096);
  if (metrics_ != nullptr && (rpc_ == StepRpc::kBatch || rpc_ == StepRpc::kBatchStream)) {
    metrics_->RecordBatchItems(static_cast<int>(items));
  }
}

void StepCall::Run(Done done) {
  done_ = std::move(done);
  engine_->BatchAsync(
      wire_.items, control_, this,
      [this](absl::Status status, std::vector<absl::StatusOr<engine::StepResult>> results) {
        OnEnd(std::move(status), std::move(results));
      });
}

bool StepCall::KeepLengths(size_t item, std::span<const int64_t> lengths) {
  reply_->KeepLengths(item, lengths);
  return true;
}

engine::SelectOutputs StepCall::Allocate(size_t item, const engine::SelectShape& shape) {
  return reply_->Allocate(item, shape);
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
  if (rpc_ == StepRpc::kAppendKeys || rpc_ == StepRpc::kSelectBlocks) {
    const absl::StatusOr<engine::StepResult>& r = results[0];
    LogFailure(StepRpcName(rpc_), r.status());
    if (!r.ok()) return ToGrpcStatus(r.status());
    reply_->Succeeded(0, *r, pages_per_block);
  } else {
    for (size_t i = 0; i < results.size(); ++i) {
      const absl::StatusOr<engine::StepResult>& r = results[i];
      if (r.ok()) {
        reply_->Succeeded(i, *r, pages_per_block);
      } else {
        reply_->Failed(i, r.status());
        LogFailure("Batch item", r.status());
      }
    }
  }
  reply_->Write(answer_);
  return grpc::Status::OK;
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
