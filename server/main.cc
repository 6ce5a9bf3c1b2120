// indexer-server: serves the indexer gRPC API (proto/indexer/v1/indexer.proto).
//
// Configuration comes from flags or INDEXER_* environment variables (--help lists them).
// SIGINT/SIGTERM: health turns NOT_SERVING, in-flight calls drain (up to --drain_seconds), with
// --snapshot_on_shutdown every sequence is written to a snapshot file, and the process exits 0
// (1 when that snapshot fails).
#include <signal.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "server/startup.h"

int main(int argc, char** argv) {
  // First, before any thread exists: every thread inherits the mask, so only Wait takes them.
  indexer::server::ShutdownSignals signals;
  indexer::server::SetCommandLineUsage(
      "server/",
      "Serves sparse-attention block selection (the MiniMax M3 lightning indexer) over gRPC.\n"
      "Every flag can also be set by an environment variable INDEXER_<FLAG>, e.g. "
      "INDEXER_CAPACITY=4GiB.\nUsage: indexer-server [flags]",
      [] { return std::string("indexer-server ") + indexer::server::Version() + "\n"; });
  std::vector<std::string> args = indexer::server::ArgsWithEnvironment(argc, argv);
  std::vector<char*> arg_ptrs;
  for (auto& a : args) arg_ptrs.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());

  absl::StatusOr<indexer::server::ServerOptions> options = indexer::server::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "indexer-server: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  spdlog::set_level(spdlog::level::from_str(options->log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  auto server = indexer::server::IndexerServer::Start(*options);
  if (!server.ok()) {
    spdlog::error("startup failed: {}", server.status().ToString());
    return 1;
  }
  const auto& engine = (*server)->engine();
  spdlog::info("indexer-server {} serving on port {}: backend={} ({}) devices={} {}",
               indexer::server::Version(), (*server)->port(), engine.backend().name(),
               engine.backend().device(), engine.num_devices(), indexer::server::Summary(*options));
  for (int d = 0; d < engine.num_devices(); ++d) {
    const indexer::engine::DeviceSlot& slot = engine.slot(d);
    spdlog::info("device {}: {} ordinal {} ({}), pages {} to {}", d, engine.backend(d).name(),
                 slot.ordinal, engine.backend(d).device(), slot.first_page,
                 slot.first_page + slot.num_pages - 1);
  }

  const int sig = signals.Wait();
  spdlog::info("received {}, draining in-flight calls for up to {} s", sig == SIGINT ? "SIGINT" : "SIGTERM",
               options->drain_seconds);
  (*server)->Shutdown(absl::Seconds(options->drain_seconds), absl::Seconds(options->not_serving_seconds));
  if (!options->snapshot_on_shutdown.empty()) {
    const absl::Time start = absl::Now();
    indexer::engine::SnapshotStats saved;
    const absl::Status status =
        (*server)->engine().WriteSnapshot(options->snapshot_on_shutdown, &saved);
    if (!status.ok()) {
      spdlog::error("snapshot on shutdown failed: {}", status.ToString());
      return 1;
    }
    spdlog::info("snapshot on shutdown: {} sequences, {} pages, {} bytes written to {} in {:.3f} s",
                 saved.sequences, saved.pages, saved.bytes, options->snapshot_on_shutdown,
                 absl::ToDoubleSeconds(absl::Now() - start));
  }
  const auto stats = (*server)->engine().Stats();
  spdlog::info("stopped; {} live sequences, {} of {} pages in use were dropped", stats.live_sequences,
               stats.total_pages - stats.free_pages, stats.total_pages);
  return 0;
}
