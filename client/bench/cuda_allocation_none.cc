#include "client/bench/cuda_allocation.h"

namespace indexer::bench {

absl::StatusOr<std::unique_ptr<CudaAllocation>> CudaAllocation::Create(size_t /*bytes*/,
                                                                        int /*device*/) {
  return absl::FailedPreconditionError("this indexer-bench was built without CUDA");
}

CudaAllocation::~CudaAllocation() = default;

absl::Status CudaAllocation::Upload(uint64_t /*at*/, const void* /*src*/, size_t /*n*/) {
  return absl::FailedPreconditionError("this indexer-bench was built without CUDA");
}

absl::Status CudaAllocation::Download(uint64_t /*at*/, void* /*dst*/, size_t /*n*/) const {
  return absl::FailedPreconditionError("this indexer-bench was built without CUDA");
}

}  // namespace indexer::bench
