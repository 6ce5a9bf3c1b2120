// FatalFaultBackend: a KeyCacheBackend (a real backend inside, usually a CpuBackend) whose device
// can be made to fail for good, as a CudaBackend does after a sticky CUDA error, so that the
// engine's and the server's handling of a failed device is tested without a GPU.
//
// FailNextCall(cause) arms it: the next call that reaches the device fails with `cause`, which
// latches the same DeviceFailure the CUDA backend uses (engine/device_failure.h). From then on
// Health() and every call return the latched UNAVAILABLE status, and no call reaches the inner
// backend any more (device_calls() stops counting), as a failed CUDA backend never touches the
// GPU again. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "engine/device_failure.h"
#include "engine/key_cache_backend.h"

namespace indexer::testing {

// The text a CudaBackend's status carries for a kernel that faulted.
inline constexpr char kIllegalAddress[] =
    "CUDA error in select: cudaErrorIllegalAddress: an illegal memory access was encountered";

class FatalFaultBackend final : public engine::KeyCacheBackend {
 public:
  FatalFaultBackend(std::unique_ptr<engine::KeyCacheBackend> inner, std::string device_label)
      : inner_(std::move(inner)), label_(std::move(device_label)) {}

  // The next call that reaches the device fails with `cause` and fails the device.
  void FailNextCall(absl::Status cause = absl::InternalError(kIllegalAddress)) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = std::move(cause);
  }
  // Calls that reached the device (the inner backend, or the armed fault).
  int64_t device_calls() const { return device_calls_.load(); }

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::Status Health() const override { return failure_.Check(); }
  absl::Status WriteKeys(const engine::KeyWrite& w) override {
    return Guarded([&] { return inner_->WriteKeys(w); });
  }
  absl::Status WriteKeysBatch(std::span<const engine::KeyWrite> writes) override {
    return Guarded([&] { return inner_->WriteKeysBatch(writes); });
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    return Guarded([&] { return inner_->CopyPage(src, dst); });
  }
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    return Guarded([&] { return inner_->ReadPages(pages, dst); });
  }
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override {
    return Guarded([&] { return inner_->WritePages(pages, src); });
  }
  absl::Status Select(std::span<const engine::SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override {
    return Guarded([&] { return inner_->Select(tasks, page_table); });
  }

 private:
  // As CudaBackend::Guarded: refuse once failed; a fatal fault fails the device.
  template <typename Body>
  absl::Status Guarded(Body body) {
    if (absl::Status failed = failure_.Check(); !failed.ok()) return failed;
    ++device_calls_;
    std::optional<absl::Status> cause;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cause = std::exchange(armed_, std::nullopt);
    }
    if (cause.has_value()) return failure_.Fail(label_, *cause);
    return body();
  }

  std::unique_ptr<engine::KeyCacheBackend> inner_;
  const std::string label_;
  engine::DeviceFailure failure_;
  std::mutex mu_;
  std::optional<absl::Status> armed_;  // guarded by mu_
  std::atomic<int64_t> device_calls_{0};
};

}  // namespace indexer::testing
