// indexer-echo-server: the gRPC floor of the indexer service. It serves indexer.v1.Indexer with
// the real server's gRPC settings (callback API, message size limits, health checking) and the
// same message types, and answers every call OK with an answer of the right shape and size while
// keeping nothing and computing nothing:
//
//   AppendKeys     lengths = the tokens this call appended (every layer), num_blocks to match
//   SelectBlocks   n x H x topk block ids 0..topk-1 (n from the queries' size), the same lengths
//   Batch, BatchStream   one such answer per item; a stream's requests are read as they come
//                        (several may be in flight), answered at once or on the handler
//                        threads, and the answers written in the order the requests came
//   ServerInfo     a shape indexer-bench accepts (--head_dim, --layers, a huge free pool)
//   other RPCs     an empty OK answer (RegisterSystemRegion and RegisterCudaRegion too: nothing is mapped)
//
// Tensors by reference (keys_ref, queries_ref) count by their byte_size, and an output with a
// reference is left out of the answer, as the real server leaves it: the floor of a
// by-reference step is its control messages alone.
//
// What indexer-bench measures against it is what gRPC, protobuf and the loopback cost by
// themselves at a given payload size and concurrency; scripts/service_bench.py compares the real
// server's request rate with it. --handler_threads=0 (default) answers on gRPC's callback
// threads, the floor; N > 0 hands every call to N handler threads first, as indexer-server does.
//
// It listens on host:port or on a Unix domain socket (--listen=unix:/path) and says where on
// stderr: "serving on port N" or "serving on unix:/path".
//
// Exits 0 on SIGINT/SIGTERM, 1 when it cannot listen, 2 for a refused flag value.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "indexer/v1/indexer.grpc.pb.h"
#include "flags/command_line.h"
#include "server/request_executor.h"
#include "server/startup.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50052",
          "gRPC listen address: host:port (port 0 picks one; the port is printed), or "
          "unix:/path/to/socket for a Unix domain socket");
ABSL_FLAG(int32_t, handler_threads, 0,
          "Threads answering calls; 0: answer on gRPC's callback threads (the floor)");
ABSL_FLAG(int32_t, head_dim, 128, "head_dim ServerInfo reports (sizes the answers' shapes)");
ABSL_FLAG(int32_t, layers, 1, "Layers ServerInfo reports and every answer's lengths hold");
ABSL_FLAG(int32_t, topk, 16, "Default topk when a request omits it");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "Largest gRPC message received or sent, in bytes");
ABSL_FLAG(bool, check_num_tokens, false,
          "Refuse (INVALID_ARGUMENT) an append or a selection whose num_tokens is unset or "
          "disagrees with its bytes, so a test can tell that a client sets it");

namespace indexer::bench {
namespace {

namespace v1 = indexer::v1;

struct EchoShape {
  int head_dim = 128;
  int layers = 1;
  int topk = 16;
  int64_t max_message_bytes = 64 << 20;
  bool check_num_tokens = false;
};

int WireBytes(v1::ValueDtype dtype) { return dtype == v1::VALUE_DTYPE_FP32 ? 4 : 2; }

// Tokens an append carries: its keys' bytes over one token's row.
int64_t AppendedTokens(const v1::AppendKeysRequest& a, const EchoShape& shape) {
  const int64_t row =
      static_cast<int64_t>(a.all_layers() ? shape.layers : 1) * shape.head_dim * WireBytes(a.dtype());
  const uint64_t bytes = a.has_keys_ref() ? a.keys_ref().byte_size() : a.keys().size();
  return row > 0 ? static_cast<int64_t>(bytes) / row : 0;
}

// Query tokens a selection carries: its queries' bytes over one token's row.
int64_t QueryTokens(const v1::SelectBlocksRequest& req, const EchoShape& shape) {
  const int heads = std::max<int>(1, static_cast<int>(req.num_heads()));
  const int64_t row = static_cast<int64_t>(heads) * shape.head_dim * WireBytes(req.query_dtype());
  const uint64_t bytes = req.has_queries_ref() ? req.queries_ref().byte_size() : req.queries().size();
  return static_cast<int64_t>(bytes) / row;
}

// With --check_num_tokens: num_tokens is set and matches the bytes.
grpc::Status CheckNumTokens(const v1::AppendKeysRequest& a, const EchoShape& shape) {
  if (!shape.check_num_tokens) return grpc::Status::OK;
  if (!a.has_num_tokens() || a.num_tokens() != AppendedTokens(a, shape)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the append's num_tokens is unset or disagrees with its keys");
  }
  return grpc::Status::OK;
}

grpc::Status CheckNumTokens(const v1::SelectBlocksRequest& r, const EchoShape& shape) {
  if (!shape.check_num_tokens) return grpc::Status::OK;
  if (!r.has_num_tokens() || r.num_tokens() != QueryTokens(r, shape)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the selection's num_tokens is unset or disagrees with its queries");
  }
  return r.has_append() ? CheckNumTokens(r.append(), shape) : grpc::Status::OK;
}

template <typename Repeated>
void PutLengths(int64_t tokens, int layers, Repeated* out) {
  for (int l = 0; l < layers; ++l) out->Add(static_cast<uint32_t>(tokens));
}

void Answer(const v1::AppendKeysRequest& req, const EchoShape& shape, v1::AppendKeysResponse* resp) {
  const int64_t n = AppendedTokens(req, shape);
  PutLengths(n, shape.layers, resp->mutable_lengths());
  resp->set_num_blocks(static_cast<uint32_t>((n + 127) / 128));
}

void Answer(const v1::SelectBlocksRequest& req, const EchoShape& shape,
            v1::SelectBlocksResponse* resp) {
  const int64_t appended = req.has_append() ? AppendedTokens(req.append(), shape) : 0;
  const int heads = std::max<int>(1, static_cast<int>(req.num_heads()));
  const int topk = req.has_topk() ? static_cast<int>(req.topk()) : shape.topk;
  const int64_t n = QueryTokens(req, shape);
  resp->set_num_tokens(static_cast<uint32_t>(n));
  resp->set_num_heads(static_cast<uint32_t>(heads));
  resp->set_topk(static_cast<uint32_t>(topk));
  resp->set_start_position(std::max<int64_t>(0, appended - n));
  PutLengths(appended, shape.layers, resp->mutable_lengths());
  if (req.output_refs().has_block_ids()) return;  // written into the caller's region
  // Rows of ids 0..topk-1: the size of a real answer (a short sequence's -1 padding is as long).
  std::string* ids = resp->mutable_block_ids();
  ids->resize(static_cast<size_t>(n * heads * topk) * sizeof(int32_t));
  for (int64_t i = 0; i < n * heads * topk; ++i) {
    const int32_t id = static_cast<int32_t>(i % topk);
    std::memcpy(ids->data() + i * sizeof(int32_t), &id, sizeof(int32_t));
  }
}

void Answer(const v1::BatchRequest& req, const EchoShape& shape, v1::BatchResponse* resp) {
  resp->set_request_id(req.request_id());
  resp->mutable_results()->Reserve(req.items_size());
  for (const v1::SelectBlocksRequest& item : req.items()) {
    v1::BatchItemResult* result = resp->add_results();
    if (const grpc::Status st = CheckNumTokens(item, shape); !st.ok()) {
      result->set_code(st.error_code());
      result->set_message(st.error_message());
      continue;
    }
    Answer(item, shape, result->mutable_result());
  }
}

void Answer(const EchoShape& shape, v1::ServerInfoResponse* resp) {
  constexpr uint64_t kPages = uint64_t{1} << 30;
  resp->set_version("echo");
  resp->set_backend("echo");
  resp->set_device("none");
  resp->set_head_dim(static_cast<uint32_t>(shape.head_dim));
  resp->set_layers(static_cast<uint32_t>(shape.layers));
  resp->set_key_storage(v1::KEY_STORAGE_BF16);
  resp->set_block_size(128);
  resp->set_max_index_heads(16);
  resp->set_max_topk(256);
  resp->set_default_topk(static_cast<uint32_t>(shape.topk));
  resp->set_default_init_blocks(0);
  resp->set_default_local_blocks(1);
  resp->set_pages_per_block(8);
  resp->set_block_page_stride(8);
  resp->set_total_pages(kPages);
  resp->set_free_pages(kPages);
  resp->set_bytes_per_page(static_cast<uint64_t>(128) * shape.layers * shape.head_dim * 2);
  resp->set_max_tokens_per_sequence(1u << 30);
  resp->set_max_message_bytes(static_cast<uint64_t>(shape.max_message_bytes));
}

// The service. Unary methods answer on the callback thread, or on the executor when there is one.
class EchoService final : public v1::Indexer::CallbackService {
 public:
  EchoService(EchoShape shape, server::RequestExecutor* executor)
      : shape_(shape), executor_(executor) {}

  grpc::ServerUnaryReactor* AppendKeys(grpc::CallbackServerContext* ctx,
                                       const v1::AppendKeysRequest* req,
                                       v1::AppendKeysResponse* resp) override {
    return Run(ctx, [this, req, resp] {
      const grpc::Status st = CheckNumTokens(*req, shape_);
      if (st.ok()) Answer(*req, shape_, resp);
      return st;
    });
  }
  grpc::ServerUnaryReactor* SelectBlocks(grpc::CallbackServerContext* ctx,
                                         const v1::SelectBlocksRequest* req,
                                         v1::SelectBlocksResponse* resp) override {
    return Run(ctx, [this, req, resp] {
      const grpc::Status st = CheckNumTokens(*req, shape_);
      if (st.ok()) Answer(*req, shape_, resp);
      return st;
    });
  }
  grpc::ServerUnaryReactor* Batch(grpc::CallbackServerContext* ctx, const v1::BatchRequest* req,
                                  v1::BatchResponse* resp) override {
    return Run(ctx, [this, req, resp] { Answer(*req, shape_, resp); });
  }
  grpc::ServerBidiReactor<v1::BatchRequest, v1::BatchResponse>* BatchStream(
      grpc::CallbackServerContext* /*ctx*/) override {
    return new StreamReactor(this);
  }
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* /*req*/,
                                            v1::ReleaseSequenceResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }
  grpc::ServerUnaryReactor* TruncateSequence(grpc::CallbackServerContext* ctx,
                                             const v1::TruncateSequenceRequest* req,
                                             v1::TruncateSequenceResponse* resp) override {
    return Run(ctx, [this, req, resp] {
      PutLengths(req->length(), shape_.layers, resp->mutable_lengths());
      resp->set_num_blocks((req->length() + 127) / 128);
    });
  }
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* /*req*/,
                                         v1::ForkSequenceResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx,
                                        const v1::GetSequenceRequest* req,
                                        v1::GetSequenceResponse* resp) override {
    return Run(ctx, [req, resp] { resp->set_sequence_id(req->sequence_id()); });
  }
  grpc::ServerUnaryReactor* ServerInfo(grpc::CallbackServerContext* ctx,
                                       const v1::ServerInfoRequest* /*req*/,
                                       v1::ServerInfoResponse* resp) override {
    return Run(ctx, [this, resp] { Answer(shape_, resp); });
  }
  grpc::ServerUnaryReactor* RegisterSystemRegion(
      grpc::CallbackServerContext* ctx, const v1::RegisterSystemRegionRequest* /*req*/,
      v1::RegisterSystemRegionResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }
  grpc::ServerUnaryReactor* RegisterCudaRegion(
      grpc::CallbackServerContext* ctx, const v1::RegisterCudaRegionRequest* /*req*/,
      v1::RegisterCudaRegionResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* /*req*/,
                                             v1::UnregisterRegionResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }
  // No metrics: an empty answer (indexer-bench then reports no server figures).
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* /*req*/,
                                     v1::GetStatsResponse* /*resp*/) override {
    return Run(ctx, [] {});
  }

 private:
  // A BatchStream: requests are read as they come, up to kReadAhead unanswered ones, each
  // answered at once (or on a handler thread, so several may be answered at the same time), and
  // the answers written one at a time in the order their requests came. The call finishes once
  // the client half-closed and every answer was written, or when a write fails.
  //
  // Every decision is taken under mu_ and carried out after it is released (Act): no Start* or
  // Finish runs with the lock held, and once Finish is called (which lets OnDone delete the
  // reactor, possibly on another thread) nothing touches the reactor any more.
  class StreamReactor final : public grpc::ServerBidiReactor<v1::BatchRequest, v1::BatchResponse> {
   public:
    explicit StreamReactor(EchoService* service) : service_(service) {
      std::unique_lock<std::mutex> lock(mu_);
      Next next;
      next.read = ReadNext();
      Act(next, lock);
    }
    void OnReadDone(bool ok) override {
      std::unique_lock<std::mutex> lock(mu_);
      reading_ = false;
      Next next;
      if (!ok || broken_) {
        reads_done_ = true;
        next.finish = MaybeFinish();
        Act(next, lock);
        return;
      }
      const uint64_t seq = next_read_++;
      std::shared_ptr<v1::BatchRequest> request = std::move(incoming_);
      if (next_read_ - next_write_ < kReadAhead) next.read = ReadNext();
      ++answering_;
      Act(next, lock);
      service_->Dispatch([this, seq, request] {
        auto response = std::make_unique<v1::BatchResponse>();
        Answer(*request, service_->shape_, response.get());
        std::unique_lock<std::mutex> lock(mu_);
        --answering_;
        answers_[seq] = std::move(response);
        Next next;
        next.write = WriteNext();
        next.finish = MaybeFinish();
        Act(next, lock);
      });
    }
    void OnWriteDone(bool ok) override {
      std::unique_lock<std::mutex> lock(mu_);
      writing_ = false;
      answers_.erase(next_write_++);
      if (!ok) broken_ = true;
      Next next;
      if (!broken_ && !reads_done_ && !reading_ && next_read_ - next_write_ < kReadAhead) {
        next.read = ReadNext();
      }
      next.write = WriteNext();
      next.finish = MaybeFinish();
      Act(next, lock);
    }
    void OnDone() override { delete this; }

   private:
    static constexpr uint64_t kReadAhead = 16;

    // What to start once mu_ is released.
    struct Next {
      v1::BatchRequest* read = nullptr;
      const v1::BatchResponse* write = nullptr;
      std::optional<grpc::Status> finish;
    };

    // Releases the lock, then starts what `next` says; Finish last, as the final touch.
    void Act(const Next& next, std::unique_lock<std::mutex>& lock) {
      lock.unlock();
      if (next.read != nullptr) StartRead(next.read);
      if (next.write != nullptr) StartWrite(next.write);
      if (next.finish) Finish(*next.finish);
    }

    // The helpers below run with mu_ held and only decide.
    v1::BatchRequest* ReadNext() {
      incoming_ = std::make_unique<v1::BatchRequest>();
      reading_ = true;
      return incoming_.get();
    }
    const v1::BatchResponse* WriteNext() {
      if (writing_ || broken_ || finished_) return nullptr;
      const auto next = answers_.find(next_write_);
      if (next == answers_.end()) return nullptr;
      writing_ = true;
      return next->second.get();
    }
    std::optional<grpc::Status> MaybeFinish() {
      if (finished_ || answering_ > 0 || writing_) return std::nullopt;
      if (broken_) {
        finished_ = true;
        return grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed while writing");
      }
      if (reads_done_ && !reading_ && next_write_ == next_read_) {
        finished_ = true;
        return grpc::Status::OK;
      }
      return std::nullopt;
    }

    EchoService* service_;
    std::mutex mu_;
    std::unique_ptr<v1::BatchRequest> incoming_;  // the read in progress
    std::map<uint64_t, std::unique_ptr<v1::BatchResponse>> answers_;  // by request order
    uint64_t next_read_ = 0;   // order number of the next request read
    uint64_t next_write_ = 0;  // order number of the next answer to write
    int answering_ = 0;        // requests being answered on a handler thread
    bool reading_ = false;
    bool writing_ = false;
    bool reads_done_ = false;  // the client half-closed (or the call ended)
    bool broken_ = false;      // a write failed
    bool finished_ = false;
  };

  template <typename Fn>
  void Dispatch(Fn fn) {
    if (executor_ == nullptr) {
      fn();
    } else {
      executor_->Submit(std::move(fn));
    }
  }

  // Answers a unary call with `fill` (which returns the call's status, or nothing for OK).
  template <typename Fn>
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx, Fn fill) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    Dispatch([reactor, fill = std::move(fill)]() mutable {
      if constexpr (std::is_same_v<decltype(fill()), grpc::Status>) {
        reactor->Finish(fill());
      } else {
        fill();
        reactor->Finish(grpc::Status::OK);
      }
    });
    return reactor;
  }

  const EchoShape shape_;
  server::RequestExecutor* const executor_;
};

}  // namespace
}  // namespace indexer::bench

namespace {

constexpr char kUsage[] =
    "indexer-echo-server: the gRPC floor of the indexer service. It serves indexer.v1.Indexer\n"
    "with the real server's gRPC settings and answers every call OK with an answer of the right\n"
    "shape and size, keeping and computing nothing: the reference scripts/service_bench.py and\n"
    "indexer-bench measure the service against.\n"
    "\n"
    "Usage: indexer-echo-server [flags]\n"
    "  indexer-echo-server --listen=127.0.0.1:0             (a free port, printed)\n"
    "  indexer-echo-server --listen=unix:/tmp/echo.sock     (a Unix domain socket)\n"
    "\n"
    "Exit status: 0 after SIGINT or SIGTERM; 1 it cannot listen; 2 a usage error (an unknown\n"
    "flag or argument, a value that does not parse or is out of range).\n";

}  // namespace

int main(int argc, char** argv) {
  // First, before any thread exists: the allocator's settings, and the signal mask, which every
  // thread inherits, so that only Wait takes the signals.
  indexer::server::KeepFreedMemory();
  indexer::server::ShutdownSignals signals;
  const indexer::flags::FlagFilter ours =
      indexer::flags::FlagsDefinedIn("client/bench/echo_server.cc");
  absl::StatusOr<indexer::flags::CommandLine> cl = indexer::flags::ParseCommandLine(argc, argv, ours);
  if (cl.ok() && !cl->positional.empty()) {
    cl = absl::InvalidArgumentError("unexpected argument '" + cl->positional[0] + "'");
  }
  if (!cl.ok()) return indexer::flags::ReportUsageError("indexer-echo-server", cl.status().message());
  if (cl->help) {
    std::printf("%s\nFlags:\n%s", kUsage, indexer::flags::FlagList(ours).c_str());
    return 0;
  }
  if (cl->version) {
    std::printf("indexer-echo-server %s\n", indexer::flags::ProgramVersion());
    return 0;
  }

  indexer::bench::EchoShape shape;
  shape.head_dim = absl::GetFlag(FLAGS_head_dim);
  shape.layers = absl::GetFlag(FLAGS_layers);
  shape.topk = absl::GetFlag(FLAGS_topk);
  shape.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  shape.check_num_tokens = absl::GetFlag(FLAGS_check_num_tokens);
  const int handler_threads = absl::GetFlag(FLAGS_handler_threads);
  if (shape.head_dim < 1 || shape.layers < 1 || shape.topk < 1 || handler_threads < 0 ||
      shape.max_message_bytes < 1024 || shape.max_message_bytes > (int64_t{1} << 31) - 1) {
    std::fprintf(stderr,
                 "indexer-echo-server: --head_dim, --layers and --topk must be >= 1, "
                 "--handler_threads >= 0, --max_message_bytes in [1024, 2^31)\n");
    return indexer::flags::kUsageExit;
  }

  std::unique_ptr<indexer::server::RequestExecutor> executor;
  if (handler_threads > 0) executor = std::make_unique<indexer::server::RequestExecutor>(handler_threads);
  indexer::bench::EchoService service(shape, executor.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(shape.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(shape.max_message_bytes));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "indexer-echo-server: cannot listen on %s\n",
                 absl::GetFlag(FLAGS_listen).c_str());
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus("indexer.v1.Indexer", true);
  server->GetHealthCheckService()->SetServingStatus(true);
  const std::string listen = absl::GetFlag(FLAGS_listen);
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) {
    std::fprintf(stderr, "indexer-echo-server serving on %s (handler threads: %d)\n",
                 listen.c_str(), handler_threads);
  } else {
    std::fprintf(stderr, "indexer-echo-server serving on port %d (handler threads: %d)\n", port,
                 handler_threads);
  }
  std::fflush(stderr);

  signals.Wait();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server->Wait();
  if (executor != nullptr) executor->Stop();
  return 0;
}
