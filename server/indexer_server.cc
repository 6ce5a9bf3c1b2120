#include "server/indexer_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/backend_factory.h"

namespace indexer::server {

const char* Version() { return INDEXER_VERSION; }

absl::StatusOr<std::unique_ptr<IndexerServer>> IndexerServer::Start(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<engine::KeyCacheBackend>> backend =
      engine::MakeBackend(options.engine, options.device);
  if (!backend.ok()) return backend.status();

  std::unique_ptr<IndexerServer> s(new IndexerServer());
  s->engine_ = std::make_unique<engine::Engine>(options.engine, std::move(*backend));
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  s->executor_ = std::make_unique<RequestExecutor>(
      options.handler_threads > 0 ? options.handler_threads : std::max(4, 2 * hw));
  s->service_ = std::make_unique<IndexerService>(s->engine_.get(), s->executor_.get(), Version(),
                                                 options.max_message_bytes);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
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
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  return s;
}

void IndexerServer::Shutdown(absl::Duration drain) {
  if (stopped_) return;
  stopped_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(absl::ToChronoTime(absl::Now() + drain));
  server_->Wait();
  executor_->Stop();
}

IndexerServer::~IndexerServer() { Shutdown(absl::ZeroDuration()); }

}  // namespace indexer::server
