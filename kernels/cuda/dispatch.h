// The one place where run-time shapes become compile-time constants for the kernels.
#pragma once

// Expands BODY with HEAD_DIM bound to 64, 128 or 256; other values return cudaErrorInvalidValue.
#define INDEXER_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...) \
  [&]() -> cudaError_t {                                   \
    switch (head_dim) {                                    \
      case 64: {                                           \
        constexpr int HEAD_DIM = 64;                       \
        return __VA_ARGS__();                              \
      }                                                    \
      case 128: {                                          \
        constexpr int HEAD_DIM = 128;                      \
        return __VA_ARGS__();                              \
      }                                                    \
      case 256: {                                          \
        constexpr int HEAD_DIM = 256;                      \
        return __VA_ARGS__();                              \
      }                                                    \
      default:                                             \
        return cudaErrorInvalidValue;                      \
    }                                                      \
  }()

// Expands BODY with STORAGE bound to the KeyStorage value.
#define INDEXER_DISPATCH_STORAGE(storage, STORAGE, ...)              \
  [&]() -> cudaError_t {                                             \
    if ((storage) == ::indexer::kernels::KeyStorage::kBf16) {        \
      constexpr auto STORAGE = ::indexer::kernels::KeyStorage::kBf16; \
      return __VA_ARGS__();                                          \
    }                                                                \
    if ((storage) == ::indexer::kernels::KeyStorage::kFp8E4M3) {     \
      constexpr auto STORAGE = ::indexer::kernels::KeyStorage::kFp8E4M3; \
      return __VA_ARGS__();                                          \
    }                                                                \
    constexpr auto STORAGE = ::indexer::kernels::KeyStorage::kFp4E2M1; \
    return __VA_ARGS__();                                            \
  }()
