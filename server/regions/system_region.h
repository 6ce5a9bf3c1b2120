// SystemRegion: one mapping of a POSIX shared memory object that a client created on the
// server's host, read-write, for tensors passed by reference (RegionRegistry). The mapping stays
// until the object is destroyed, whatever the client does with the object's name: unlinking it
// keeps the memory alive. Shrinking the object under the mapping is the client's fault and
// faults the server on the next access; nothing here can prevent it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/regions/region_memory.h"

namespace indexer::server {

class SystemRegion final : public RegionMemory {
 public:
  // Maps `byte_size` bytes at `offset` of the object `key` ("/name", as shm_open names it).
  // INVALID_ARGUMENT for a bad key, an empty range or one past the object's size; NOT_FOUND
  // when there is no such object; PERMISSION_DENIED when it cannot be opened read-write;
  // INTERNAL with the system's reason otherwise.
  static absl::StatusOr<std::unique_ptr<SystemRegion>> Map(absl::string_view key, uint64_t offset,
                                                           uint64_t byte_size);
  ~SystemRegion() override;
  SystemRegion(const SystemRegion&) = delete;
  SystemRegion& operator=(const SystemRegion&) = delete;

  // The region's first byte (`offset` of the object) and its size.
  uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }

 private:
  SystemRegion(void* mapping, size_t mapped, uint8_t* data, uint64_t size)
      : mapping_(mapping), mapped_(mapped), data_(data), size_(size) {}

  void* const mapping_;  // from the page-aligned offset below the region
  const size_t mapped_;
  uint8_t* const data_;
  const uint64_t size_;
};

// OK when `key` is a shm_open name: "/" then 1 to kMaxSystemKeyBytes - 1 characters, none "/".
inline constexpr size_t kMaxSystemKeyBytes = 251;
absl::Status CheckSystemKey(absl::string_view key);

}  // namespace indexer::server
