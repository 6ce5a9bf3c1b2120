// IndexerClient: the typed C++ client of the indexer gRPC API (proto/indexer/v1/indexer.proto).
// Schedulers, load tools (indexer-cli) and end-to-end tests use it to talk to an indexer-server.
//
// Every RPC returns absl::StatusOr<Response> (or absl::Status): a failed call carries the
// server's gRPC code and message translated one-to-one into absl (FromGrpcStatus, the one place
// where that happens), so `status.code() == absl::StatusCode::kNotFound` means the server said
// NOT_FOUND. A call never throws and never exits.
//
// Threads: an IndexerClient is thread-safe; any number of threads may call any method at once
// (calls share the channel's connections). A BatchStream is a single stream: one thread may
// Write and another Read at the same time, but not two of either, and Step() must not be mixed
// with concurrent Write/Read.
//
// Deadlines: every unary call gets a deadline, from CallOptions when given, else
// ClientOptions::default_timeout from now. A call whose deadline passes fails with
// DEADLINE_EXCEEDED.
//
// Security (docs/SECURITY.md): ClientOptions turns on TLS (with the CA that signed the server's
// certificate, and a client certificate for mutual TLS) and a bearer token, which every call
// then carries as "authorization: Bearer <token>". A server that checks tokens answers calls
// without one with UNAUTHENTICATED.
//
// Besides the RPCs, this header has the helpers that every caller needs to build requests and
// read answers: packing float keys/queries into the wire bytes (bf16, rounded to nearest even
// exactly as the server does, or fp32), unpacking int32 result bytes, and Selection, a typed
// view of a SelectBlocksResponse.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "indexer/v1/indexer.grpc.pb.h"

namespace indexer::client {

// ---------------------------------------------------------------------------------------------
// Status translation.

// The one translation from a gRPC status (wire) to an absl::Status (callers). The codes share
// the canonical numbering; the message is kept verbatim.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The status of one Batch item (BatchItemResult.code / .message) as an absl::Status.
absl::Status ItemStatus(const v1::BatchItemResult& item);

// ---------------------------------------------------------------------------------------------
// Wire tensors (pure functions; call from any thread).

// Packs fp32 values as little-endian bf16, rounding to nearest, ties to even (the server's own
// rounding, kernels::FloatToBf16). NaN and values past the bf16 range stay non-finite: the
// server refuses those with INVALID_ARGUMENT, so a caller can test that path too.
std::string PackBf16(std::span<const float> values);
// Packs raw bf16 bit patterns.
std::string PackBf16Bits(std::span<const uint16_t> bits);
// Packs fp32 values as little-endian IEEE floats (the server rounds them to bf16).
std::string PackFp32(std::span<const float> values);
// Packs values in the given wire dtype (BF16 or FP32). INVALID_ARGUMENT for UNSPECIFIED.
absl::StatusOr<std::string> PackValues(std::span<const float> values, v1::ValueDtype dtype);

// Unpacks little-endian int32 bytes (block_ids, page_table, context_lens). INVALID_ARGUMENT
// naming `field` when the size is not a multiple of 4.
absl::StatusOr<std::vector<int32_t>> UnpackInt32(absl::string_view bytes,
                                                 absl::string_view field = "bytes");

// bf16 bits -> float and float -> bf16 value (what the server will store for `f`).
float Bf16BitsToFloat(uint16_t bits);
float RoundToBf16(float f);

// A selection answer, unpacked and shape-checked: block ids [n][H][topk] and, when the
// sequence has attention pages, page-table rows [n][H][topk * pages_per_block] and context
// lengths [n][H]. A plain value: copy it, keep it, read it from any thread.
struct Selection {
  int num_tokens = 0;
  int num_heads = 0;
  int topk = 0;
  int64_t start_position = 0;
  int pages_per_block = 0;
  std::vector<int32_t> block_ids;
  std::vector<int32_t> page_table;    // empty when the sequence has no attention pages
  std::vector<int32_t> context_lens;  // empty when the sequence has no attention pages
  std::vector<uint32_t> lengths;      // tokens per layer after any append the request carried

  bool has_page_table() const { return !page_table.empty(); }
  // Position of token `token` of the span (start_position + token).
  int64_t position(int token) const { return start_position + token; }
  // The j-th selected block of (token, head); -1 is padding. Arguments must be in range.
  int32_t at(int token, int head, int j) const {
    return block_ids[(static_cast<size_t>(token) * num_heads + head) * topk + j];
  }
  // The topk block ids of (token, head).
  std::span<const int32_t> blocks(int token, int head) const {
    return std::span<const int32_t>(block_ids).subspan(
        (static_cast<size_t>(token) * num_heads + head) * topk, topk);
  }
  // The page-table row of (token, head): topk * pages_per_block entries. Only with page tables.
  std::span<const int32_t> page_row(int token, int head) const {
    const size_t width = static_cast<size_t>(topk) * pages_per_block;
    return std::span<const int32_t>(page_table)
        .subspan((static_cast<size_t>(token) * num_heads + head) * width, width);
  }
  int32_t context_len(int token, int head) const {
    return context_lens[static_cast<size_t>(token) * num_heads + head];
  }
};

// Unpacks a SelectBlocksResponse. INVALID_ARGUMENT when a byte field's size does not match the
// shape the response declares (which would be a server bug).
absl::StatusOr<Selection> ParseSelection(const v1::SelectBlocksResponse& response);

// Where a request asked its outputs to be written (SelectBlocksRequest.output_refs), as this
// process sees that memory: each non-null pointer is read for its output (the shape the
// response declares) instead of the response's empty field.
struct OutputsInMemory {
  const int32_t* block_ids = nullptr;
  const int32_t* page_table = nullptr;
  const int32_t* context_lens = nullptr;
};
absl::StatusOr<Selection> ParseSelection(const v1::SelectBlocksResponse& response,
                                         const OutputsInMemory& outputs);

// ---------------------------------------------------------------------------------------------
// Request builders (pure functions). They only pack; the server validates.
//
// Keys and queries travel as bytes, and the server derives the token count from their size: a
// caller whose head_dim differs from the server's would be answered for other shapes. So the
// builders that take `num_tokens` put it in the request, and the server (and IndexerClient,
// before sending) refuses bytes that are not num_tokens tokens of the server's shape. Prefer
// them; the ones without send no count.

// An append of `keys` ([n][head_dim], or [n][layers][head_dim] with all_layers) to one layer.
v1::AppendKeysRequest MakeAppend(absl::string_view sequence_id, uint32_t layer,
                                 std::span<const float> keys,
                                 v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);
v1::AppendKeysRequest MakeAppend(absl::string_view sequence_id, uint32_t layer,
                                 uint32_t num_tokens, std::span<const float> keys,
                                 v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);
v1::AppendKeysRequest MakeAppendAllLayers(absl::string_view sequence_id,
                                          std::span<const float> keys,
                                          v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);
v1::AppendKeysRequest MakeAppendAllLayers(absl::string_view sequence_id, uint32_t num_tokens,
                                          std::span<const float> keys,
                                          v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);
// A selection for queries [n][num_heads][head_dim]; topk etc. left to the server's defaults
// (set them on the result to override). start_position unset = the span ends at the last token.
v1::SelectBlocksRequest MakeSelect(absl::string_view sequence_id, uint32_t layer,
                                   uint32_t num_heads, std::span<const float> queries,
                                   v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);
v1::SelectBlocksRequest MakeSelect(absl::string_view sequence_id, uint32_t layer,
                                   uint32_t num_heads, uint32_t num_tokens,
                                   std::span<const float> queries,
                                   v1::ValueDtype dtype = v1::VALUE_DTYPE_BF16);

// The server's tensor shapes (ServerInfo's head_dim and layers), for CheckShapes.
struct ServerShapes {
  uint32_t head_dim = 0;
  uint32_t layers = 0;
};
ServerShapes ShapesOf(const v1::ServerInfoResponse& info);

// INVALID_ARGUMENT, naming the field, the server's head_dim (and layers) and what to fix, when
// a request states num_tokens and its keys or queries are not that many tokens of the server's
// shape. What the server would refuse, said before anything is sent; requests that state no
// count are left to the server's own checks.
absl::Status CheckShapes(const ServerShapes& shapes, const v1::AppendKeysRequest& request);
absl::Status CheckShapes(const ServerShapes& shapes, const v1::SelectBlocksRequest& request);
absl::Status CheckShapes(const ServerShapes& shapes, const v1::BatchRequest& request);

// ---------------------------------------------------------------------------------------------
// The client.

struct ClientOptions {
  // Deadline of a unary call that gives none in CallOptions.
  absl::Duration default_timeout = absl::Seconds(30);
  // Largest message this client accepts from the server (gRPC's own default is 4 MiB, too small
  // for large selections). Sends are not limited here: the server enforces its own limit.
  int max_receive_message_bytes = 256 << 20;

  // TLS. `tls` on, or any PEM below set: the channel is TLS. tls_root_ca_pem: the CA(s) that
  // signed the server's certificate (empty: gRPC's default roots). tls_cert_chain_pem and
  // tls_private_key_pem: this client's certificate, for servers that require mutual TLS.
  // tls_server_name: the name to check the server's certificate against when it differs from
  // the target's host (empty: the target's host).
  bool tls = false;
  std::string tls_root_ca_pem;
  std::string tls_cert_chain_pem;
  std::string tls_private_key_pem;
  std::string tls_server_name;
  // Sent with every call as "authorization: Bearer <token>" (empty: no token).
  std::string bearer_token;
  // Check the keys and queries of AppendKeys, SelectBlocks, Batch and BatchStream::Step against
  // the server's head_dim and layers before sending (CheckShapes: INVALID_ARGUMENT, nothing
  // sent). The shapes come from one ServerInfo call, made before the first such call; while it
  // fails, calls go unchecked (the server still checks num_tokens).
  bool check_shapes = true;

  bool UsesTls() const {
    return tls || !tls_root_ca_pem.empty() || !tls_cert_chain_pem.empty() ||
           !tls_private_key_pem.empty();
  }
};

// The contents of a PEM (or any) file, for ClientOptions. NOT_FOUND naming the path when it
// cannot be read or is empty.
absl::StatusOr<std::string> ReadPemFile(const std::string& path);

// Per-call settings. `deadline` wins over `timeout`; with neither, the client's default_timeout.
struct CallOptions {
  std::optional<absl::Time> deadline;
  std::optional<absl::Duration> timeout;
  // Wait for the channel to connect (up to the deadline) instead of failing fast with
  // UNAVAILABLE when the server is not (yet) reachable.
  bool wait_for_ready = false;

  static CallOptions Timeout(absl::Duration d) { return CallOptions{std::nullopt, d, false}; }
  static CallOptions Deadline(absl::Time t) { return CallOptions{t, std::nullopt, false}; }
};

// Serving status from grpc.health.v1.Health/Check.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* HealthStatusName(HealthStatus s);

class BatchStream;

class IndexerClient {
 public:
  // Uses an existing channel (shared with other stubs, or with custom credentials).
  explicit IndexerClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});
  ~IndexerClient();
  IndexerClient(const IndexerClient&) = delete;
  IndexerClient& operator=(const IndexerClient&) = delete;

  // A client on a channel to `target` ("host:port", or any gRPC target URI): TLS when
  // options.UsesTls(), else insecure. INVALID_ARGUMENT when target is empty, or when only one of
  // the client certificate and its key is given. Connecting is lazy: the first call connects.
  static absl::StatusOr<std::unique_ptr<IndexerClient>> Connect(absl::string_view target,
                                                                ClientOptions options = {});

  // The RPCs, one method each; see indexer.proto for what each does and the errors it returns.
  absl::StatusOr<v1::AppendKeysResponse> AppendKeys(const v1::AppendKeysRequest& request,
                                                    const CallOptions& call = {});
  absl::StatusOr<v1::SelectBlocksResponse> SelectBlocks(const v1::SelectBlocksRequest& request,
                                                        const CallOptions& call = {});
  // The call's status is OK whenever the server answered; each item has its own status
  // (ItemStatus).
  absl::StatusOr<v1::BatchResponse> Batch(const v1::BatchRequest& request,
                                          const CallOptions& call = {});
  absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseSequence(absl::string_view sequence_id,
                                                              const CallOptions& call = {});
  absl::StatusOr<v1::TruncateSequenceResponse> TruncateSequence(absl::string_view sequence_id,
                                                                uint32_t length,
                                                                const CallOptions& call = {});
  // `length` unset: the whole source.
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(absl::string_view source_id,
                                                        absl::string_view target_id,
                                                        std::optional<uint32_t> length = {},
                                                        const CallOptions& call = {});
  absl::StatusOr<v1::GetSequenceResponse> GetSequence(absl::string_view sequence_id,
                                                      const CallOptions& call = {});
  absl::StatusOr<v1::ServerInfoResponse> ServerInfo(const CallOptions& call = {});
  // The server's metrics (the figures its Prometheus endpoint serves).
  absl::StatusOr<v1::GetStatsResponse> GetStats(const CallOptions& call = {});
  // IndexerAdmin.Snapshot: writes a snapshot file named `name` ("" = a timestamped name) in the
  // server's snapshot folder. Needs an admin token on servers that check tokens.
  absl::StatusOr<v1::SnapshotResponse> Snapshot(absl::string_view name = "",
                                                const CallOptions& call = {});

  // Shared-memory regions for tensors by reference (SharedMemoryRegion makes one). The server
  // must run on this host: it maps the object by its key.
  absl::Status RegisterSystemRegion(absl::string_view name, absl::string_view key,
                                    uint64_t offset, uint64_t byte_size,
                                    const CallOptions& call = {});
  // A CUDA region: `raw_handle` is the 64 bytes of cudaIpcGetMemHandle for an allocation of this
  // process (or another on the server's host) on the server's GPU `device_id`; the server reads
  // and writes byte_size bytes at `offset` of it in place. Keep the allocation alive until the
  // region is unregistered.
  absl::Status RegisterCudaRegion(absl::string_view name, absl::string_view raw_handle,
                                  int device_id, uint64_t offset, uint64_t byte_size,
                                  const CallOptions& call = {});
  // "" = every region of the caller's tenant; how many were unregistered.
  absl::StatusOr<uint32_t> UnregisterRegion(absl::string_view name = "",
                                            const CallOptions& call = {});
  absl::StatusOr<v1::ListRegionsResponse> ListRegions(absl::string_view name = "",
                                                      const CallOptions& call = {});

  // SelectBlocks, unpacked.
  absl::StatusOr<Selection> Select(const v1::SelectBlocksRequest& request,
                                   const CallOptions& call = {});

  // grpc.health.v1.Health/Check for `service` ("" = the whole server, or "indexer.v1.Indexer").
  // NOT_FOUND when the server does not know the service name.
  absl::StatusOr<HealthStatus> Health(absl::string_view service = "", const CallOptions& call = {});

  // Polls Health("") until it answers SERVING or `timeout` passes (then DEADLINE_EXCEEDED, or
  // the last error). For tools that start a server and wait for it.
  absl::Status WaitUntilServing(absl::Duration timeout);

  // Opens a BatchStream. The stream's deadline is CallOptions' deadline/timeout when given;
  // otherwise it has none (streams live as long as the scheduler that holds them).
  std::unique_ptr<BatchStream> OpenBatchStream(const CallOptions& call = {});

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  // Sets the deadline, wait-for-ready and token of a unary call's context.
  void Prepare(grpc::ClientContext* context, const CallOptions& call) const;
  // Adds the bearer token, when there is one.
  void Authorize(grpc::ClientContext* context) const;
  // Runs one unary stub method with a prepared context and translates its status.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(
      grpc::Status (v1::Indexer::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
      const Request& request, const CallOptions& call);
  // The server's shapes for CheckShapes, asked once (ServerInfo under `call`'s deadline);
  // nullopt when check_shapes is off or the server did not answer.
  std::optional<ServerShapes> ShapesToCheck(const CallOptions& call);
  // CheckShapes against ShapesToCheck; OK when there are none.
  template <typename Request>
  absl::Status CheckBeforeSending(const Request& request, const CallOptions& call);

  std::shared_ptr<grpc::Channel> channel_;
  ClientOptions options_;
  std::mutex shapes_mu_;
  std::optional<ServerShapes> shapes_;  // guarded by shapes_mu_
  std::unique_ptr<v1::Indexer::Stub> stub_;
  std::unique_ptr<v1::IndexerAdmin::Stub> admin_stub_;
};

// One BatchStream call: BatchRequests in, BatchResponses out, one answer per request, in order.
// Made by IndexerClient::OpenBatchStream; must not outlive the client's channel.
//
// Threads: at most one thread in Write/WritesDone and one in Read at a time; Step and Finish
// must not run concurrently with anything else on the stream; Cancel may run at any time.
class BatchStream {
 public:
  ~BatchStream();  // cancels the call if Finish() was not called
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // Sends one request. False when the stream is broken (call Finish() for the reason).
  bool Write(const v1::BatchRequest& request);
  // Receives the next response. False when the server closed the stream (call Finish()).
  bool Read(v1::BatchResponse* response);
  // Write, then Read: one synchronous round trip. On failure returns the stream's final status
  // (after finishing it), or UNKNOWN if the server closed the stream with OK. A request that
  // fails CheckShapes (with check_shapes on) is INVALID_ARGUMENT, not sent, the stream intact.
  absl::StatusOr<v1::BatchResponse> Step(const v1::BatchRequest& request);
  // Tells the server no more requests follow.
  bool WritesDone();
  // Half-closes (if not yet done), drains unread responses and returns the call's status.
  // Call once.
  absl::Status Finish();
  // Cancels the call; safe from any thread, at any time. A Read or Write blocked on the stream
  // then returns false, and Finish() returns CANCELLED.
  void Cancel();

 private:
  friend class IndexerClient;
  BatchStream() = default;

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::BatchRequest, v1::BatchResponse>> stream_;
  std::optional<ServerShapes> shapes_;  // Step checks requests against them when set
  bool writes_done_ = false;
  bool finished_ = false;
};

}  // namespace indexer::client
