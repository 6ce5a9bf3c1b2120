#include "client/cpp/indexer_client.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/numeric.h"

namespace indexer::client {

static_assert(std::endian::native == std::endian::little,
              "wire tensors are little-endian; a big-endian host needs byte swaps here");

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // absl and gRPC share the canonical code numbering (0..16).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status ItemStatus(const v1::BatchItemResult& item) {
  if (item.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(item.code()), item.message());
}

// ---------------------------------------------------------------------------------------------
// Wire tensors.

std::string PackBf16(std::span<const float> values) {
  std::string out(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = kernels::FloatToBf16(values[i]);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

std::string PackBf16Bits(std::span<const uint16_t> bits) {
  return std::string(reinterpret_cast<const char*>(bits.data()), bits.size() * 2);
}

std::string PackFp32(std::span<const float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

absl::StatusOr<std::string> PackValues(std::span<const float> values, v1::ValueDtype dtype) {
  switch (dtype) {
    case v1::VALUE_DTYPE_BF16: return PackBf16(values);
    case v1::VALUE_DTYPE_FP32: return PackFp32(values);
    default: return absl::InvalidArgumentError("dtype must be VALUE_DTYPE_BF16 or VALUE_DTYPE_FP32");
  }
}

absl::StatusOr<std::vector<int32_t>> UnpackInt32(absl::string_view bytes, absl::string_view field) {
  if (bytes.size() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", bytes.size(), " bytes, not a multiple of 4 (int32)"));
  }
  std::vector<int32_t> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

float Bf16BitsToFloat(uint16_t bits) { return kernels::Bf16ToFloat(bits); }
float RoundToBf16(float f) { return kernels::Bf16ToFloat(kernels::FloatToBf16(f)); }

absl::StatusOr<Selection> ParseSelection(const v1::SelectBlocksResponse& r) {
  return ParseSelection(r, OutputsInMemory{});
}

absl::StatusOr<Selection> ParseSelection(const v1::SelectBlocksResponse& r,
                                         const OutputsInMemory& outputs) {
  Selection s;
  s.num_tokens = static_cast<int>(r.num_tokens());
  s.num_heads = static_cast<int>(r.num_heads());
  s.topk = static_cast<int>(r.topk());
  s.start_position = r.start_position();
  s.pages_per_block = static_cast<int>(r.pages_per_block());
  s.lengths.assign(r.lengths().begin(), r.lengths().end());
  const size_t rows = static_cast<size_t>(s.num_tokens) * s.num_heads;
  const size_t width = static_cast<size_t>(s.topk) * s.pages_per_block;
  // Outputs in memory are viewed as the bytes they would have been inline.
  auto field = [](const int32_t* memory, size_t values, const std::string& inline_bytes) {
    if (memory == nullptr) return absl::string_view(inline_bytes);
    return absl::string_view(reinterpret_cast<const char*>(memory), values * sizeof(int32_t));
  };
  const bool has_table = s.pages_per_block > 0;  // set only when the sequence has attention pages
  absl::StatusOr<std::vector<int32_t>> ids =
      UnpackInt32(field(outputs.block_ids, rows * s.topk, r.block_ids()), "block_ids");
  if (!ids.ok()) return ids.status();
  if (ids->size() != rows * s.topk) {
    return absl::InvalidArgumentError(absl::StrCat("block_ids holds ", ids->size(),
                                                   " ids; the shape [", s.num_tokens, "][",
                                                   s.num_heads, "][", s.topk, "] needs ",
                                                   rows * s.topk));
  }
  s.block_ids = std::move(*ids);
  const absl::string_view page_table =
      has_table ? field(outputs.page_table, rows * width, r.page_table()) : r.page_table();
  const absl::string_view context_lens =
      has_table ? field(outputs.context_lens, rows, r.context_lens()) : r.context_lens();
  if (!page_table.empty() || !context_lens.empty()) {
    absl::StatusOr<std::vector<int32_t>> table = UnpackInt32(page_table, "page_table");
    if (!table.ok()) return table.status();
    absl::StatusOr<std::vector<int32_t>> lens = UnpackInt32(context_lens, "context_lens");
    if (!lens.ok()) return lens.status();
    if (table->size() != rows * width || lens->size() != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_table holds ", table->size(), " and context_lens ", lens->size(),
          " entries; the shape needs ", rows * width, " and ", rows));
    }
    s.page_table = std::move(*table);
    s.context_lens = std::move(*lens);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Request builders.

v1::AppendKeysRequest MakeAppend(absl::string_view sequence_id, uint32_t layer,
                                 std::span<const float> keys, v1::ValueDtype dtype) {
  v1::AppendKeysRequest r;
  r.set_sequence_id(std::string(sequence_id));
  r.set_layer(layer);
  r.set_dtype(dtype);
  r.set_keys(dtype == v1::VALUE_DTYPE_FP32 ? PackFp32(keys) : PackBf16(keys));
  return r;
}

v1::AppendKeysRequest MakeAppendAllLayers(absl::string_view sequence_id,
                                          std::span<const float> keys, v1::ValueDtype dtype) {
  v1::AppendKeysRequest r = MakeAppend(sequence_id, 0, keys, dtype);
  r.set_all_layers(true);
  return r;
}

v1::SelectBlocksRequest MakeSelect(absl::string_view sequence_id, uint32_t layer,
                                   uint32_t num_heads, std::span<const float> queries,
                                   v1::ValueDtype dtype) {
  v1::SelectBlocksRequest r;
  r.set_sequence_id(std::string(sequence_id));
  r.set_layer(layer);
  r.set_num_heads(num_heads);
  r.set_query_dtype(dtype);
  r.set_queries(dtype == v1::VALUE_DTYPE_FP32 ? PackFp32(queries) : PackBf16(queries));
  return r;
}

v1::AppendKeysRequest MakeAppend(absl::string_view sequence_id, uint32_t layer,
                                 uint32_t num_tokens, std::span<const float> keys,
                                 v1::ValueDtype dtype) {
  v1::AppendKeysRequest r = MakeAppend(sequence_id, layer, keys, dtype);
  r.set_num_tokens(num_tokens);
  return r;
}

v1::AppendKeysRequest MakeAppendAllLayers(absl::string_view sequence_id, uint32_t num_tokens,
                                          std::span<const float> keys, v1::ValueDtype dtype) {
  v1::AppendKeysRequest r = MakeAppendAllLayers(sequence_id, keys, dtype);
  r.set_num_tokens(num_tokens);
  return r;
}

v1::SelectBlocksRequest MakeSelect(absl::string_view sequence_id, uint32_t layer,
                                   uint32_t num_heads, uint32_t num_tokens,
                                   std::span<const float> queries, v1::ValueDtype dtype) {
  v1::SelectBlocksRequest r = MakeSelect(sequence_id, layer, num_heads, queries, dtype);
  r.set_num_tokens(num_tokens);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Shape checks.

ServerShapes ShapesOf(const v1::ServerInfoResponse& info) {
  return ServerShapes{info.head_dim(), info.layers()};
}

namespace {

// Bytes of one value on the wire; 0 for a dtype the server refuses (it says so itself).
size_t WireBytes(v1::ValueDtype dtype) {
  if (dtype == v1::VALUE_DTYPE_BF16) return 2;
  if (dtype == v1::VALUE_DTYPE_FP32) return 4;
  return 0;
}

// When a count is declared, `bytes` must be `declared` rows of `row` values (`layout` names
// them). Without one there is nothing the server would not say better itself.
absl::Status CheckRows(absl::string_view field, size_t bytes, size_t value_bytes, size_t row,
                       absl::string_view layout, bool has_declared, uint32_t declared) {
  if (!has_declared || value_bytes == 0 || row == 0) return absl::OkStatus();
  const size_t values = bytes / value_bytes;
  const bool whole = bytes % value_bytes == 0 && values % row == 0;
  if (whole && values / row == declared) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " holds ", values, " values and num_tokens says ", declared,
      ", but the server's tokens are ", layout,
      " = ", row, " values each: ", field, " must hold num_tokens x ", row,
      " values (check the array's shape and the model's head_dim)"));
}

}  // namespace

absl::Status CheckShapes(const ServerShapes& shapes, const v1::AppendKeysRequest& r) {
  const size_t layers = r.all_layers() ? shapes.layers : 1;
  const std::string layout = r.all_layers()
                                 ? absl::StrCat("[layers ", shapes.layers, "][head_dim ",
                                                shapes.head_dim, "]")
                                 : absl::StrCat("[head_dim ", shapes.head_dim, "]");
  if (r.has_keys_ref()) {
    return CheckRows("keys_ref", r.keys_ref().byte_size(), WireBytes(r.dtype()),
                     layers * shapes.head_dim, layout, r.has_num_tokens(), r.num_tokens());
  }
  return CheckRows("keys", r.keys().size(), WireBytes(r.dtype()), layers * shapes.head_dim,
                   layout, r.has_num_tokens(), r.num_tokens());
}

absl::Status CheckShapes(const ServerShapes& shapes, const v1::SelectBlocksRequest& r) {
  if (r.has_append()) {
    if (absl::Status s = CheckShapes(shapes, r.append()); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("append: ", s.message()));
    }
  }
  if (r.queries().empty() && !r.has_queries_ref()) return absl::OkStatus();
  const std::string layout = absl::StrCat("[num_heads ", r.num_heads(), "][head_dim ",
                                          shapes.head_dim, "]");
  const bool by_ref = r.has_queries_ref();
  return CheckRows(by_ref ? "queries_ref" : "queries",
                   by_ref ? r.queries_ref().byte_size() : r.queries().size(),
                   WireBytes(r.query_dtype()),
                   size_t{r.num_heads()} * shapes.head_dim, layout, r.has_num_tokens(),
                   r.num_tokens());
}

absl::Status CheckShapes(const ServerShapes& shapes, const v1::BatchRequest& r) {
  for (int i = 0; i < r.items_size(); ++i) {
    if (absl::Status s = CheckShapes(shapes, r.items(i)); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The client.

const char* HealthStatusName(HealthStatus s) {
  switch (s) {
    case HealthStatus::kServing: return "SERVING";
    case HealthStatus::kNotServing: return "NOT_SERVING";
    case HealthStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path, " (missing, empty or unreadable)"));
  }
  return text.str();
}

IndexerClient::IndexerClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      options_(options),
      stub_(v1::Indexer::NewStub(channel_)),
      admin_stub_(v1::IndexerAdmin::NewStub(channel_)) {}

IndexerClient::~IndexerClient() = default;

absl::StatusOr<std::unique_ptr<IndexerClient>> IndexerClient::Connect(absl::string_view target,
                                                                      ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("the server address is empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  args.SetMaxSendMessageSize(-1);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.UsesTls()) {
    if (options.tls_cert_chain_pem.empty() != options.tls_private_key_pem.empty()) {
      return absl::InvalidArgumentError(
          "a client certificate needs its private key and a key its certificate: give both");
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_chain_pem;
    ssl.pem_private_key = options.tls_private_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(std::string(target), credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make a channel to '", target, "'"));
  }
  return std::make_unique<IndexerClient>(std::move(channel), options);
}

void IndexerClient::Prepare(grpc::ClientContext* context, const CallOptions& call) const {
  absl::Time deadline;
  if (call.deadline) {
    deadline = *call.deadline;
  } else {
    deadline = absl::Now() + call.timeout.value_or(options_.default_timeout);
  }
  context->set_deadline(absl::ToChronoTime(deadline));
  context->set_wait_for_ready(call.wait_for_ready);
  Authorize(context);
}

void IndexerClient::Authorize(grpc::ClientContext* context) const {
  // Metadata rather than grpc::AccessTokenCredentials, which gRPC refuses to send over an
  // insecure channel: a token over plain loopback (or behind a TLS-terminating proxy) must work.
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

namespace {

// The sequence a call is about, sent as `x-sequence-id` metadata so that a proxy (nginx, Envoy)
// can route every call of a sequence to the server holding it (docs/DEPLOY.md). Empty when the
// call is not about one sequence.
const std::string& RoutingKey(const v1::AppendKeysRequest& r) { return r.sequence_id(); }
const std::string& RoutingKey(const v1::SelectBlocksRequest& r) { return r.sequence_id(); }
const std::string& RoutingKey(const v1::ReleaseSequenceRequest& r) { return r.sequence_id(); }
const std::string& RoutingKey(const v1::TruncateSequenceRequest& r) { return r.sequence_id(); }
const std::string& RoutingKey(const v1::ForkSequenceRequest& r) { return r.source_id(); }
const std::string& RoutingKey(const v1::GetSequenceRequest& r) { return r.sequence_id(); }
const std::string& RoutingKey(const v1::BatchRequest& r) {
  static const std::string kNone;
  // A batch of one sequence routes like that sequence; a mixed batch needs client-side hashing.
  if (r.items_size() == 0) return kNone;
  for (const auto& item : r.items()) {
    if (item.sequence_id() != r.items(0).sequence_id()) return kNone;
  }
  return r.items(0).sequence_id();
}
// Calls about no sequence (ServerInfo, GetStats, the region calls).
template <typename Request>
const std::string& RoutingKey(const Request&) {
  static const std::string kNone;
  return kNone;
}

// Metadata values must be printable ASCII; ids that are not cannot be routed by a proxy.
bool PrintableAscii(const std::string& s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

}  // namespace

template <typename Request, typename Response>
absl::StatusOr<Response> IndexerClient::Call(
    grpc::Status (v1::Indexer::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(&context, call);
  const std::string& key = RoutingKey(request);
  if (!key.empty() && PrintableAscii(key)) context.AddMetadata("x-sequence-id", key);
  Response response;
  const grpc::Status status = (stub_.get()->*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

std::optional<ServerShapes> IndexerClient::ShapesToCheck(const CallOptions& call) {
  if (!options_.check_shapes) return std::nullopt;
  {
    std::lock_guard<std::mutex> lock(shapes_mu_);
    if (shapes_) return shapes_;
  }
  absl::StatusOr<v1::ServerInfoResponse> info = ServerInfo(call);
  if (!info.ok()) return std::nullopt;  // unchecked this time; the server still checks
  std::lock_guard<std::mutex> lock(shapes_mu_);
  shapes_ = ShapesOf(*info);
  return shapes_;
}

template <typename Request>
absl::Status IndexerClient::CheckBeforeSending(const Request& request, const CallOptions& call) {
  const std::optional<ServerShapes> shapes = ShapesToCheck(call);
  return shapes ? CheckShapes(*shapes, request) : absl::OkStatus();
}

absl::StatusOr<v1::AppendKeysResponse> IndexerClient::AppendKeys(
    const v1::AppendKeysRequest& request, const CallOptions& call) {
  if (absl::Status s = CheckBeforeSending(request, call); !s.ok()) return s;
  return Call(&v1::Indexer::Stub::AppendKeys, request, call);
}

absl::StatusOr<v1::SelectBlocksResponse> IndexerClient::SelectBlocks(
    const v1::SelectBlocksRequest& request, const CallOptions& call) {
  if (absl::Status s = CheckBeforeSending(request, call); !s.ok()) return s;
  return Call(&v1::Indexer::Stub::SelectBlocks, request, call);
}

absl::StatusOr<v1::BatchResponse> IndexerClient::Batch(const v1::BatchRequest& request,
                                                       const CallOptions& call) {
  if (absl::Status s = CheckBeforeSending(request, call); !s.ok()) return s;
  return Call(&v1::Indexer::Stub::Batch, request, call);
}

absl::StatusOr<v1::ReleaseSequenceResponse> IndexerClient::ReleaseSequence(
    absl::string_view sequence_id, const CallOptions& call) {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  return Call(&v1::Indexer::Stub::ReleaseSequence, request, call);
}

absl::StatusOr<v1::TruncateSequenceResponse> IndexerClient::TruncateSequence(
    absl::string_view sequence_id, uint32_t length, const CallOptions& call) {
  v1::TruncateSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  request.set_length(length);
  return Call(&v1::Indexer::Stub::TruncateSequence, request, call);
}

absl::StatusOr<v1::ForkSequenceResponse> IndexerClient::ForkSequence(
    absl::string_view source_id, absl::string_view target_id, std::optional<uint32_t> length,
    const CallOptions& call) {
  v1::ForkSequenceRequest request;
  request.set_source_id(std::string(source_id));
  request.set_target_id(std::string(target_id));
  if (length) request.set_length(*length);
  return Call(&v1::Indexer::Stub::ForkSequence, request, call);
}

absl::StatusOr<v1::GetSequenceResponse> IndexerClient::GetSequence(absl::string_view sequence_id,
                                                                   const CallOptions& call) {
  v1::GetSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  return Call(&v1::Indexer::Stub::GetSequence, request, call);
}

absl::StatusOr<v1::ServerInfoResponse> IndexerClient::ServerInfo(const CallOptions& call) {
  v1::ServerInfoRequest request;
  return Call(&v1::Indexer::Stub::ServerInfo, request, call);
}

absl::StatusOr<v1::GetStatsResponse> IndexerClient::GetStats(const CallOptions& call) {
  v1::GetStatsRequest request;
  return Call(&v1::Indexer::Stub::GetStats, request, call);
}

absl::StatusOr<v1::SnapshotResponse> IndexerClient::Snapshot(absl::string_view name,
                                                            const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(&context, call);
  v1::SnapshotRequest request;
  request.set_name(std::string(name));
  v1::SnapshotResponse response;
  const grpc::Status status = admin_stub_->Snapshot(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status IndexerClient::RegisterSystemRegion(absl::string_view name, absl::string_view key,
                                                 uint64_t offset, uint64_t byte_size,
                                                 const CallOptions& call) {
  v1::RegisterSystemRegionRequest request;
  request.set_name(std::string(name));
  request.set_key(std::string(key));
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Call(&v1::Indexer::Stub::RegisterSystemRegion, request, call).status();
}

absl::Status IndexerClient::RegisterCudaRegion(absl::string_view name,
                                               absl::string_view raw_handle, int device_id,
                                               uint64_t offset, uint64_t byte_size,
                                               const CallOptions& call) {
  v1::RegisterCudaRegionRequest request;
  request.set_name(std::string(name));
  request.set_raw_handle(std::string(raw_handle));
  request.set_device_id(device_id);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Call(&v1::Indexer::Stub::RegisterCudaRegion, request, call).status();
}

absl::StatusOr<uint32_t> IndexerClient::UnregisterRegion(absl::string_view name,
                                                         const CallOptions& call) {
  v1::UnregisterRegionRequest request;
  request.set_name(std::string(name));
  absl::StatusOr<v1::UnregisterRegionResponse> r =
      Call(&v1::Indexer::Stub::UnregisterRegion, request, call);
  if (!r.ok()) return r.status();
  return r->unregistered();
}

absl::StatusOr<v1::ListRegionsResponse> IndexerClient::ListRegions(absl::string_view name,
                                                                   const CallOptions& call) {
  v1::ListRegionsRequest request;
  request.set_name(std::string(name));
  return Call(&v1::Indexer::Stub::ListRegions, request, call);
}

absl::StatusOr<Selection> IndexerClient::Select(const v1::SelectBlocksRequest& request,
                                                const CallOptions& call) {
  absl::StatusOr<v1::SelectBlocksResponse> response = SelectBlocks(request, call);
  if (!response.ok()) return response.status();
  return ParseSelection(*response);
}

absl::StatusOr<HealthStatus> IndexerClient::Health(absl::string_view service,
                                                   const CallOptions& call) {
  // The stub is a few method descriptors; making one per call keeps the generated health
  // headers out of ours.
  std::unique_ptr<grpc::health::v1::Health::Stub> stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  Prepare(&context, call);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  switch (response.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING: return HealthStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING: return HealthStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN: return HealthStatus::kServiceUnknown;
    default: return HealthStatus::kUnknown;
  }
}

namespace {
// A wait to the millisecond ("1s", not the "999.999219ms" left of a caller's deadline).
std::string FormatWait(absl::Duration d) {
  return absl::FormatDuration(absl::Milliseconds(std::llround(absl::ToDoubleMilliseconds(d))));
}
}  // namespace

absl::Status IndexerClient::WaitUntilServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("the server did not answer health checks");
  while (absl::Now() < deadline) {
    CallOptions call;
    call.deadline = std::min(deadline, absl::Now() + absl::Seconds(1));
    absl::StatusOr<HealthStatus> health = Health("", call);
    if (health.ok() && *health == HealthStatus::kServing) return absl::OkStatus();
    if (!health.ok()) {
      last = health.status();
    } else {
      last = absl::UnavailableError(absl::StrCat("health is ", HealthStatusName(*health)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("not SERVING within ", FormatWait(timeout), "; last: ", last.ToString()));
}

std::unique_ptr<BatchStream> IndexerClient::OpenBatchStream(const CallOptions& call) {
  std::unique_ptr<BatchStream> stream(new BatchStream());
  if (call.deadline || call.timeout) {
    Prepare(&stream->context_, call);  // deadline, wait-for-ready and token
  } else {
    stream->context_.set_wait_for_ready(call.wait_for_ready);
    Authorize(&stream->context_);
  }
  stream->shapes_ = ShapesToCheck(call);
  stream->stream_ = stub_->BatchStream(&stream->context_);
  return stream;
}

// ---------------------------------------------------------------------------------------------
// BatchStream.

BatchStream::~BatchStream() {
  if (!finished_) {
    context_.TryCancel();
    Finish().IgnoreError();
  }
}

bool BatchStream::Write(const v1::BatchRequest& request) {
  return !writes_done_ && stream_->Write(request);
}

bool BatchStream::Read(v1::BatchResponse* response) { return stream_->Read(response); }

void BatchStream::Cancel() { context_.TryCancel(); }

bool BatchStream::WritesDone() {
  if (writes_done_) return true;
  writes_done_ = true;
  return stream_->WritesDone();
}

absl::StatusOr<v1::BatchResponse> BatchStream::Step(const v1::BatchRequest& request) {
  if (shapes_) {
    if (absl::Status s = CheckShapes(*shapes_, request); !s.ok()) return s;
  }
  v1::BatchResponse response;
  if (Write(request) && Read(&response)) return response;
  absl::Status status = Finish();
  if (status.ok()) status = absl::UnknownError("the server closed the stream without an answer");
  return status;
}

absl::Status BatchStream::Finish() {
  if (finished_) return absl::FailedPreconditionError("the stream was already finished");
  finished_ = true;
  WritesDone();
  v1::BatchResponse unread;
  while (stream_->Read(&unread)) {
  }
  return FromGrpcStatus(stream_->Finish());
}

}  // namespace indexer::client
