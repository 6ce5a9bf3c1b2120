// CallTracker: the calls the services have admitted and not yet finished, so that a graceful
// shutdown can stop admitting calls, wait until every admitted one has been answered, and only
// then let gRPC close the connections.
//
// Why the wait matters: gRPC closes a connection as soon as its last call ends once shutdown has
// begun. If the client's flow-control updates or pings are still unread then, Linux answers the
// close with a reset and drops the reply bytes it has not sent yet: the client loses an answer
// the server gave. Waiting for the calls, then lingering briefly while gRPC still reads, lets
// the replies out first.
//
// Owned by IndexerServer. The services admit and end calls (RunAuthenticated, BatchStream);
// IndexerServer::Shutdown stops admitting and waits. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "absl/time/time.h"

namespace indexer::server {

class CallTracker {
 public:
  // Admits one call: true, and the caller must call Done() once when the call is over (its
  // status sent, or the call cancelled). False once StopAdmitting() was called: the caller must
  // refuse the call (UNAVAILABLE) and not call Done().
  bool Admit();
  void Done();

  // From now on Admit() returns false.
  void StopAdmitting();

  // Waits until no admitted call remains or `deadline` passes; true when none remains.
  bool WaitUntilIdle(absl::Time deadline);

  // Calls admitted and not yet done.
  int64_t in_flight() const;
  // When the last Done() ran; absl::InfinitePast() before any did.
  absl::Time last_done() const;

 private:
  // std::mutex, not absl::Mutex: Debian's Abseil is built without ThreadSanitizer, which then
  // cannot see what absl::Mutex orders (scripts/tsan.supp).
  mutable std::mutex mu_;
  std::condition_variable idle_;
  int64_t in_flight_ = 0;     // guarded by mu_
  bool admitting_ = true;     // guarded by mu_
  absl::Time last_done_ = absl::InfinitePast();  // guarded by mu_
};

}  // namespace indexer::server
