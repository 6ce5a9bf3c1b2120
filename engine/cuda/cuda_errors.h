// CUDA errors as absl::Status: the one translation of cudaError_t (CudaStatus: INTERNAL,
// carrying CUDA's name and message, and the code itself as a payload), and which errors leave
// the device unusable (IsStickyCudaError), so that CudaBackend can latch its DeviceFailure.
//
// Pure functions; any thread may call them. None of them touches the device.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace indexer::engine {

// Whether `err` is sticky: it poisons the CUDA context, so that every later CUDA call in the
// process fails too, and the only remedy is to restart the process. These are the errors whose
// documentation in driver_types.h says "This leaves the process in an inconsistent state and
// any further CUDA work will return the same error" or "the process must be terminated and
// relaunched" (faulting kernels, device asserts, watchdog timeouts, contained exceptions, MPS
// termination), plus uncorrectable ECC and NVLink errors, after which NVIDIA requires a GPU
// reset. Everything else (out of memory, invalid values, launch resources, ...) fails only the
// call that made it. The two newest codes are compared by value (stable across CUDA releases)
// so that older toolkits, which lack their names, still compile.
constexpr bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:       // 700: a kernel read or wrote outside its memory
    case cudaErrorLaunchTimeout:        // 702: the display watchdog killed a kernel
    case cudaErrorAssert:               // 710: a device-side assert fired
    case cudaErrorHardwareStackError:   // 714
    case cudaErrorIllegalInstruction:   // 715
    case cudaErrorMisalignedAddress:    // 716
    case cudaErrorInvalidAddressSpace:  // 717
    case cudaErrorInvalidPc:            // 718
    case cudaErrorLaunchFailure:        // 719: any other exception while a kernel ran
    case cudaErrorECCUncorrectable:     // 214
    case cudaErrorNvlinkUncorrectable:  // 220
    case cudaErrorMpsClientTerminated:  // 810
    case cudaErrorExternalDevice:       // 911
      return true;
    default:
      break;
  }
  const int code = static_cast<int>(err);
  return code == 226 /* cudaErrorContained */ || code == 721 /* cudaErrorTensorMemoryLeak */;
}

// Where CudaStatus keeps the cudaError_t (decimal) in the statuses it makes.
inline constexpr char kCudaErrorPayload[] = "type.indexer/cuda_error";

// OK for cudaSuccess; otherwise INTERNAL "CUDA error in <what>: <name>: <message>", with the
// code as the kCudaErrorPayload payload (CudaErrorOf reads it back).
inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  absl::Status status = absl::InternalError(absl::StrCat(
      "CUDA error in ", what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  status.SetPayload(kCudaErrorPayload, absl::Cord(absl::StrCat(static_cast<int>(err))));
  return status;
}

// The CUDA error a CudaStatus carries; cudaSuccess for OK and for statuses not made by it.
inline cudaError_t CudaErrorOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kCudaErrorPayload);
  int code = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &code)) return cudaSuccess;
  return static_cast<cudaError_t>(code);
}

}  // namespace indexer::engine
