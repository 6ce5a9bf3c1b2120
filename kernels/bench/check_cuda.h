// CHECK_CUDA for the benchmark and probe binaries (kernels/bench/): a failed CUDA call prints
// its name, place and message and exits 1. Command-line tools only; library code returns
// cudaError_t or absl::Status instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t err_ = (expr);                                                        \
    if (err_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, \
                   __LINE__, cudaGetErrorString(err_));                                     \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
