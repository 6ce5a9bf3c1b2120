#include "client/cpp/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace indexer::client {

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    absl::string_view key, size_t bytes) {
  if (key.size() < 2 || key[0] != '/' || key.find('/', 1) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory key \"", key, "\" must be \"/\" and a name without \"/\""));
  }
  if (bytes == 0) return absl::InvalidArgumentError("a shared memory region needs a byte");
  const std::string name(key);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, S_IRUSR | S_IWUSR);
  if (fd < 0) {
    const std::string why = absl::StrCat("cannot create ", key, ": ", std::strerror(errno));
    return errno == EEXIST ? absl::AlreadyExistsError(why) : absl::InternalError(why);
  }
  void* mapping = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int err = errno;
  ::close(fd);
  if (mapping == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return absl::InternalError(
        absl::StrCat("cannot size or map ", bytes, " bytes of ", key, ": ", std::strerror(err)));
  }
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, static_cast<uint8_t*>(mapping), bytes));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  ::munmap(data_, size_);
  ::shm_unlink(key_.c_str());
}

absl::StatusOr<v1::RegionRef> SharedMemoryRegion::Write(absl::string_view region, uint64_t offset,
                                                        absl::string_view bytes) {
  if (offset > size_ || bytes.size() > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("writing ", bytes.size(), " bytes at ", offset,
                                                   " overruns ", key_, " of ", size_, " bytes"));
  }
  std::memcpy(data_ + offset, bytes.data(), bytes.size());
  return Ref(region, offset, bytes.size());
}

v1::RegionRef SharedMemoryRegion::Ref(absl::string_view region, uint64_t offset,
                                      uint64_t byte_size) {
  v1::RegionRef ref;
  ref.set_region(std::string(region));
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

std::span<const int32_t> SharedMemoryRegion::Int32s(uint64_t offset, size_t values) const {
  if (offset % alignof(int32_t) != 0 || offset > size_ ||
      values > (size_ - offset) / sizeof(int32_t)) {
    return {};
  }
  return {reinterpret_cast<const int32_t*>(data_ + offset), values};
}

}  // namespace indexer::client
