#include "engine/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "engine/cpu_backend.h"
#if INDEXER_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace indexer::engine {

bool BuiltWithCuda() { return INDEXER_HAVE_CUDA != 0; }

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeBackend(const EngineConfig& config,
                                                             absl::string_view device) {
  if (device == "cpu") return std::unique_ptr<KeyCacheBackend>(new CpuBackend(config));
  if (device != "cuda" && device != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("device is '", device, "'; it must be auto, cpu or cuda"));
  }
#if INDEXER_HAVE_CUDA
  const absl::Status visible = CudaDeviceAvailable();
  if (visible.ok()) return MakeCudaBackend(config);
  if (device == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda was asked for but no GPU is usable: ", visible.message()));
  }
#else
  if (device == "cuda") {
    return absl::FailedPreconditionError(
        "device cuda was asked for but this build has no CUDA backend (nvcc was not found)");
  }
#endif
  return std::unique_ptr<KeyCacheBackend>(new CpuBackend(config));
}

}  // namespace indexer::engine
