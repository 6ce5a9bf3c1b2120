#include "server/regions/cuda_region.h"

namespace indexer::server {

absl::StatusOr<std::unique_ptr<CudaRegion>> CudaRegion::Open(absl::string_view /*raw_handle*/,
                                                            int /*device*/, uint64_t /*offset*/,
                                                            uint64_t /*byte_size*/) {
  return absl::FailedPreconditionError(
      "this server was built without CUDA: it takes no CUDA regions");
}

CudaRegion::~CudaRegion() = default;

absl::StatusOr<std::unique_ptr<HostPinning>> HostPinning::Pin(void* /*data*/, uint64_t /*bytes*/) {
  return absl::FailedPreconditionError("this server was built without CUDA");
}

HostPinning::~HostPinning() = default;

}  // namespace indexer::server
