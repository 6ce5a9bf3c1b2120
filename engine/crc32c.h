// CRC-32C (Castagnoli, the polynomial iSCSI and ext4 use): the checksum of snapshot files.
// Pure functions; call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace indexer::engine {

// Extends `crc` (0 for a fresh checksum) by `n` bytes at `data`, so that
// Crc32c(Crc32c(0, a, na), b, nb) == Crc32c(0, a + b, na + nb). Crc32c(0, "123456789", 9) is
// 0xE3069283.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace indexer::engine
