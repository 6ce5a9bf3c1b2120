#include "engine/snapshot_file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/crc32c.h"
#include "engine/status_macros.h"

namespace indexer::engine {
namespace {

constexpr char kMagic[8] = {'I', 'D', 'X', 'S', 'N', 'A', 'P', '\0'};
constexpr char kEndMagic[8] = {'I', 'D', 'X', 'S', 'E', 'N', 'D', '\0'};
constexpr size_t kBufferBytes = size_t{1} << 20;
// Longest tenant name and sequence id a reader accepts (the engine's own limits are lower).
constexpr uint32_t kMaxNameBytes = 4096;
// Smallest encoding of one sequence with one layer: two empty names, flags, one length, two
// counts. Bounds how many sequences a file of a given size can claim.
constexpr uint64_t kMinSequenceBytes = 4 + 4 + 1 + 8 + 4 + 4;

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}

uint32_t GetU32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

uint64_t GetU64(const uint8_t* p) { return uint64_t{GetU32(p)} | uint64_t{GetU32(p + 4)} << 32; }

// A write-side failure: INTERNAL with the system's reason (disk full, permission denied, ...),
// since to a caller of WriteSnapshot they are all the server's trouble.
absl::Status WriteError(int error, absl::string_view what) {
  return absl::InternalError(absl::ErrnoToStatus(error, what).message());
}

std::string Folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SnapshotWriter

absl::StatusOr<std::unique_ptr<SnapshotWriter>> SnapshotWriter::Create(const std::string& path) {
  // A name of its own, created exclusively: a file or link already in the folder is never
  // opened, so it can lend the snapshot neither its mode nor a target outside the folder.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return WriteError(error, absl::StrCat("cannot create a snapshot file next to ", path));
  }
  std::unique_ptr<SnapshotWriter> w(new SnapshotWriter(path, std::move(tmp), fd));
  // The keys of every tenant: owner only, whatever the umask or the creator's default.
  if (fchmod(fd, 0600) != 0) return w->Fail("cannot set the mode of snapshot file", errno);
  w->buffer_.reserve(kBufferBytes);
  return w;
}

SnapshotWriter::~SnapshotWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_) unlink(tmp_path_.c_str());
}

absl::Status SnapshotWriter::Fail(absl::string_view what, int error) {
  return WriteError(error, absl::StrCat(what, " ", tmp_path_));
}

absl::Status SnapshotWriter::Flush() {
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Fail("cannot write snapshot file", errno);
    }
    done += static_cast<size_t>(n);
  }
  buffer_.clear();
  return absl::OkStatus();
}

absl::Status SnapshotWriter::Append(const void* data, size_t n) {
  crc_ = Crc32c(crc_, data, n);
  offset_ += n;
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t take = std::min(n, kBufferBytes - buffer_.size());
    buffer_.append(p, take);
    p += take;
    n -= take;
    if (buffer_.size() == kBufferBytes) INDEXER_RETURN_IF_ERROR(Flush());
  }
  return absl::OkStatus();
}

absl::Status SnapshotWriter::WriteHeader(const SnapshotHeader& h) {
  if (h.version < 1 || h.version > kSnapshotVersion) {
    return absl::InternalError(absl::StrCat("cannot write snapshot format version ", h.version));
  }
  version_ = h.version;
  std::string b(kMagic, sizeof(kMagic));
  PutU32(&b, h.version);
  PutU32(&b, h.head_dim);
  PutU32(&b, h.layers);
  PutU32(&b, h.key_storage);
  PutU32(&b, h.block_size);
  PutU32(&b, h.version >= 2 ? h.devices : 0);
  PutU64(&b, h.page_bytes);
  PutU64(&b, h.num_pages);
  PutU64(&b, h.num_sequences);
  return Append(b.data(), b.size());
}

absl::Status SnapshotWriter::WriteSequence(const SnapshotSequence& s) {
  std::string b;
  PutU32(&b, static_cast<uint32_t>(s.tenant.size()));
  b += s.tenant;
  PutU32(&b, static_cast<uint32_t>(s.id.size()));
  b += s.id;
  b.push_back(static_cast<char>((s.attn_decided ? 1 : 0) | (s.has_attn_pages ? 2 : 0)));
  for (int64_t len : s.lengths) PutU64(&b, static_cast<uint64_t>(len));
  PutU32(&b, static_cast<uint32_t>(s.pages.size()));
  for (uint32_t p : s.pages) PutU32(&b, p);
  PutU32(&b, static_cast<uint32_t>(s.attn_pages.size()));
  for (int32_t a : s.attn_pages) PutU32(&b, static_cast<uint32_t>(a));
  if (version_ >= 2) {
    PutU32(&b, s.device);
  } else if (s.device != 0) {
    return absl::InternalError("a version 1 snapshot cannot place a sequence on another device than 0");
  }
  return Append(b.data(), b.size());
}

absl::Status SnapshotWriter::WritePages(const uint8_t* data, size_t bytes) {
  return Append(data, bytes);
}

absl::Status SnapshotWriter::Commit() {
  std::string trailer;
  PutU32(&trailer, crc_);
  trailer.append(kEndMagic, sizeof(kEndMagic));
  INDEXER_RETURN_IF_ERROR(Append(trailer.data(), trailer.size()));
  INDEXER_RETURN_IF_ERROR(Flush());
  if (fsync(fd_) != 0) return Fail("cannot fsync snapshot file", errno);
  if (close(fd_) != 0) {
    fd_ = -1;
    return Fail("cannot close snapshot file", errno);
  }
  fd_ = -1;
  if (rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    return WriteError(error, absl::StrCat("cannot rename ", tmp_path_, " to ", path_));
  }
  committed_ = true;
  // The rename itself is durable only once the folder is on disk too.
  const std::string folder = Folder(path_);
  const int dir = open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    fsync(dir);
    close(dir);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// SnapshotReader

absl::StatusOr<std::unique_ptr<SnapshotReader>> SnapshotReader::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return absl::ErrnoToStatus(error, absl::StrCat("cannot open snapshot file ", path));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot file ", path, " is not a regular file"));
  }
  return std::unique_ptr<SnapshotReader>(
      new SnapshotReader(path, fd, static_cast<uint64_t>(st.st_size)));
}

SnapshotReader::~SnapshotReader() {
  if (fd_ >= 0) close(fd_);
}

absl::Status SnapshotReader::Corrupt(absl::string_view what) const {
  return absl::DataLossError(
      absl::StrCat("snapshot file ", path_, " is corrupt at byte ", offset_, ": ", what));
}

absl::Status SnapshotReader::Read(void* dst, size_t n, bool checksum) {
  char* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    if (buffer_pos_ == buffer_.size()) {
      buffer_.resize(kBufferBytes);
      ssize_t got;
      do {
        got = read(fd_, buffer_.data(), buffer_.size());
      } while (got < 0 && errno == EINTR);
      if (got < 0) {
        const int error = errno;
        buffer_.clear();
        buffer_pos_ = 0;
        return absl::ErrnoToStatus(error, absl::StrCat("cannot read snapshot file ", path_));
      }
      buffer_.resize(static_cast<size_t>(got));
      buffer_pos_ = 0;
      if (got == 0) {
        return absl::DataLossError(absl::StrCat(
            "snapshot file ", path_, " is truncated: it ends at byte ", offset_ + done,
            " where ", n - done, " more bytes were expected"));
      }
    }
    const size_t take = std::min(n - done, buffer_.size() - buffer_pos_);
    std::memcpy(out + done, buffer_.data() + buffer_pos_, take);
    buffer_pos_ += take;
    done += take;
  }
  if (checksum) crc_ = Crc32c(crc_, dst, n);
  offset_ += n;
  return absl::OkStatus();
}

absl::Status SnapshotReader::ReadHeader(SnapshotHeader* h) {
  uint8_t b[8 + 6 * 4 + 3 * 8];
  INDEXER_RETURN_IF_ERROR(Read(b, sizeof(b)));
  if (std::memcmp(b, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(
        absl::StrCat("file ", path_, " is not an indexer snapshot (its first bytes are not the "
                     "snapshot magic)"));
  }
  h->version = GetU32(b + 8);
  if (h->version < 1 || h->version > kSnapshotVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot file ", path_, " has format version ", h->version,
                     "; this server reads versions 1 to ", kSnapshotVersion));
  }
  version_ = h->version;
  h->devices = h->version >= 2 ? GetU32(b + 28) : 0;
  h->head_dim = GetU32(b + 12);
  h->layers = GetU32(b + 16);
  h->key_storage = GetU32(b + 20);
  h->block_size = GetU32(b + 24);
  h->page_bytes = GetU64(b + 32);
  h->num_pages = GetU64(b + 40);
  h->num_sequences = GetU64(b + 48);
  if (h->page_bytes == 0 || h->num_pages > file_size_ / h->page_bytes ||
      h->num_sequences > file_size_ / kMinSequenceBytes) {
    return Corrupt(absl::StrCat("the header claims ", h->num_pages, " pages of ", h->page_bytes,
                                " bytes and ", h->num_sequences,
                                " sequences, more than the file's ", file_size_, " bytes hold"));
  }
  return absl::OkStatus();
}

absl::Status SnapshotReader::ReadSequence(uint32_t layers, uint64_t max_blocks,
                                          SnapshotSequence* s) {
  uint8_t u32[4];
  const auto read_name = [&](std::string* name, const char* what) -> absl::Status {
    INDEXER_RETURN_IF_ERROR(Read(u32, 4));
    const uint32_t n = GetU32(u32);
    if (n > kMaxNameBytes) return Corrupt(absl::StrCat(what, " of ", n, " bytes"));
    name->resize(n);
    return Read(name->data(), n);
  };
  INDEXER_RETURN_IF_ERROR(read_name(&s->tenant, "a tenant name"));
  INDEXER_RETURN_IF_ERROR(read_name(&s->id, "a sequence id"));
  uint8_t flags = 0;
  INDEXER_RETURN_IF_ERROR(Read(&flags, 1));
  if (flags > 3) return Corrupt(absl::StrCat("sequence flags ", int{flags}));
  s->attn_decided = (flags & 1) != 0;
  s->has_attn_pages = (flags & 2) != 0;
  s->lengths.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    uint8_t u64[8];
    INDEXER_RETURN_IF_ERROR(Read(u64, 8));
    const uint64_t len = GetU64(u64);
    if (len > max_blocks * 128) return Corrupt(absl::StrCat("a sequence length of ", len));
    s->lengths[l] = static_cast<int64_t>(len);
  }
  INDEXER_RETURN_IF_ERROR(Read(u32, 4));
  const uint32_t blocks = GetU32(u32);
  if (blocks > max_blocks) return Corrupt(absl::StrCat("a block table of ", blocks, " blocks"));
  s->pages.resize(blocks);
  for (uint32_t& p : s->pages) {
    INDEXER_RETURN_IF_ERROR(Read(u32, 4));
    p = GetU32(u32);
  }
  INDEXER_RETURN_IF_ERROR(Read(u32, 4));
  const uint32_t attn = GetU32(u32);
  if (attn > max_blocks) return Corrupt(absl::StrCat(attn, " attention pages"));
  s->attn_pages.resize(attn);
  for (int32_t& a : s->attn_pages) {
    INDEXER_RETURN_IF_ERROR(Read(u32, 4));
    a = static_cast<int32_t>(GetU32(u32));
  }
  s->device = 0;
  if (version_ >= 2) {
    INDEXER_RETURN_IF_ERROR(Read(u32, 4));
    s->device = GetU32(u32);
  }
  return absl::OkStatus();
}

absl::Status SnapshotReader::ReadPages(uint8_t* dst, size_t bytes) { return Read(dst, bytes); }

absl::Status SnapshotReader::ReadTrailer() {
  const uint32_t computed = crc_;
  uint8_t b[4 + sizeof(kEndMagic)];
  INDEXER_RETURN_IF_ERROR(Read(b, sizeof(b), /*checksum=*/false));
  if (std::memcmp(b + 4, kEndMagic, sizeof(kEndMagic)) != 0) {
    return Corrupt("the end marker is missing");
  }
  if (GetU32(b) != computed) {
    return absl::DataLossError(absl::StrCat(
        "snapshot file ", path_, " is corrupt: its checksum is ", GetU32(b),
        " but its contents sum to ", computed, " (CRC-32C)"));
  }
  if (offset_ != file_size_) {
    return Corrupt(absl::StrCat(file_size_ - offset_, " bytes follow the end marker"));
  }
  return absl::OkStatus();
}

}  // namespace indexer::engine
