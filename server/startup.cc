#include "server/startup.h"

#include <pthread.h>

namespace indexer::server {

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
