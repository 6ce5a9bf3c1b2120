// DeviceFailure: a one-way latch a KeyCacheBackend sets when its device can no longer be used
// (on CUDA, a sticky error that poisons the context: engine/cuda/cuda_errors.h), so that every
// later call fails fast with the first error's text instead of touching the device again.
//
// Thread-safe: any thread may call any method. Check() is one atomic load while the device is
// healthy, so backends call it at the start of every call. Once failed, a latch stays failed
// for its life (the process must be restarted to use the device again).
//
// Why UNAVAILABLE (not INTERNAL): the server can no longer do this work, and nothing of the
// refused call was applied (the engine rolls a failed step back), which is what UNAVAILABLE
// means to gRPC clients; it is also the code this server already answers when it cannot take
// work (shutting down, dead: README "Failure behaviour"). INTERNAL stays for failures the
// device survives (a non-sticky CUDA error). server/status_convert.h maps codes one to one.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace indexer::engine {

class DeviceFailure {
 public:
  DeviceFailure() = default;
  DeviceFailure(const DeviceFailure&) = delete;
  DeviceFailure& operator=(const DeviceFailure&) = delete;

  // Marks the device failed because of `cause` (which must not be OK), unless it already was.
  // Returns the status every call gets from now on: UNAVAILABLE, naming `device` and carrying
  // the first cause's message (a later cause is ignored).
  absl::Status Fail(absl::string_view device, const absl::Status& cause) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load(std::memory_order_relaxed)) {
      status_ = absl::UnavailableError(absl::StrCat(
          device, " failed and cannot be used until the server is restarted: ", cause.message()));
      failed_.store(true, std::memory_order_release);
    }
    return status_;
  }

  // OK while the device is usable; otherwise the status Fail returned.
  absl::Status Check() const {
    if (!failed_.load(std::memory_order_acquire)) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

  bool failed() const { return failed_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  absl::Status status_;  // guarded by mu_; set once, when failed_ becomes true
};

}  // namespace indexer::engine
