#include "server/startup.h"

#include <pthread.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace indexer::server {

void KeepFreedMemory() {
#if defined(__GLIBC__)
  constexpr int kMapAbove = 32 << 20;  // the largest mmap threshold glibc accepts on 64-bit
  constexpr int kKeepFree = 64 << 20;
  mallopt(M_MMAP_THRESHOLD, kMapAbove);
  mallopt(M_TRIM_THRESHOLD, kKeepFree);
#endif
}

ShutdownSignals::ShutdownSignals() {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
}

int ShutdownSignals::Wait() {
  int sig = 0;
  sigwait(&signals_, &sig);
  return sig;
}

}  // namespace indexer::server
