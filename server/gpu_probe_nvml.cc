// OpenGpuProbe on builds with the CUDA backend: NVML, loaded from the driver with dlopen (the
// binary does not link it, so a host without the driver still starts the server on the CPU).
// Devices are matched by PCI bus id, which NVML and CUDA share whatever CUDA_VISIBLE_DEVICES
// renumbers. Only the handful of NVML entry points below are used, declared here as NVML's C
// API defines them.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <spdlog/spdlog.h>

#include <type_traits>

#include "server/gpu_metrics.h"

namespace indexer::server {
namespace {

using NvmlReturn = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
using NvmlDevice = struct NvmlDeviceOpaque*;
struct NvmlMemory {  // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct NvmlUtilization {  // nvmlUtilization_t, percent
  unsigned int gpu;
  unsigned int memory;
};

class NvmlProbe final : public GpuProbe {
 public:
  ~NvmlProbe() override {
    if (shutdown_ != nullptr) shutdown_();
    if (library_ != nullptr) dlclose(library_);
  }

  // nullptr (the reason logged) when NVML is missing or does not initialise.
  static std::unique_ptr<NvmlProbe> Open() {
    std::unique_ptr<NvmlProbe> p(new NvmlProbe());
    p->library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (p->library_ == nullptr) return Fail("libnvidia-ml.so.1 is not loadable");
    const auto load = [&](const char* name, auto* fn) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(p->library_, name));
      return *fn != nullptr;
    };
    NvmlReturn (*init)() = nullptr;
    if (!load("nvmlInit_v2", &init) || !load("nvmlShutdown", &p->shutdown_) ||
        !load("nvmlDeviceGetHandleByPciBusId_v2", &p->by_bus_id_) ||
        !load("nvmlDeviceGetMemoryInfo", &p->memory_) ||
        !load("nvmlDeviceGetUtilizationRates", &p->utilization_)) {
      p->shutdown_ = nullptr;
      return Fail("an NVML entry point is missing");
    }
    if (init() != 0) {
      p->shutdown_ = nullptr;
      return Fail("nvmlInit failed");
    }
    return p;
  }

  std::optional<GpuSample> Sample(int ordinal) const override {
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal) != cudaSuccess) return std::nullopt;
    NvmlDevice device = nullptr;
    if (by_bus_id_(bus_id, &device) != 0) return std::nullopt;
    GpuSample s;
    NvmlMemory memory{};
    if (memory_(device, &memory) == 0) {
      s.memory_used_bytes = static_cast<double>(memory.used);
      s.memory_total_bytes = static_cast<double>(memory.total);
    }
    NvmlUtilization utilization{};
    if (utilization_(device, &utilization) == 0) {
      s.utilization = utilization.gpu / 100.0;
      s.memory_utilization = utilization.memory / 100.0;
    }
    return s;
  }

 private:
  NvmlProbe() = default;
  static std::unique_ptr<NvmlProbe> Fail(const char* why) {
    spdlog::warn("GPU metrics are off: {}", why);
    return nullptr;
  }

  void* library_ = nullptr;
  NvmlReturn (*shutdown_)() = nullptr;
  NvmlReturn (*by_bus_id_)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*memory_)(NvmlDevice, NvmlMemory*) = nullptr;
  NvmlReturn (*utilization_)(NvmlDevice, NvmlUtilization*) = nullptr;
};

}  // namespace

std::unique_ptr<GpuProbe> OpenGpuProbe() { return NvmlProbe::Open(); }

}  // namespace indexer::server
