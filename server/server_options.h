// ServerOptions: everything indexer-server is configured with, and how it is read from flags
// and environment variables (INDEXER_<FLAG NAME IN CAPITALS>; a flag on the command line wins),
// and what --help prints. main() calls, in order: ApplyEnvironment, flags::ParseCommandLine
// (with IsServerFlag), OptionsFromFlags, CheckEnvironmentSettings.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/config.h"

namespace indexer::server {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // host:port or unix:/path (ListenAddress)
  std::string health_listen;       // plaintext grpc.health.v1 only; empty: off
  std::string device = "auto";     // auto | cpu | cuda
  std::vector<int> devices;        // CUDA ordinals to drive (--devices); empty: every visible GPU
  int cpu_devices = 1;             // simulated devices of the CPU backend (--cpu_devices)
  int64_t max_message_bytes = 64 << 20;
  int handler_threads = 0;         // 0 = auto (HandlerThreads)
  int handler_spin_us = 0;         // idle handler threads poll this long before sleeping (RequestExecutor)
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
  int max_regions = 64;          // shared-memory regions per tenant (0: none taken)
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

// Parses --devices: "all" (an empty list) or distinct GPU ordinals "0,1,3". INVALID_ARGUMENT
// naming the flag otherwise.
absl::StatusOr<std::vector<int>> ParseDevices(absl::string_view text);

// Reads the flags (after absl::ParseCommandLine) into options and validates them.
absl::StatusOr<ServerOptions> OptionsFromFlags();

// The flags of indexer-server in the sections --help prints them in. Every flag defined in
// server_options.cc is in exactly one section (server_options_test checks).
struct FlagSection {
  const char* title;
  std::vector<const char*> flags;
};
const std::vector<FlagSection>& FlagSections();

// Variables the server reads that are not flags: the CUDA backend's, integers in [min, max].
struct EnvironmentSetting {
  const char* variable;
  const char* default_value;
  int min;
  int max;
  const char* help;
};
const std::vector<EnvironmentSetting>& EnvironmentSettings();

// What ApplyEnvironment did.
struct EnvironmentFlags {
  std::vector<std::string> flags;     // the flags set from INDEXER_<FLAG> variables
  std::vector<std::string> warnings;  // one line per INDEXER_ variable the server does not read
};

// Before the command line is parsed (which then overrides them): sets every
// flag named by an INDEXER_<FLAG> variable of `environment` (NAME=value strings, null-terminated
// like environ). The client tools' INDEXER_SERVER and INDEXER_TOKEN and EnvironmentSettings are
// known and skipped; any other INDEXER_ variable gets a warning, with the nearest known name.
// INVALID_ARGUMENT naming the variable and its flag when a value does not parse.
absl::StatusOr<EnvironmentFlags> ApplyEnvironment(char** environment);

// INVALID_ARGUMENT naming the variable when an EnvironmentSetting of `environment` is not an
// integer in its range (the CUDA backend would ignore it).
absl::Status CheckEnvironmentSettings(char** environment);

// `message` (an error of OptionsFromFlags, which starts with the flag: "--capacity is ...") with
// " (set by INDEXER_CAPACITY)" added when that flag's value came from the environment, not from
// the command line (whose flags are `command_line_flags`).
std::string NameTheVariable(absl::string_view message, const EnvironmentFlags& environment,
                            const std::vector<std::string>& command_line_flags);

// The flags indexer-server accepts on its command line and from INDEXER_ variables: those of
// FlagSections (absl also registers flags of the libraries it links).
bool IsServerFlag(const absl::CommandLineFlag& flag);

// What --help prints: the program's flags by section with defaults, the environment-only
// settings, signals and exit status.
std::string HelpText();

// The handler threads the server runs: options.handler_threads, or when 0 enough for batching
// to gather a full launch from single-sequence calls (each waiting call holds a thread):
// max(64, 4 x hardware threads, batch_max_tasks) with batching, max(4, 2 x hardware threads)
// without; at most 4096.
int HandlerThreads(const ServerOptions& options);

// One line describing the configuration, for the startup log.
std::string Summary(const ServerOptions& options);

}  // namespace indexer::server
