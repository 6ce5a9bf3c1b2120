// OpenGpuProbe on builds without the CUDA backend: there are no GPUs to read.
#include "server/gpu_metrics.h"

namespace indexer::server {

std::unique_ptr<GpuProbe> OpenGpuProbe() { return nullptr; }

}  // namespace indexer::server
