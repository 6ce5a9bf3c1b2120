// ListenAddress: an address the server listens on (--listen, --health_listen, --metrics_listen),
// parsed and checked before anything binds it, so that a busy or impossible address is refused
// with one clear message instead of the listener library's own error dump.
//
// Accepted forms: "host:port" (0.0.0.0:50051, [::]:50051, localhost:0; port 0 picks a free one)
// and, where the listener is gRPC, a Unix domain socket: "unix:/abs/path", "unix:rel/path",
// "unix:///abs/path", or an abstract socket "unix-abstract:name". Free functions, no state.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::server {

struct ListenAddress {
  enum class Kind { kTcp, kUnix, kUnixAbstract };
  Kind kind = Kind::kTcp;
  std::string text;  // as given, which is what gRPC is handed
  std::string host;  // kTcp: the host part, without IPv6 brackets ("" = every interface)
  int port = 0;      // kTcp: 0 to 65535
  std::string path;  // kUnix: the socket file; kUnixAbstract: the name

  bool is_unix() const { return kind != Kind::kTcp; }
};

// Parses `text`. INVALID_ARGUMENT naming `flag` for an empty address, a missing or non-numeric
// port, a port past 65535, a socket path longer than a sockaddr_un holds, or a Unix socket where
// `allow_unix` is false.
absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view text, absl::string_view flag,
                                                 bool allow_unix);

// Whether a listener could bind `address` now. TCP: every address the host resolves to binds as
// a listener would (SO_REUSEADDR, no SO_REUSEPORT). Unix: the folder exists, and the path is
// either free or a socket no server answers on (a crashed server's leftover, which gRPC unlinks
// and binds anew). UNAVAILABLE naming `flag` and the reason otherwise ("address in use",
// "another server is listening on it", "... is not a socket"). Another process may still take the address
// between this check and the bind; the bind's own error is then the answer.
absl::Status CheckCanListen(const ListenAddress& address, absl::string_view flag);

// How the startup log names a bound listener: "port 50051" for TCP (with the bound port, which
// differs from address.port when that is 0), "unix:/run/indexer/indexer.sock" for a socket.
std::string ListeningOn(const ListenAddress& address, int bound_port);

}  // namespace indexer::server
