#include "server/indexer_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/backend_factory.h"

namespace indexer::server {

const char* Version() { return INDEXER_VERSION; }

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
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || access(dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--snapshot_dir ", dir, " is not a folder this server can write"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<IndexerServer>> IndexerServer::Start(const ServerOptions& options) {
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
  s->access_ = std::make_unique<AccessControl>();
  if (!options.token_file.empty()) {
    absl::StatusOr<AccessControl> access =
        AccessControl::FromTokenFile(options.token_file, options.engine.BytesPerPage());
    if (!access.ok()) return access.status();
    *s->access_ = *std::move(access);
    for (const std::string& warning : s->access_->warnings()) spdlog::warn("{}", warning);
    if (options.tls_cert.empty()) {
      spdlog::warn("--token_file without TLS: tokens cross the network in clear text; add "
                   "--tls_cert and --tls_key unless every client is on a trusted network");
    }
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(options);
  if (!credentials.ok()) return credentials.status();
  if (!options.snapshot_dir.empty()) {
    if (absl::Status dir = CheckSnapshotDir(options.snapshot_dir); !dir.ok()) return dir;
  }

  // Answers must fit one gRPC message: the engine refuses (and applies nothing of) a request
  // whose answer would not, keeping some room for the message's framing.
  engine::EngineConfig config = options.engine;
  config.max_response_bytes = std::max<int64_t>(options.max_message_bytes - 4096, 1024);
  engine::PageQuotas quotas;
  quotas.default_pages = options.tenant_quota_pages;
  for (const auto& [tenant, pages] : s->access_->quotas()) quotas.per_tenant[tenant] = pages;
  s->engine_ = std::make_unique<engine::Engine>(config, std::move(backends), std::move(quotas));
  if (!options.restore.empty()) {
    const absl::Time start = absl::Now();
    engine::SnapshotStats stats;
    const absl::Status restored = s->engine_->RestoreSnapshot(options.restore, &stats);
    if (!restored.ok()) {
      return absl::Status(restored.code(), absl::StrCat("--restore: ", restored.message()));
    }
    spdlog::info("restored {} sequences, {} pages ({} bytes) from {} in {:.3f} s", stats.sequences,
                 stats.pages, stats.bytes, options.restore,
                 absl::ToDoubleSeconds(absl::Now() - start));
  }
  s->executor_ = std::make_unique<RequestExecutor>(HandlerThreads(options), options.handler_spin_us);
  s->metrics_ = std::make_unique<ServiceMetrics>(s->engine_.get(), s->engine_->backend().name());
  s->engine_->SetObserver(s->metrics_.get());
  if (!options.metrics_listen.empty()) {
    if (absl::Status m = s->metrics_->Serve(options.metrics_listen); !m.ok()) {
      s->executor_->Stop();
      return absl::Status(m.code(), absl::StrCat("--metrics_listen: ", m.message()));
    }
  }
  s->calls_ = std::make_unique<CallTracker>();
  s->service_ = std::make_unique<IndexerService>(s->engine_.get(), s->executor_.get(),
                                                 s->access_.get(), s->metrics_.get(), Version(),
                                                 options.max_message_bytes, s->calls_.get());
  s->admin_service_ = std::make_unique<IndexerAdminService>(
      s->engine_.get(), s->executor_.get(), s->access_.get(), options.snapshot_dir,
      s->calls_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Refuse a port another server holds: with SO_REUSEPORT two servers would split the traffic
  // while holding different sequences.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen, *credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->admin_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    s->executor_->Stop();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", options.listen,
        options.tls_cert.empty() ? " (address in use or invalid?)"
                                 : " (address in use or invalid, or the TLS certificate and key "
                                   "do not parse or do not match?)"));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  // A failed device cannot be repaired in-process: probes and load balancers must send work
  // elsewhere and restart the server.
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  ServiceMetrics* metrics = s->metrics_.get();
  s->device_health_ = std::make_unique<DeviceHealthMonitor>(
      s->engine_.get(), [metrics](int d) { return metrics->DeviceLabel(d); },
      [health](const absl::Status&) {
        health->SetServingStatus(kServiceName, false);
        health->SetServingStatus(false);
      },
      kDeviceHealthPeriod);
  if (options.idle_ttl > absl::ZeroDuration()) s->StartReaper(options.idle_ttl);
  return s;
}

void IndexerServer::StartReaper(absl::Duration ttl) {
  // Looks a few times per TTL (at most every 10 s), so a sequence lives at most about 1.25 TTL
  // past its last use.
  const absl::Duration period = std::min(ttl / 4, absl::Seconds(10));
  reaper_ = std::thread([this, ttl, period] {
    std::unique_lock<std::mutex> lock(reaper_mu_);
    while (!reaper_cv_.wait_for(lock, absl::ToChronoNanoseconds(period), [this] { return reaper_stop_; })) {
      lock.unlock();
      const int64_t reclaimed = engine_->ReclaimIdle(ttl);
      if (reclaimed > 0) {
        metrics_->RecordReclaimed(reclaimed);
        spdlog::info("idle TTL {}: released {} sequences no call had named", absl::FormatDuration(ttl),
                     reclaimed);
      }
      lock.lock();
    }
  });
}

void IndexerServer::StopReaper() {
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    reaper_stop_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
}

void IndexerServer::Shutdown(absl::Duration drain, absl::Duration not_serving_grace) {
  if (stopped_ || server_ == nullptr) return;
  stopped_ = true;
  StopReaper();
  device_health_.reset();
  server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
  server_->GetHealthCheckService()->SetServingStatus(false);
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
  }
  server_->Shutdown(absl::ToChronoTime(grpc_deadline));
  server_->Wait();
  executor_->Stop();
}

IndexerServer::~IndexerServer() {
  Shutdown(absl::ZeroDuration(), absl::ZeroDuration());
  if (executor_ != nullptr) executor_->Stop();
}

}  // namespace indexer::server
