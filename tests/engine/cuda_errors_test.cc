// engine/cuda/cuda_errors.h: which CUDA errors fail the device for good, and CudaStatus's
// payload, read back by CudaErrorOf. Pure functions of cudaError_t: no GPU is needed.
#include "engine/cuda/cuda_errors.h"

#include <gtest/gtest.h>

namespace indexer::engine {
namespace {

TEST(CudaErrors, FaultsThatPoisonTheContextAreSticky) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorECCUncorrectable,
                        cudaErrorHardwareStackError, cudaErrorIllegalInstruction,
                        cudaErrorMisalignedAddress, cudaErrorInvalidAddressSpace, cudaErrorInvalidPc,
                        cudaErrorLaunchTimeout, cudaErrorAssert, cudaErrorNvlinkUncorrectable,
                        cudaErrorMpsClientTerminated, cudaErrorExternalDevice,
                        static_cast<cudaError_t>(226), static_cast<cudaError_t>(721)}) {
    EXPECT_TRUE(IsStickyCudaError(e)) << cudaGetErrorName(e);
  }
}

TEST(CudaErrors, ErrorsThatFailOneCallAreNot) {
  for (cudaError_t e : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue,
                        cudaErrorLaunchOutOfResources, cudaErrorInvalidConfiguration,
                        cudaErrorNotReady, cudaErrorInvalidDevice, cudaErrorNoDevice,
                        cudaErrorInsufficientDriver, cudaErrorUnknown}) {
    EXPECT_FALSE(IsStickyCudaError(e)) << cudaGetErrorName(e);
  }
}

TEST(CudaErrors, CudaStatusCarriesTheCode) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
  const absl::Status s = CudaStatus(cudaErrorIllegalAddress, "select");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("CUDA error in select: cudaErrorIllegalAddress"), absl::string_view::npos) << s;
  EXPECT_EQ(CudaErrorOf(s), cudaErrorIllegalAddress);
  EXPECT_EQ(CudaErrorOf(CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc")), cudaErrorMemoryAllocation);
  EXPECT_EQ(CudaErrorOf(absl::OkStatus()), cudaSuccess);
  EXPECT_EQ(CudaErrorOf(absl::InternalError("not from CUDA")), cudaSuccess);
}

}  // namespace
}  // namespace indexer::engine
