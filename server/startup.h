// What the gRPC server binaries (indexer-server, indexer-echo-server) do first in main, before
// any thread exists: block the shutdown signals they later take with sigwait. Nothing here fails.
#pragma once

#include <signal.h>

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

}  // namespace indexer::server
