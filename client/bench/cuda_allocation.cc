#include "client/bench/cuda_allocation.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaAllocation>> CudaAllocation::Create(size_t bytes, int device) {
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  void* data = nullptr;
  if (absl::Status s = Check(cudaMalloc(&data, bytes), "cudaMalloc"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  if (absl::Status s = Check(cudaIpcGetMemHandle(&handle, data), "cudaIpcGetMemHandle"); !s.ok()) {
    (void)cudaFree(data);
    return s;
  }
  return std::unique_ptr<CudaAllocation>(new CudaAllocation(
      data, bytes, device, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
}

CudaAllocation::~CudaAllocation() {
  (void)cudaSetDevice(device_);
  (void)cudaFree(data_);
  (void)cudaGetLastError();
}

absl::Status CudaAllocation::Upload(uint64_t at, const void* src, size_t n) {
  if (absl::Status s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return Check(cudaMemcpy(static_cast<char*>(data_) + at, src, n, cudaMemcpyHostToDevice),
               "cudaMemcpy to the CUDA region");
}

absl::Status CudaAllocation::Download(uint64_t at, void* dst, size_t n) const {
  if (absl::Status s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return Check(cudaMemcpy(dst, static_cast<const char*>(data_) + at, n, cudaMemcpyDeviceToHost),
               "cudaMemcpy from the CUDA region");
}

}  // namespace indexer::bench
