// SharedMemoryRegion: a POSIX shared memory object that this process creates, maps and, when
// done, unlinks: the client side of tensors passed by reference (RegisterSystemRegion). A
// scheduler on the server's host writes keys and queries into it, registers it once, and sends
// RegionRefs instead of bytes; outputs can be written back into it.
//
// What the server needs of it while registered (indexer.proto): the object keeps its size, and
// the bytes a call names are not touched until the call's answer arrives. Not thread-safe; the
// memory itself is the caller's to share between threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "indexer/v1/indexer.pb.h"

namespace indexer::client {

class SharedMemoryRegion {
 public:
  // Creates the object `key` ("/name") of `bytes` bytes, zeroed, readable and writable by this
  // user only, and maps it. ALREADY_EXISTS when the name is taken; INVALID_ARGUMENT for a bad
  // key or 0 bytes; INTERNAL with the system's reason otherwise.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(absl::string_view key,
                                                                     size_t bytes);
  // Unmaps and unlinks (a server that mapped it keeps its mapping until it unregisters).
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& key() const { return key_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

  // Copies `bytes` to `offset` (INVALID_ARGUMENT when they do not fit) and returns the
  // reference to them under the registered name `region`.
  absl::StatusOr<v1::RegionRef> Write(absl::string_view region, uint64_t offset,
                                      absl::string_view bytes);
  // A reference to `byte_size` bytes at `offset` under the registered name `region` (no checks:
  // the server checks).
  static v1::RegionRef Ref(absl::string_view region, uint64_t offset, uint64_t byte_size);
  // `values` int32 values at `offset` (for outputs the server wrote); empty when out of range.
  std::span<const int32_t> Int32s(uint64_t offset, size_t values) const;

 private:
  SharedMemoryRegion(std::string key, uint8_t* data, size_t size)
      : key_(std::move(key)), data_(data), size_(size) {}

  const std::string key_;
  uint8_t* const data_;
  const size_t size_;
};

}  // namespace indexer::client
