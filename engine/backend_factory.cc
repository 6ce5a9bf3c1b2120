#include "engine/backend_factory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/cpu_backend.h"
#if INDEXER_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace indexer::engine {
namespace {

// INVALID_ARGUMENT when `devices` pools of capacity_pages pages need ids past int32.
absl::Status CheckPageIds(const EngineConfig& config, int64_t devices) {
  const int64_t limit = std::numeric_limits<int32_t>::max();
  if (devices < 1 || config.capacity_pages > limit / devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "capacity of ", config.capacity_pages, " pages on each of ", devices,
        " devices needs page ids past ", limit, "; lower --capacity or use fewer devices"));
  }
  return absl::OkStatus();
}

// Bytes of host memory available to a new allocation and in all: MemAvailable and MemTotal of
// /proc/meminfo, else the free and total physical pages; 0 for what is unknown.
struct HostMemory {
  int64_t available = 0;
  int64_t total = 0;
};

HostMemory ReadHostMemory() {
  HostMemory m;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") m.available = kib << 10;
    if (key == "MemTotal:") m.total = kib << 10;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (m.available == 0 && page > 0) m.available = int64_t{sysconf(_SC_AVPHYS_PAGES)} * page;
  if (m.total == 0 && page > 0) m.total = int64_t{sysconf(_SC_PHYS_PAGES)} * page;
  return m;
}

double Gib(int64_t bytes) { return static_cast<double>(bytes) / double(int64_t{1} << 30); }

// RESOURCE_EXHAUSTED when `devices` CPU pools would not fit the host's available memory: the
// pool is reserved at start, and one the host cannot back fails there or later, under load.
absl::Status CheckHostMemory(const EngineConfig& config, int devices) {
  const int64_t need = config.capacity_pages * config.BytesPerPage() * devices;
  const HostMemory host = ReadHostMemory();
  if (host.available <= 0 || need <= host.available) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%d pages on %d CPU device(s) need %.2f GiB of host memory, but %.2f GiB is available "
      "of %.2f GiB; lower --capacity",
      config.capacity_pages, devices, Gib(need), Gib(host.available), Gib(host.total)));
}

DeviceSlot SlotOf(const EngineConfig& config, int index, int ordinal) {
  return DeviceSlot{ordinal, int64_t{index} * config.capacity_pages, config.capacity_pages};
}

absl::StatusOr<std::vector<DeviceBackend>> MakeCpuBackends(const EngineConfig& config, int n) {
  if (n < 1 || n > 64) {
    return absl::InvalidArgumentError(absl::StrCat("cpu_devices is ", n, "; it must be in [1, 64]"));
  }
  if (absl::Status s = CheckPageIds(config, n); !s.ok()) return s;
  EngineConfig per_device = config;
  if (config.cpu_threads == 0 && n > 1) {
    // The simulated devices share the machine: each gets an equal share of its threads.
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    per_device.cpu_threads = std::max(1, hw / n);
  }
  if (absl::Status s = CheckHostMemory(config, n); !s.ok()) return s;
  std::vector<DeviceBackend> out;
  try {
    for (int d = 0; d < n; ++d) {
      const DeviceSlot slot = SlotOf(config, d, d);
      out.push_back(DeviceBackend{slot, std::make_unique<CpuBackend>(per_device, slot)});
    }
  } catch (const std::bad_alloc&) {
    // Memory taken by others between the check and the reservation.
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot reserve %.2f GiB of host memory for %d pages on %d CPU device(s); lower "
        "--capacity", Gib(config.capacity_pages * config.BytesPerPage() * n),
        config.capacity_pages, n));
  }
  return out;
}

}  // namespace

bool BuiltWithCuda() { return INDEXER_HAVE_CUDA != 0; }

absl::StatusOr<std::vector<DeviceBackend>> MakeBackends(const EngineConfig& config,
                                                        const DeviceChoice& choice) {
  if (choice.kind == "cpu") return MakeCpuBackends(config, choice.cpu_devices);
  if (choice.kind != "cuda" && choice.kind != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("device is '", choice.kind, "'; it must be auto, cpu or cuda"));
  }
#if INDEXER_HAVE_CUDA
  const absl::Status visible = CudaDeviceAvailable();
  if (visible.ok()) {
    const int count = CudaDeviceCount();
    std::vector<int> ordinals = choice.cuda_devices;
    if (ordinals.empty()) {
      for (int i = 0; i < count; ++i) ordinals.push_back(i);
    }
    absl::flat_hash_set<int> seen;
    for (int ordinal : ordinals) {
      if (ordinal < 0 || ordinal >= count) {
        return absl::InvalidArgumentError(absl::StrCat(
            "devices names GPU ", ordinal, " but ", count, " GPUs are visible (ordinals 0 to ",
            count - 1, ")"));
      }
      if (!seen.insert(ordinal).second) {
        return absl::InvalidArgumentError(absl::StrCat("devices names GPU ", ordinal, " twice"));
      }
    }
    if (ordinals.empty()) {
      return absl::FailedPreconditionError("no CUDA device is visible");
    }
    if (absl::Status s = CheckPageIds(config, static_cast<int64_t>(ordinals.size())); !s.ok()) {
      return s;
    }
    std::vector<DeviceBackend> out;
    for (size_t d = 0; d < ordinals.size(); ++d) {
      const DeviceSlot slot = SlotOf(config, static_cast<int>(d), ordinals[d]);
      absl::StatusOr<std::unique_ptr<KeyCacheBackend>> backend = MakeCudaBackend(config, slot);
      if (!backend.ok()) return backend.status();
      out.push_back(DeviceBackend{slot, std::move(*backend)});
    }
    return out;
  }
  if (choice.kind == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda was asked for but no GPU is usable: ", visible.message()));
  }
#else
  if (choice.kind == "cuda") {
    return absl::FailedPreconditionError(
        "device cuda was asked for but this build has no CUDA backend (nvcc was not found)");
  }
#endif
  return MakeCpuBackends(config, choice.cpu_devices);
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeBackend(const EngineConfig& config,
                                                             absl::string_view device) {
  DeviceChoice choice;
  choice.kind = std::string(device);
#if INDEXER_HAVE_CUDA
  choice.cuda_devices = {0};
#endif
  absl::StatusOr<std::vector<DeviceBackend>> made = MakeBackends(config, choice);
  if (!made.ok()) return made.status();
  return std::move(made->front().backend);
}

}  // namespace indexer::engine
