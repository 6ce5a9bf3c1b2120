#include "server/regions/cuda_region.h"

#include <cuda.h>  // the driver's types, for the one driver entry point looked up below
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace indexer::server {
namespace {

// Makes `device` current on the calling thread (a gRPC handler thread, which serves calls for
// every device) and restores the previous device on exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    entered_ = cudaSetDevice(device);
    (void)cudaGetLastError();
  }
  ~DeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
    (void)cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  cudaError_t entered() const { return entered_; }

 private:
  int previous_ = -1;
  cudaError_t entered_ = cudaSuccess;
};

std::string CudaReason(cudaError_t err) {
  return absl::StrCat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// Bytes from `base` to the end of its allocation, by the driver's cuMemGetAddressRange (looked
// up through the runtime, so that the server links no driver library of its own).
absl::StatusOr<uint64_t> BytesToAllocationEnd(const void* base) {
  using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const AddressRange address_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<AddressRange>(fn);
  }();
  if (address_range == nullptr) {
    return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  }
  const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(base);
  CUdeviceptr first = 0;
  size_t bytes = 0;
  if (address_range(&first, &bytes, at) != CUDA_SUCCESS) {
    return absl::InternalError("cuMemGetAddressRange failed on an opened CUDA IPC allocation");
  }
  return static_cast<uint64_t>(first + bytes - at);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaRegion>> CudaRegion::Open(absl::string_view raw_handle,
                                                            int device, uint64_t offset,
                                                            uint64_t byte_size) {
  if (raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_handle has ", raw_handle.size(), " bytes; a cudaIpcMemHandle_t has ",
        kCudaIpcHandleBytes));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size is 0");
  DeviceScope scope(device);
  if (scope.entered() != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " cannot be used: ", CudaReason(scope.entered())));
  }
  cudaIpcMemHandle_t handle;
  static_assert(sizeof(handle) == kCudaIpcHandleBytes);
  std::memcpy(&handle, raw_handle.data(), sizeof(handle));
  void* base = nullptr;
  const cudaError_t opened = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (opened != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA IPC handle cannot be opened (it must come from cudaIpcGetMemHandle of a live "
        "allocation in another process on this host): ", CudaReason(opened)));
  }
  // Owned from here: closed on every early return.
  std::unique_ptr<CudaRegion> region(new CudaRegion(static_cast<uint8_t*>(base), offset, byte_size, device));
  cudaPointerAttributes attributes{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attributes, base); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaPointerGetAttributes: ", CudaReason(err)));
  }
  if (attributes.type != cudaMemoryTypeDevice || attributes.device != device) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the allocation is on CUDA device ", attributes.device, ", not device_id ", device,
        " (device ids are the server's: see ServerInfo)"));
  }
  absl::StatusOr<uint64_t> allocated = BytesToAllocationEnd(base);
  if (!allocated.ok()) return allocated.status();
  if (offset > *allocated || byte_size > *allocated - offset) {
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                                   " is past the allocation's ", *allocated,
                                                   " bytes"));
  }
  return region;
}

CudaRegion::~CudaRegion() {
  DeviceScope scope(device_);
  (void)cudaIpcCloseMemHandle(base_);
  (void)cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<HostPinning>> HostPinning::Pin(void* data, uint64_t bytes) {
  // Whole pages: the mapping starts on a page and covers the region's last page.
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  void* begin = reinterpret_cast<void*>(first);
  const cudaError_t pinned = cudaHostRegister(begin, end - first,
                                              cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (pinned != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("cudaHostRegister: ", CudaReason(pinned)));
  }
  std::unique_ptr<HostPinning> pinning(new HostPinning(begin));
  void* device = nullptr;
  if (cudaHostGetDevicePointer(&device, data, 0) != cudaSuccess || device != data) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        "the GPU sees pinned host memory at another address than the host");
  }
  return pinning;
}

HostPinning::~HostPinning() {
  (void)cudaHostUnregister(begin_);
  (void)cudaGetLastError();
}

}  // namespace indexer::server
