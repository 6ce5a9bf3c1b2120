// IndexerServer: a running indexer gRPC server (engine, backend, services, health checking and
// reflection), with TLS, token authentication and a restored snapshot when its options ask for
// them. main() runs one; end-to-end tests run one in-process on a loopback port.
//
// It listens on options.listen: host:port or a Unix domain socket (unix:/run/indexer/indexer.sock,
// made readable and writable by the server's user and group). With options.health_listen it also
// serves grpc.health.v1, and nothing else, in plaintext on that address, for probes that cannot
// speak TLS or carry tokens (the kubelet's gRPC probe, Docker's HEALTHCHECK).
//
// Health (on both listeners, for "" and "indexer.v1.Indexer"): SERVING once started;
// NOT_SERVING from Shutdown() on, and for good once a device has failed (KeyCacheBackend::Health:
// a sticky CUDA error), seen within kDeviceHealthPeriod by a DeviceHealthMonitor, which also
// logs the device and its error.
//
// Start() returns once the server accepts calls. Shutdown() may be called once, from any thread.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "server/access_control.h"
#include "server/admin_service.h"
#include "server/call_tracker.h"
#include "server/device_health_monitor.h"
#include "server/idle_reaper.h"
#include "server/indexer_service.h"
#include "server/listen_address.h"
#include "server/metrics.h"
#include "server/request_executor.h"
#include "server/server_options.h"

namespace indexer::server {

class IndexerServer {
 public:
  // Builds the backends (one per device: options.device, devices, cpu_devices), the engine and
  // the gRPC server, restores options.restore when given, binds and starts. Errors: those of the
  // backend factory, of the token file, TLS files or snapshot folder (naming the flag), of the
  // restore (nothing is served then), or UNAVAILABLE naming the flag when an address cannot be
  // bound (in use, or another server answers on the socket).
  static absl::StatusOr<std::unique_ptr<IndexerServer>> Start(const ServerOptions& options);
  // The same on backends the caller built, one per device with the slots MakeBackends would
  // give them (options.device, devices and cpu_devices are then ignored). For tests that
  // inject faulty backends.
  static absl::StatusOr<std::unique_ptr<IndexerServer>> Start(
      const ServerOptions& options, std::vector<engine::DeviceBackend> backends);

  // How often the server looks for failed devices.
  static constexpr absl::Duration kDeviceHealthPeriod = absl::Milliseconds(100);

  ~IndexerServer();

  // The bound TCP port (useful with a listen address ending in :0); 0 on a Unix socket.
  int port() const { return port_; }
  // Where the server listens, for the startup log: "port 50051" or "unix:/path/to.sock".
  std::string listening_on() const;
  // The health-only listener's TCP port (0 when options.health_listen is empty or a socket).
  int health_port() const { return health_port_; }
  engine::Engine& engine() { return *engine_; }
  // The Prometheus port (0 when --metrics_listen is empty).
  int metrics_port() const { return metrics_->port(); }

  // Graceful stop: health checks answer NOT_SERVING for `not_serving_grace`; then new calls are
  // refused with UNAVAILABLE, open BatchStreams end after their answer in progress, and the calls
  // in flight get up to `drain` to finish (those still running then are cancelled). Once they
  // are answered the connections stay open for up to kLinger more (drain > 0), so that the last
  // replies reach their clients before gRPC closes the connections (CallTracker says why); then
  // the handler threads are joined. Shutdown may so take up to 2 x kLinger past `drain`.
  void Shutdown(absl::Duration drain, absl::Duration not_serving_grace = absl::ZeroDuration());

  // How long Shutdown keeps the connections open after the last call was answered, and gives
  // gRPC to close them.
  static constexpr absl::Duration kLinger = absl::Milliseconds(200);

 private:
  IndexerServer() = default;
  // The steps of Start, in order. Each returns an error naming the flag at fault.
  absl::Status LoadAccessControl(const ServerOptions& options);
  absl::Status StartEngine(const ServerOptions& options, std::vector<engine::DeviceBackend> backends);
  absl::Status StartMetrics(const ServerOptions& options);
  void MakeServices(const ServerOptions& options);
  absl::Status StartGrpc(const ServerOptions& options,
                         std::shared_ptr<grpc::ServerCredentials> credentials);
  absl::Status StartHealthListener(const ServerOptions& options);
  void StartMonitors(const ServerOptions& options);
  // Sets grpc.health.v1's answer, for "" and the indexer service, on every listener.
  void SetServing(bool serving);

  ListenAddress listen_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<ServiceMetrics> metrics_;
  std::unique_ptr<RequestExecutor> executor_;
  std::unique_ptr<AccessControl> access_;
  // Before the services and the server: calls end (OnDone) until server_ is gone.
  std::unique_ptr<CallTracker> calls_;
  std::unique_ptr<RegionRegistry> regions_;  // the clients' shared-memory regions
  std::unique_ptr<IndexerService> service_;
  std::unique_ptr<IndexerAdminService> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::CallbackGenericService> unimplemented_;  // before health_server_
  std::unique_ptr<grpc::Server> health_server_;  // --health_listen; null when off
  int port_ = 0;
  int health_port_ = 0;
  bool stopped_ = false;
  // Last: stopped first (they use the engine, the metrics and the servers' health).
  std::unique_ptr<IdleReaper> reaper_;
  std::unique_ptr<DeviceHealthMonitor> device_health_;
};

}  // namespace indexer::server
