// GpuTest: the fixture of the tests that need a CUDA device. SetUp skips the test, saying why,
// where no CUDA device is usable (as on CI), and otherwise seeds rng_ from TestSeed (a fresh seed,
// or INDEXER_TEST_SEED), recorded as the test's "seed" property: traces print seed_ so that a
// failing run can be repeated. Builds with the CUDA backend only (engine/cuda/cuda_backend.h).
//
// A fixture with more to set up calls the base SetUp first and returns when IsSkipped().
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "engine/config.h"
#include "engine/cuda/cuda_backend.h"
#include "kernels/numeric.h"
#include "tests/testing/test_seed.h"

namespace indexer::testing {

template <typename Base>
class GpuTestOn : public Base {
 protected:
  void SetUp() override {
    const absl::Status gpu = engine::CudaDeviceAvailable();
    if (!gpu.ok()) GTEST_SKIP() << "GPU tests skipped: no usable CUDA device (" << gpu.message() << ")";
    seed_ = TestSeed();
    rng_.seed(seed_);
    this->RecordProperty("seed", std::to_string(seed_));
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

using GpuTest = GpuTestOn<::testing::Test>;
template <typename Param>
using GpuTestWithParam = GpuTestOn<::testing::TestWithParam<Param>>;

// The engine of the GPU tests that compare the CUDA backend with the CPU backend: head_dim 128,
// three layers, `storage`, `capacity_pages` pages.
inline engine::EngineConfig GpuEngineConfig(kernels::KeyStorage storage, int64_t capacity_pages) {
  engine::EngineConfig c;
  c.head_dim = 128;
  c.layers = 3;
  c.key_storage = storage;
  c.capacity_pages = capacity_pages;
  return c;
}

}  // namespace indexer::testing
