#include "server/indexer_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/backend_factory.h"
#include "engine/status_macros.h"
#include "flags/command_line.h"

namespace indexer::server {

namespace {
// The service name health checks answer for, besides the whole server ("").
constexpr char kServiceName[] = "indexer.v1.Indexer";

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": cannot read it"));
  }
  return text.str();
}

// Insecure credentials, or TLS (mutual when tls_client_ca is set) from the PEM files.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions& o) {
  if (o.tls_cert.empty()) return grpc::InsecureServerCredentials();
  absl::StatusOr<std::string> cert = ReadPem(o.tls_cert, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(o.tls_key, "tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      o.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!o.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(o.tls_client_ca, "tls_client_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(ssl);
}

absl::Status CheckSnapshotDir(const std::string& dir) {
  if (dir.empty()) return absl::OkStatus();
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || access(dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--snapshot_dir ", dir, " is not a folder this server can write"));
  }
  return absl::OkStatus();
}

// Parses every listening address and checks that each can be bound now, before the backends
// take their memory or a snapshot is restored. Returns the main listener's address.
absl::StatusOr<ListenAddress> CheckListenAddresses(const ServerOptions& o) {
  absl::StatusOr<ListenAddress> listen = ParseListenAddress(o.listen, "listen", true);
  if (!listen.ok()) return listen.status();
  INDEXER_RETURN_IF_ERROR(CheckCanListen(*listen, "listen"));
  const std::pair<const std::string*, const char*> others[] = {
      {&o.health_listen, "health_listen"}, {&o.metrics_listen, "metrics_listen"}};
  for (const auto& [text, flag] : others) {
    if (text->empty()) continue;
    absl::StatusOr<ListenAddress> a =
        ParseListenAddress(*text, flag, /*allow_unix=*/text == &o.health_listen);
    if (!a.ok()) return a.status();
    INDEXER_RETURN_IF_ERROR(CheckCanListen(*a, flag));
  }
  return listen;
}

// Sets a server's builder plugins: gRPC reflection, or none. Plugins are otherwise registered
// process-wide, and the health listener must serve nothing but grpc.health.v1.
class Plugins final : public grpc::ServerBuilderOption {
 public:
  explicit Plugins(bool reflection) : reflection_(reflection) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
    if (reflection_) {
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
    }
  }

 private:
  const bool reflection_;
};

// A builder refusing a port another server holds: with SO_REUSEPORT two servers would split the
// traffic while holding different sequences.
std::unique_ptr<grpc::ServerBuilder> Builder(bool reflection) {
  grpc::EnableDefaultHealthCheckService(true);
  auto builder = std::make_unique<grpc::ServerBuilder>();
  builder->SetOption(std::make_unique<Plugins>(reflection));
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  return builder;
}
}  // namespace

absl::StatusOr<std::unique_ptr<IndexerServer>> IndexerServer::Start(const ServerOptions& options) {
  if (absl::StatusOr<ListenAddress> a = CheckListenAddresses(options); !a.ok()) return a.status();
  engine::DeviceChoice choice;
  choice.kind = options.device;
  choice.cuda_devices = options.devices;
  choice.cpu_devices = options.cpu_devices;
  absl::StatusOr<std::vector<engine::DeviceBackend>> backends =
      engine::MakeBackends(options.engine, choice);
  if (!backends.ok()) return backends.status();
  return Start(options, *std::move(backends));
}

absl::StatusOr<std::unique_ptr<IndexerServer>> IndexerServer::Start(
    const ServerOptions& options, std::vector<engine::DeviceBackend> backends) {
  std::unique_ptr<IndexerServer> s(new IndexerServer());
  absl::StatusOr<ListenAddress> listen = CheckListenAddresses(options);
  if (!listen.ok()) return listen.status();
  s->listen_ = *std::move(listen);
  INDEXER_RETURN_IF_ERROR(s->LoadAccessControl(options));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(options);
  if (!credentials.ok()) return credentials.status();
  INDEXER_RETURN_IF_ERROR(CheckSnapshotDir(options.snapshot_dir));
  INDEXER_RETURN_IF_ERROR(s->StartEngine(options, std::move(backends)));
  INDEXER_RETURN_IF_ERROR(s->StartMetrics(options));
  s->MakeServices(options);
  INDEXER_RETURN_IF_ERROR(s->StartGrpc(options, *std::move(credentials)));
  INDEXER_RETURN_IF_ERROR(s->StartHealthListener(options));
  s->SetServing(true);
  s->StartMonitors(options);
  return s;
}

absl::Status IndexerServer::LoadAccessControl(const ServerOptions& options) {
  access_ = std::make_unique<AccessControl>();
  if (options.token_file.empty()) return absl::OkStatus();
  absl::StatusOr<AccessControl> access =
      AccessControl::FromTokenFile(options.token_file, options.engine.BytesPerPage());
  if (!access.ok()) return access.status();
  *access_ = *std::move(access);
  for (const std::string& warning : access_->warnings()) spdlog::warn("{}", warning);
  if (options.tls_cert.empty()) {
    spdlog::warn("--token_file without TLS: tokens cross the network in clear text; add "
                 "--tls_cert and --tls_key unless every client is on a trusted network");
  }
  return absl::OkStatus();
}

absl::Status IndexerServer::StartEngine(const ServerOptions& options,
                                        std::vector<engine::DeviceBackend> backends) {
  // Answers must fit one gRPC message: the engine refuses (and applies nothing of) a request
  // whose answer would not, keeping some room for the message's framing.
  engine::EngineConfig config = options.engine;
  config.max_response_bytes = std::max<int64_t>(options.max_message_bytes - 4096, 1024);
  engine::PageQuotas quotas;
  quotas.default_pages = options.tenant_quota_pages;
  for (const auto& [tenant, pages] : access_->quotas()) quotas.per_tenant[tenant] = pages;
  engine_ = std::make_unique<engine::Engine>(config, std::move(backends), std::move(quotas));
  if (options.restore.empty()) return absl::OkStatus();
  const absl::Time start = absl::Now();
  engine::SnapshotStats stats;
  const absl::Status restored = engine_->RestoreSnapshot(options.restore, &stats);
  if (!restored.ok()) {
    return absl::Status(restored.code(), absl::StrCat("--restore: ", restored.message()));
  }
  spdlog::info("restored {} sequences, {} pages ({} bytes) from {} in {:.3f} s", stats.sequences,
               stats.pages, stats.bytes, options.restore,
               absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

absl::Status IndexerServer::StartMetrics(const ServerOptions& options) {
  metrics_ = std::make_unique<ServiceMetrics>(engine_.get(), engine_->backend().name());
  engine_->SetObserver(metrics_.get());
  if (options.metrics_listen.empty()) return absl::OkStatus();
  const absl::Status serving = metrics_->Serve(options.metrics_listen);
  if (serving.ok()) return serving;
  return absl::Status(serving.code(), absl::StrCat("--metrics_listen: ", serving.message()));
}

void IndexerServer::MakeServices(const ServerOptions& options) {
  executor_ = std::make_unique<RequestExecutor>(HandlerThreads(options), options.handler_spin_us);
  calls_ = std::make_unique<CallTracker>();
  regions_ = std::make_unique<RegionRegistry>(options.max_regions, engine_->DeviceTensorOrdinals(),
                                              engine_->TakesMappedHostTensors());
  service_ = std::make_unique<IndexerService>(engine_.get(), executor_.get(), access_.get(),
                                              metrics_.get(), flags::ProgramVersion(), options.max_message_bytes,
                                              calls_.get(), regions_.get());
  admin_service_ = std::make_unique<IndexerAdminService>(
      engine_.get(), executor_.get(), access_.get(), options.snapshot_dir, calls_.get());
}

absl::Status IndexerServer::StartGrpc(const ServerOptions& options,
                                      std::shared_ptr<grpc::ServerCredentials> credentials) {
  std::unique_ptr<grpc::ServerBuilder> builder = Builder(/*reflection=*/true);
  builder->AddListeningPort(options.listen, std::move(credentials), &port_);
  builder->RegisterService(service_.get());
  builder->RegisterService(admin_service_.get());
  builder->SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder->SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  server_ = builder->BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen: cannot listen on ", options.listen,
        options.tls_cert.empty() ? " (is the address valid?)"
                                 : " (is the address valid, and do the TLS certificate and key "
                                   "parse and match?)"));
  }
  if (listen_.kind != ListenAddress::Kind::kTcp) port_ = 0;  // gRPC reports 1 for a socket
  // The socket is the server's only access control on a shared host: its user and group (in a
  // pod, the fsGroup a sidecar shares) may connect, others not.
  if (listen_.kind == ListenAddress::Kind::kUnix && chmod(listen_.path.c_str(), 0660) != 0) {
    spdlog::warn("--listen: cannot make {} group-writable: {}", listen_.path, strerror(errno));
  }
  return absl::OkStatus();
}

absl::Status IndexerServer::StartHealthListener(const ServerOptions& options) {
  if (options.health_listen.empty()) return absl::OkStatus();
  std::unique_ptr<grpc::ServerBuilder> builder = Builder(/*reflection=*/false);
  builder->AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                            &health_port_);
  // Every other method answers UNIMPLEMENTED (CallbackGenericService's default); it also gives
  // the server the callback queue that the default health service runs on.
  unimplemented_ = std::make_unique<grpc::CallbackGenericService>();
  builder->RegisterCallbackGenericService(unimplemented_.get());
  // Health requests are a service name; nothing larger has a reason to arrive here.
  builder->SetMaxReceiveMessageSize(64 << 10);
  health_server_ = builder->BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("--health_listen: cannot listen on ", options.health_listen));
  }
  if (absl::StartsWith(options.health_listen, "unix")) health_port_ = 0;
  return absl::OkStatus();
}

void IndexerServer::StartMonitors(const ServerOptions& options) {
  // A failed device cannot be repaired in-process: probes and load balancers must send work
  // elsewhere and restart the server.
  ServiceMetrics* metrics = metrics_.get();
  device_health_ = std::make_unique<DeviceHealthMonitor>(
      engine_.get(), [metrics](int d) { return metrics->DeviceLabel(d); },
      [this](const absl::Status&) { SetServing(false); }, kDeviceHealthPeriod);
  if (options.idle_ttl > absl::ZeroDuration()) {
    reaper_ = std::make_unique<IdleReaper>(engine_.get(), options.idle_ttl,
                                           [metrics](int64_t n) { metrics->RecordReclaimed(n); });
  }
}

void IndexerServer::SetServing(bool serving) {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    health->SetServingStatus(kServiceName, serving);
    health->SetServingStatus(serving);
  }
}

std::string IndexerServer::listening_on() const { return ListeningOn(listen_, port_); }

void IndexerServer::Shutdown(absl::Duration drain, absl::Duration not_serving_grace) {
  if (stopped_ || server_ == nullptr) return;
  stopped_ = true;
  reaper_.reset();
  device_health_.reset();
  SetServing(false);
  // Health checks answer NOT_SERVING for a moment before the listener closes, so that load
  // balancers and readiness probes stop sending new work first.
  if (not_serving_grace > absl::ZeroDuration()) absl::SleepFor(not_serving_grace);
  const absl::Time deadline = absl::Now() + drain;
  calls_->StopAdmitting();
  service_->BeginShutdown();
  const int64_t in_flight = calls_->in_flight();
  if (in_flight > 0) {
    spdlog::info("shutdown: refusing new calls; waiting for {} calls in flight", in_flight);
  }
  absl::Time grpc_deadline = deadline;
  if (calls_->WaitUntilIdle(deadline)) {
    // Every answer has been handed to gRPC. Keep the connections open (gRPC still reads them)
    // for a moment, so that clients receive the last replies before the connections close; then
    // give gRPC that moment too, even past the deadline, so that it closes them with a GOAWAY
    // instead of cancelling what remains (its own calls: health watches), which resets them.
    if (drain > absl::ZeroDuration()) {
      const absl::Time linger_until = calls_->last_done() + kLinger;
      const absl::Time now = absl::Now();
      if (linger_until > now) absl::SleepFor(linger_until - now);
    }
    grpc_deadline = std::max(deadline, absl::Now() + kLinger);
  } else {
    spdlog::warn("shutdown: {} calls still running after the drain time ({}); cancelling them",
                 calls_->in_flight(), absl::FormatDuration(drain));
    // gRPC cancels the calls, but would still wait for their handlers: stop the selections they
    // wait for, so that nothing computes answers nobody will receive.
    engine_->AbandonSelections();
  }
  server_->Shutdown(absl::ToChronoTime(grpc_deadline));
  server_->Wait();
  // The health listener answers NOT_SERVING until the main listener has closed.
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  executor_->Stop();
}

IndexerServer::~IndexerServer() {
  Shutdown(absl::ZeroDuration(), absl::ZeroDuration());
  if (executor_ != nullptr) executor_->Stop();
}

}  // namespace indexer::server
