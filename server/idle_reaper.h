// IdleReaper: the idle-sequence TTL (--idle_ttl). It releases the sequences no call has named
// for `ttl` (Engine::ReclaimIdle), the sequences of a scheduler that died without releasing
// them, and reports each release that freed something to `on_reclaimed` (IndexerServer counts
// them in indexer_sequences_reclaimed_total) and in one log line.
//
// It looks a few times per TTL (every ttl / 4, at most every 10 s) on a thread of its own, so a
// sequence lives at most about 1.25 TTL past its last use. Thread-safe; the destructor stops and
// joins the thread. `engine` must outlive the reaper, and `on_reclaimed` must be safe to call
// until the destructor returns.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/time/time.h"
#include "engine/engine.h"

namespace indexer::server {

class IdleReaper {
 public:
  // `ttl` > 0.
  IdleReaper(engine::Engine* engine, absl::Duration ttl,
             std::function<void(int64_t sequences)> on_reclaimed);
  ~IdleReaper();
  IdleReaper(const IdleReaper&) = delete;
  IdleReaper& operator=(const IdleReaper&) = delete;

  // How often a reaper with this TTL looks.
  static absl::Duration Period(absl::Duration ttl);

 private:
  void Reap();

  engine::Engine* const engine_;
  const absl::Duration ttl_;
  const std::function<void(int64_t)> on_reclaimed_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;   // guarded by stop_mu_
  std::thread thread_;  // last: started once everything above is ready
};

}  // namespace indexer::server
