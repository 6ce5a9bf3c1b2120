// TestSeed: the seed of a randomised test, INDEXER_TEST_SEED when set (to replay a failure),
// else a fresh one from std::random_device. Tests print the seed they ran with in their traces.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>

namespace indexer::testing {

inline uint64_t TestSeed() {
  if (const char* env = std::getenv("INDEXER_TEST_SEED"); env != nullptr && *env) {
    return std::strtoull(env, nullptr, 10);
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace indexer::testing
