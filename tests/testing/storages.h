// The key storages a storage-parameterised suite runs over, and their test names:
//   INSTANTIATE_TEST_SUITE_P(Storage, Suite, EveryStorage(), StorageTestName);
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kernels/numeric.h"

namespace indexer::testing {

inline auto EveryStorage() {
  return ::testing::Values(kernels::KeyStorage::kBf16, kernels::KeyStorage::kFp8E4M3,
                           kernels::KeyStorage::kFp4E2M1);
}

inline std::string StorageTestName(const ::testing::TestParamInfo<kernels::KeyStorage>& info) {
  return kernels::KeyStorageName(info.param);
}

}  // namespace indexer::testing
