#include "server/indexer_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"

#include "absl/strings/str_cat.h"
#include "engine/backend_factory.h"

namespace indexer::server {

const char* Version() { return INDEXER_VERSION; }

namespace {
// The service name health checks answer for, besides the whole server ("").
constexpr char kServiceName[] = "indexer.v1.Indexer";
}  // namespace

absl::StatusOr<std::unique_ptr<IndexerServer>> IndexerServer::Start(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<engine::KeyCacheBackend>> backend =
      engine::MakeBackend(options.engine, options.device);
  if (!backend.ok()) return backend.status();

  std::unique_ptr<IndexerServer> s(new IndexerServer());
  // Answers must fit one gRPC message: the engine refuses (and applies nothing of) a request
  // whose answer would not, keeping some room for the message's framing.
  engine::EngineConfig config = options.engine;
  config.max_response_bytes = std::max<int64_t>(options.max_message_bytes - 4096, 1024);
  s->engine_ = std::make_unique<engine::Engine>(config, std::move(*backend));
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  s->executor_ = std::make_unique<RequestExecutor>(
      options.handler_threads > 0 ? options.handler_threads : std::max(4, 2 * hw));
  s->service_ = std::make_unique<IndexerService>(s->engine_.get(), s->executor_.get(), Version(),
                                                 options.max_message_bytes);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Refuse a port another server holds: with SO_REUSEPORT two servers would split the traffic
  // while holding different sequences.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    s->executor_->Stop();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, " (address in use or invalid?)"));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  return s;
}

void IndexerServer::Shutdown(absl::Duration drain, absl::Duration not_serving_grace) {
  if (stopped_ || server_ == nullptr) return;
  stopped_ = true;
  server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Health checks answer NOT_SERVING for a moment before the listener closes, so that load
  // balancers and readiness probes stop sending new work first.
  if (not_serving_grace > absl::ZeroDuration()) absl::SleepFor(not_serving_grace);
  service_->BeginShutdown();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + drain));
  server_->Wait();
  executor_->Stop();
}

IndexerServer::~IndexerServer() {
  Shutdown(absl::ZeroDuration(), absl::ZeroDuration());
  if (executor_ != nullptr) executor_->Stop();
}

}  // namespace indexer::server
