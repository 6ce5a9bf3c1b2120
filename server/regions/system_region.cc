#include "server/regions/system_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace indexer::server {
namespace {

absl::Status OpenError(absl::string_view key, int err) {
  const std::string why = absl::StrCat("cannot open shared memory object ", key, " read-write: ",
                                       std::strerror(err));
  switch (err) {
    case ENOENT: return absl::NotFoundError(why);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(why);
    default: return absl::InternalError(why);
  }
}

// Closes a descriptor when it goes out of scope: the mapping does not need it.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

absl::Status CheckSystemKey(absl::string_view key) {
  if (key.size() < 2 || key.size() > kMaxSystemKeyBytes || key[0] != '/' ||
      key.find('/', 1) != absl::string_view::npos || key.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key \"", key.substr(0, 64), "\" is not a shared memory object name: it must be \"/\" "
        "followed by 1 to ", kMaxSystemKeyBytes - 1, " characters other than \"/\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SystemRegion>> SystemRegion::Map(absl::string_view key,
                                                                 uint64_t offset,
                                                                 uint64_t byte_size) {
  if (absl::Status s = CheckSystemKey(key); !s.ok()) return s;
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size is 0; a region needs a byte");
  const std::string name(key);
  Fd fd{::shm_open(name.c_str(), O_RDWR, 0)};
  if (fd.fd < 0) return OpenError(key, errno);
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("cannot stat ", key, ": ", std::strerror(errno)));
  }
  const uint64_t object = static_cast<uint64_t>(st.st_size);
  if (offset > object || byte_size > object - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", offset, " + byte_size ", byte_size, " is past the end of ", key,
                     ", which holds ", object, " bytes"));
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const size_t mapped = static_cast<size_t>(offset - start + byte_size);
  void* mapping = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd,
                         static_cast<off_t>(start));
  if (mapping == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map ", byte_size, " bytes of ", key, ": ",
                                            std::strerror(errno)));
  }
  uint8_t* data = static_cast<uint8_t*>(mapping) + (offset - start);
  return std::unique_ptr<SystemRegion>(new SystemRegion(mapping, mapped, data, byte_size));
}

SystemRegion::~SystemRegion() { ::munmap(mapping_, mapped_); }

}  // namespace indexer::server
