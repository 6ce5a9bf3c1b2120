#include "server/listen_address.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace indexer::server {
namespace {

absl::Status Invalid(absl::string_view flag, absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " is '", text, "'; ", why));
}

absl::Status Unavailable(absl::string_view flag, absl::string_view text, absl::string_view why) {
  return absl::UnavailableError(absl::StrCat("--", flag, ": cannot listen on ", text, ": ", why));
}

// A socket closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status CheckTcp(const ListenAddress& a, absl::string_view flag) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = absl::StrCat(a.port);
  const int rc = getaddrinfo(a.host.empty() ? nullptr : a.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) return Unavailable(flag, a.text, gai_strerror(rc));
  // A busy or forbidden address is refused; one the host cannot bind at all (an IPv6 address
  // with IPv6 off) only when no address of the name binds, as gRPC then binds the others.
  absl::Status refused = absl::OkStatus();
  absl::Status unbindable = absl::OkStatus();
  bool bound = false;
  for (const addrinfo* ai = found; ai != nullptr && refused.ok(); ai = ai->ai_next) {
    Fd fd(socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
    if (fd.get() < 0) continue;  // an address family this host does not have
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) {
      bound = true;
    } else if (errno == EADDRINUSE) {
      refused = Unavailable(flag, a.text, "address in use (is another server running?)");
    } else if (errno == EACCES) {
      refused = Unavailable(flag, a.text, std::strerror(errno));
    } else {
      unbindable = Unavailable(flag, a.text, std::strerror(errno));
    }
  }
  freeaddrinfo(found);
  if (!refused.ok()) return refused;
  return bound ? absl::OkStatus() : unbindable;
}

absl::Status CheckUnix(const ListenAddress& a, absl::string_view flag) {
  const size_t slash = a.path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : a.path.substr(0, std::max<size_t>(slash, 1));
  struct stat st {};
  if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Unavailable(flag, a.text, absl::StrCat("the folder ", folder, " does not exist"));
  }
  if (lstat(a.path.c_str(), &st) != 0) return absl::OkStatus();  // free
  if (!S_ISSOCK(st.st_mode)) {
    return Unavailable(flag, a.text, absl::StrCat(a.path, " exists and is not a socket"));
  }
  Fd fd(socket(AF_UNIX, SOCK_STREAM, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, a.path.data(), a.path.size());
  if (fd.get() >= 0 && connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    return Unavailable(flag, a.text, "another server is listening on it");
  }
  return absl::OkStatus();  // a leftover socket file: gRPC unlinks it and binds anew
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view text, absl::string_view flag,
                                                 bool allow_unix) {
  ListenAddress a;
  a.text = std::string(text);
  if (text.empty()) return Invalid(flag, text, "give host:port");
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "unix-abstract:")) {
    a.kind = ListenAddress::Kind::kUnixAbstract;
  } else if (absl::ConsumePrefix(&rest, "unix:")) {
    a.kind = ListenAddress::Kind::kUnix;
    if (absl::StartsWith(rest, "//")) rest.remove_prefix(2);  // unix:///abs/path
  }
  if (a.is_unix()) {
    if (!allow_unix) return Invalid(flag, text, "this listener takes host:port, not a Unix socket");
    if (rest.empty()) return Invalid(flag, text, "the socket path is empty");
    if (rest.size() >= sizeof(sockaddr_un{}.sun_path)) {
      return Invalid(flag, text, absl::StrCat("a socket path has at most ",
                                              sizeof(sockaddr_un{}.sun_path) - 1, " bytes"));
    }
    a.path = std::string(rest);
    return a;
  }
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) {
    return Invalid(flag, text, allow_unix ? "give host:port or unix:/path/to/socket" : "give host:port");
  }
  absl::string_view host = rest.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[") && !absl::ConsumeSuffix(&host, "]")) {
    return Invalid(flag, text, "an IPv6 host is written [address]:port");
  }
  a.host = std::string(host);
  if (!absl::SimpleAtoi(rest.substr(colon + 1), &a.port) || a.port < 0 || a.port > 65535) {
    return Invalid(flag, text, "the port must be a number from 0 to 65535");
  }
  return a;
}

absl::Status CheckCanListen(const ListenAddress& address, absl::string_view flag) {
  switch (address.kind) {
    case ListenAddress::Kind::kTcp: return CheckTcp(address, flag);
    case ListenAddress::Kind::kUnix: return CheckUnix(address, flag);
    case ListenAddress::Kind::kUnixAbstract: return absl::OkStatus();
  }
  return absl::OkStatus();
}

std::string ListeningOn(const ListenAddress& address, int bound_port) {
  switch (address.kind) {
    case ListenAddress::Kind::kTcp: return absl::StrCat("port ", bound_port);
    case ListenAddress::Kind::kUnix: return absl::StrCat("unix:", address.path);
    case ListenAddress::Kind::kUnixAbstract: return absl::StrCat("unix-abstract:", address.path);
  }
  return address.text;
}

}  // namespace indexer::server
