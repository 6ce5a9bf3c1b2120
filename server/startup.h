// What the gRPC server binaries (indexer-server, indexer-echo-server) do first in main, before
// any thread exists: block the shutdown signals they later take with sigwait, and say what absl's
// --help, --helpshort and --version print. Call from main's thread, before absl::ParseCommandLine
// and before starting any thread. Nothing here fails.
#pragma once

#include <signal.h>

#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace indexer::server {

// SIGINT and SIGTERM, blocked in the thread that constructs this (so every thread it starts
// afterwards inherits the mask) and delivered only through Wait. Construct one first in main;
// the signals stay blocked after it is destroyed.
class ShutdownSignals {
 public:
  ShutdownSignals();
  ShutdownSignals(const ShutdownSignals&) = delete;
  ShutdownSignals& operator=(const ShutdownSignals&) = delete;

  // Blocks until SIGINT or SIGTERM arrives; returns which.
  int Wait();

 private:
  sigset_t signals_;
};

// Sets what absl::ParseCommandLine's --help and --helpshort list: `message` and then only the
// flags defined in files whose path contains `flag_files` (absl lists every linked library's
// flags otherwise). `version` gives --version's text; empty keeps absl's default. Call once.
void SetCommandLineUsage(absl::string_view flag_files, absl::string_view message,
                         std::function<std::string()> version = nullptr);

}  // namespace indexer::server
