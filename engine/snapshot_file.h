// The snapshot file: everything an engine holds (sequences, block tables, attention pages and the
// key pages' stored bytes), so that a restarted server can carry on without re-running prefills.
// Engine::WriteSnapshot and Engine::RestoreSnapshot use the classes below; this file only knows
// the byte layout, the checksum and how to write a file atomically.
//
// Layout, all integers little-endian:
//
//   header     magic "IDXSNAP\0" (8 bytes), u32 version (1 or 2), u32 head_dim, u32 layers,
//              u32 key_storage (0 bf16, 1 fp8 e4m3, 2 fp4 e2m1), u32 block_size (128),
//              u32 devices (version 2: the writer's device count; version 1: 0),
//              u64 page_bytes (one page, every layer), u64 num_pages, u64 num_sequences
//   sequences  num_sequences times: u32 tenant bytes, tenant, u32 id bytes, id,
//              u8 flags (bit 0: attention pages decided, bit 1: has attention pages),
//              u64 length per layer, u32 blocks, u32 page index (into the pages below) per block,
//              u32 attention pages, i32 attention page id per block,
//              version 2 only: u32 device (index of the device holding its pages)
//   pages      num_pages times page_bytes: per layer, one page exactly as the cache holds it
//              (kernels/numeric.h: [block_size][head_dim] bf16 or fp8 elements, or fp4 codes
//              then scales); slots past every sequence's length are zero
//   trailer    u32 CRC-32C of every byte before the trailer, end magic "IDXSEND\0" (8 bytes)
//
// A page shared by several sequences (forks) is stored once and referenced by each; such
// sequences are on one device. Version 1 files (written by one-device servers, which still write
// them, so older servers read their files) put every sequence on device 0.
//
// Not thread-safe: one writer or reader belongs to one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::engine {

// The newest version this code reads and writes; it reads every version from 1.
inline constexpr uint32_t kSnapshotVersion = 2;

struct SnapshotHeader {
  uint32_t version = kSnapshotVersion;
  uint32_t devices = 0;  // version 2: the writer's device count
  uint32_t head_dim = 0;
  uint32_t layers = 0;
  uint32_t key_storage = 0;
  uint32_t block_size = 0;
  uint64_t page_bytes = 0;
  uint64_t num_pages = 0;
  uint64_t num_sequences = 0;
};

struct SnapshotSequence {
  std::string tenant;
  std::string id;
  bool attn_decided = false;
  bool has_attn_pages = false;
  std::vector<int64_t> lengths;     // per layer
  std::vector<uint32_t> pages;      // per block: index of its page in the file
  std::vector<int32_t> attn_pages;  // per block, when has_attn_pages
  uint32_t device = 0;              // version 2; 0 in version 1

  bool operator==(const SnapshotSequence&) const = default;
};

// Writes a temporary file PATH.tmp.XXXXXX (a fresh name, created exclusively, mode 0600) and
// renames it over PATH only when everything is written and on disk: a crash or a failure at any
// point leaves PATH as it was (and removes the temporary file when it can). Files or links
// already in the folder, whatever their names, are never opened or followed.
class SnapshotWriter {
 public:
  // Creates the temporary file. Every write-side error is INTERNAL carrying the path and the
  // system's reason.
  static absl::StatusOr<std::unique_ptr<SnapshotWriter>> Create(const std::string& path);
  ~SnapshotWriter();  // removes the temporary file unless Commit() succeeded
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  // Version 1 or 2; WriteSequence writes the fields of the header's version.
  absl::Status WriteHeader(const SnapshotHeader& header);
  absl::Status WriteSequence(const SnapshotSequence& seq);
  absl::Status WritePages(const uint8_t* data, size_t bytes);
  // Writes the trailer, flushes, fsyncs, renames the temporary file to PATH and fsyncs the
  // folder.
  absl::Status Commit();

  uint64_t bytes_written() const { return offset_; }

 private:
  SnapshotWriter(std::string path, std::string tmp_path, int fd)
      : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd) {}
  absl::Status Append(const void* data, size_t n);
  absl::Status Flush();
  absl::Status Fail(absl::string_view what, int error);

  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint32_t version_ = kSnapshotVersion;
  bool committed_ = false;
  uint32_t crc_ = 0;
  uint64_t offset_ = 0;
  std::string buffer_;
};

// Reads a snapshot front to back, checksumming as it goes. Every structural problem (a short
// file, a bad magic, an impossible size) is DATA_LOSS naming the path and the byte offset.
class SnapshotReader {
 public:
  // NOT_FOUND / PERMISSION_DENIED / ... when the file cannot be opened.
  static absl::StatusOr<std::unique_ptr<SnapshotReader>> Open(const std::string& path);
  ~SnapshotReader();
  SnapshotReader(const SnapshotReader&) = delete;
  SnapshotReader& operator=(const SnapshotReader&) = delete;

  // Reads and checks the magic; FAILED_PRECONDITION for a version this code does not read.
  // ReadSequence then reads the fields of the file's version.
  absl::Status ReadHeader(SnapshotHeader* header);
  // `layers` lengths per sequence; strings and block counts past the limits are DATA_LOSS.
  absl::Status ReadSequence(uint32_t layers, uint64_t max_blocks, SnapshotSequence* seq);
  absl::Status ReadPages(uint8_t* dst, size_t bytes);
  // Checks the checksum and the end magic, and that nothing follows them.
  absl::Status ReadTrailer();

  uint64_t offset() const { return offset_; }
  uint64_t file_size() const { return file_size_; }
  // CRC-32C of everything read so far.
  uint32_t crc() const { return crc_; }

 private:
  SnapshotReader(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), file_size_(size) {}
  // Reads exactly n bytes (and checksums them unless raw); DATA_LOSS at the end of the file.
  absl::Status Read(void* dst, size_t n, bool checksum = true);
  absl::Status Corrupt(absl::string_view what) const;

  std::string path_;
  int fd_ = -1;
  uint32_t version_ = kSnapshotVersion;
  uint64_t file_size_ = 0;
  uint64_t offset_ = 0;
  uint32_t crc_ = 0;
  std::string buffer_;
  size_t buffer_pos_ = 0;
};

}  // namespace indexer::engine
