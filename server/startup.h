// What the gRPC server binaries (indexer-server, indexer-echo-server) do first in main, before
// any thread exists: keep freed memory for the next calls, and block the shutdown signals they
// later take with sigwait. Nothing here fails.
#pragma once

#include <signal.h>

namespace indexer::server {

// Makes the allocator keep the memory that calls free, for the calls after them. A decode step's
// request bytes and per-call state take hundreds of KB at 256 items and are freed on whichever
// thread ends the call; with glibc's defaults a freed heap top goes back to the kernel and blocks
// past its adaptive threshold are mapped afresh, so that each call would fault tens of pages in
// again. Here blocks up to 32 MB come from the heaps, and a heap keeps up to 64 MB free at its
// top. Idempotent; without glibc it does nothing.
void KeepFreedMemory();

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
