// ServerOptions: everything indexer-server is configured with, and how it is read from flags
// and environment variables (INDEXER_<FLAG NAME IN CAPITALS>; a flag on the command line wins).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/config.h"

namespace indexer::server {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";
  std::string device = "auto";     // auto | cpu | cuda
  int64_t max_message_bytes = 64 << 20;
  int handler_threads = 0;         // 0 = max(4, 2 x hardware threads)
  double drain_seconds = 30;       // graceful shutdown: how long in-flight calls may take
  double not_serving_seconds = 1;  // graceful shutdown: NOT_SERVING before the listener closes
  std::string log_level = "info";  // trace | debug | info | warn | error | off
  engine::EngineConfig engine;

  // Security and durability (docs/SECURITY.md). Empty strings: off.
  std::string tls_cert;          // PEM certificate chain of the server; with tls_key: TLS
  std::string tls_key;           // PEM private key of tls_cert
  std::string tls_client_ca;     // PEM CA(s): clients must present a certificate they signed
  std::string token_file;        // bearer tokens -> tenants (AccessControl); empty: no auth
  int64_t tenant_quota_pages = 0;  // default page quota of every tenant (0: none)
  std::string snapshot_dir;      // where IndexerAdmin.Snapshot writes
  std::string snapshot_on_shutdown;  // snapshot file written after a graceful shutdown
  std::string restore;           // snapshot file loaded at start

  // Operations. Empty / zero: off.
  std::string metrics_listen;    // Prometheus /metrics bind address (host:port)
  absl::Duration idle_ttl = absl::ZeroDuration();  // release sequences unused this long
};

// Parses a capacity: a page count ("8192") or a size ("2GiB", "512MiB", "1.5GB") converted to
// whole pages of `bytes_per_page`. INVALID_ARGUMENT for anything else or a zero result.
absl::StatusOr<int64_t> ParseCapacity(absl::string_view text, int64_t bytes_per_page);

// Reads the flags (after absl::ParseCommandLine) into options and validates them.
absl::StatusOr<ServerOptions> OptionsFromFlags();

// Before absl::ParseCommandLine: returns argv with one --flag=value for each INDEXER_* variable
// that names a known flag, placed before the real arguments so that those win.
std::vector<std::string> ArgsWithEnvironment(int argc, char** argv);

// One line describing the configuration, for the startup log.
std::string Summary(const ServerOptions& options);

}  // namespace indexer::server
