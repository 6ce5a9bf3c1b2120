// indexer-server: serves the indexer gRPC API (proto/indexer/v1/indexer.proto).
//
// Configuration comes from flags or INDEXER_* environment variables (--help lists them, by
// section). SIGINT/SIGTERM: health turns NOT_SERVING, in-flight calls drain (up to
// --drain_seconds), with --snapshot_on_shutdown every sequence is written to a snapshot file, and
// the process exits. Exit status (HelpText says the same): 0 after a graceful shutdown; 1 when
// the server cannot start or the snapshot on shutdown fails; 2 a usage error (an unknown flag
// or argument, a value that does not parse or is refused).
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flags/command_line.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "server/startup.h"

namespace {

namespace server = indexer::server;

constexpr int kFailed = 1;

int UsageError(const std::string& message) {
  return indexer::flags::ReportUsageError("indexer-server", message);
}

void LogStart(server::IndexerServer& s, const server::ServerOptions& options) {
  const indexer::engine::Engine& engine = s.engine();
  spdlog::info("indexer-server {} serving on {}: backend={} ({}) devices={} {}",
               indexer::flags::ProgramVersion(), s.listening_on(), engine.backend().name(),
               engine.backend().device(), engine.num_devices(), server::Summary(options));
  if (!options.health_listen.empty()) {
    spdlog::info("health checks (grpc.health.v1 only, plaintext) on {}",
                 s.health_port() > 0 ? "port " + std::to_string(s.health_port())
                                     : options.health_listen);
  }
  for (int d = 0; d < engine.num_devices(); ++d) {
    const indexer::engine::DeviceSlot& slot = engine.slot(d);
    spdlog::info("device {}: {} ordinal {} ({}), pages {} to {}", d, engine.backend(d).name(),
                 slot.ordinal, engine.backend(d).device(), slot.first_page,
                 slot.first_page + slot.num_pages - 1);
  }
}

// After the drain: the snapshot on shutdown, when asked for. False when it failed (logged).
bool SnapshotOnShutdown(server::IndexerServer& s, const server::ServerOptions& options) {
  if (options.snapshot_on_shutdown.empty()) return true;
  const absl::Time start = absl::Now();
  indexer::engine::SnapshotStats saved;
  const absl::Status status = s.engine().WriteSnapshot(options.snapshot_on_shutdown, &saved);
  if (!status.ok()) {
    spdlog::error("snapshot on shutdown failed: {}", status.ToString());
    return false;
  }
  spdlog::info("snapshot on shutdown: {} sequences, {} pages, {} bytes written to {} in {:.3f} s",
               saved.sequences, saved.pages, saved.bytes, options.snapshot_on_shutdown,
               absl::ToDoubleSeconds(absl::Now() - start));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // First, before any thread exists: the allocator's settings, and the signal mask, which every
  // thread inherits, so that only Wait takes the signals.
  server::KeepFreedMemory();
  server::ShutdownSignals signals;
  // The environment first: the command line overrides it.
  absl::StatusOr<server::EnvironmentFlags> environment = server::ApplyEnvironment(environ);
  absl::StatusOr<indexer::flags::CommandLine> cl =
      indexer::flags::ParseCommandLine(argc, argv, server::IsServerFlag);
  if (!cl.ok()) return UsageError(std::string(cl.status().message()));
  if (cl->help) {
    std::fputs(server::HelpText().c_str(), stdout);
    return 0;
  }
  if (cl->version) {
    std::printf("indexer-server %s\n", indexer::flags::ProgramVersion());
    return 0;
  }
  if (!cl->positional.empty()) {
    return UsageError("unexpected argument '" + cl->positional[0] + "'");
  }
  if (!environment.ok()) return UsageError(std::string(environment.status().message()));
  absl::StatusOr<server::ServerOptions> options = server::OptionsFromFlags();
  absl::Status settings = options.ok() ? server::CheckEnvironmentSettings(environ) : options.status();
  if (!settings.ok()) {
    return UsageError(server::NameTheVariable(settings.message(), *environment, cl->set));
  }
  spdlog::set_level(spdlog::level::from_str(options->log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  for (const std::string& warning : environment->warnings) spdlog::warn("{}", warning);

  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(*options);
  if (!s.ok()) {
    spdlog::error("startup failed: {}", s.status().ToString());
    return kFailed;
  }
  LogStart(**s, *options);

  const int sig = signals.Wait();
  spdlog::info("received {}, draining in-flight calls for up to {} s",
               sig == SIGINT ? "SIGINT" : "SIGTERM", options->drain_seconds);
  (*s)->Shutdown(absl::Seconds(options->drain_seconds), absl::Seconds(options->not_serving_seconds));
  if (!SnapshotOnShutdown(**s, *options)) return kFailed;
  const auto stats = (*s)->engine().Stats();
  spdlog::info("stopped; {} live sequences, {} of {} pages in use were dropped", stats.live_sequences,
               stats.total_pages - stats.free_pages, stats.total_pages);
  return 0;
}
