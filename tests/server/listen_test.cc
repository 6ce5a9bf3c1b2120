// Listeners: addresses parsed and checked before binding (a busy port or socket is refused with
// one clear error), the server on a Unix domain socket, and the plaintext health-only listener
// (--health_listen), in-process.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/indexer_server.h"
#include "server/listen_address.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::HealthStatus;
using server::CheckCanListen;
using server::ListenAddress;
using server::ParseListenAddress;
using ::testing::HasSubstr;

// A folder for sockets, removed with its contents at the end.
class SocketDir {
 public:
  SocketDir() {
    char templ[] = "/tmp/indexer-listen-XXXXXX";
    path_ = mkdtemp(templ);
  }
  ~SocketDir() { std::system(absl::StrCat("rm -rf '", path_, "'").c_str()); }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A socket bound (and listening when `listen`) at `path`; closed at destruction.
class UnixSocket {
 public:
  UnixSocket(const std::string& path, bool listen) : fd_(socket(AF_UNIX, SOCK_STREAM, 0)) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
    if (listen) {
      EXPECT_EQ(::listen(fd_, 4), 0);
    }
  }
  ~UnixSocket() { close(fd_); }

 private:
  int fd_;
};

// A TCP listener on 127.0.0.1 at a port the kernel picks.
class TcpListener {
 public:
  TcpListener() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~TcpListener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

TEST(ListenAddress, ParsesHostPortAndSockets) {
  absl::StatusOr<ListenAddress> a = ParseListenAddress("0.0.0.0:50051", "listen", true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, ListenAddress::Kind::kTcp);
  EXPECT_EQ(a->host, "0.0.0.0");
  EXPECT_EQ(a->port, 50051);
  a = ParseListenAddress("[::]:0", "listen", true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::");
  EXPECT_EQ(a->port, 0);
  a = ParseListenAddress("unix:/run/indexer/indexer.sock", "listen", true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, ListenAddress::Kind::kUnix);
  EXPECT_EQ(a->path, "/run/indexer/indexer.sock");
  EXPECT_EQ(server::ListeningOn(*a, 1), "unix:/run/indexer/indexer.sock");
  a = ParseListenAddress("unix:///run/indexer/indexer.sock", "listen", true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->path, "/run/indexer/indexer.sock");
  a = ParseListenAddress("unix-abstract:indexer", "listen", true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, ListenAddress::Kind::kUnixAbstract);
  EXPECT_EQ(server::ListeningOn(*ParseListenAddress("127.0.0.1:0", "listen", true), 4321),
            "port 4321");
}

TEST(ListenAddress, RefusesMalformedAddressesNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "give host:port"},
      {"50051", "give host:port or unix:/path/to/socket"},
      {"0.0.0.0:http", "the port must be a number from 0 to 65535"},
      {"0.0.0.0:70000", "the port must be a number from 0 to 65535"},
      {"[::1:5", "[address]:port"},
      {"unix:", "the socket path is empty"},
  };
  for (const auto& [text, why] : cases) {
    absl::StatusOr<ListenAddress> a = ParseListenAddress(text, "listen", true);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(a.status().message()), HasSubstr("--listen")) << text;
    EXPECT_THAT(std::string(a.status().message()), HasSubstr(why)) << text;
  }
  EXPECT_THAT(std::string(ParseListenAddress("unix:/" + std::string(200, 'x'), "listen", true)
                              .status()
                              .message()),
              HasSubstr("at most 107 bytes"));
  EXPECT_THAT(std::string(ParseListenAddress("unix:/a.sock", "metrics_listen", false)
                              .status()
                              .message()),
              HasSubstr("--metrics_listen"));
}

TEST(ListenAddress, ABusyPortIsRefusedBeforeBinding) {
  TcpListener busy;
  const std::string text = absl::StrCat("127.0.0.1:", busy.port());
  const absl::Status s = CheckCanListen(*ParseListenAddress(text, "listen", true), "listen");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("--listen: cannot listen on ", text, ": address in use")));
  EXPECT_TRUE(CheckCanListen(*ParseListenAddress("127.0.0.1:0", "listen", true), "listen").ok());
  // An address of no interface of this host (TEST-NET-1; bound, never sent to).
  const absl::Status foreign =
      CheckCanListen(*ParseListenAddress("192.0.2.1:0", "listen", true), "listen");
  EXPECT_EQ(foreign.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(foreign.message()), HasSubstr("Cannot assign requested address"));
}

TEST(ListenAddress, SocketPathsAreChecked) {
  SocketDir dir;
  const auto check = [](const std::string& path) {
    return CheckCanListen(*ParseListenAddress("unix:" + path, "listen", true), "listen");
  };
  EXPECT_TRUE(check(dir.File("free.sock")).ok());
  EXPECT_THAT(std::string(check(dir.File("no/such/folder.sock")).message()),
              HasSubstr("does not exist"));
  std::ofstream(dir.File("plain-file")) << "not a socket";
  EXPECT_THAT(std::string(check(dir.File("plain-file")).message()), HasSubstr("is not a socket"));
  {
    UnixSocket stale(dir.File("stale.sock"), /*listen=*/false);  // bound, nobody listening
  }
  EXPECT_TRUE(check(dir.File("stale.sock")).ok()) << "a leftover socket file is unlinked and bound anew";
  UnixSocket live(dir.File("live.sock"), /*listen=*/true);
  const absl::Status s = check(dir.File("live.sock"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("another server is listening on it"));
}

TEST(UnixSocketServer, ServesCallsOnTheSocketAndRemovesItOnShutdown) {
  SocketDir dir;
  const std::string path = dir.File("indexer.sock");
  server::ServerOptions options = SmallServerOptions();
  options.listen = "unix:" + path;
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(options);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->port(), 0);
  EXPECT_EQ((*s)->listening_on(), "unix:" + path);
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "owner and group may connect, others not";

  absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect("unix:" + path);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::ServerInfoResponse> info = (*c)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->head_dim(), 64u);
  EXPECT_EQ(*(*c)->Health(""), HealthStatus::kServing);

  // A second server on the same socket would steal it: refused, and the first keeps serving.
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> second =
      server::IndexerServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("another server is listening"));
  EXPECT_TRUE((*c)->ServerInfo().ok());

  (*s)->Shutdown(absl::Seconds(1));
  s->reset();
  EXPECT_NE(stat(path.c_str(), &st), 0) << "the socket file is removed with the server";
}

// A raw call of `method` with an empty request; its status.
grpc::Status RawCall(grpc::Channel* channel, const std::string& method) {
  return RawUnary(channel, method, "", std::chrono::seconds(5));
}

class HealthListenerTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.health_listen = "127.0.0.1:0";
    ServerTest::SetUp();
  }
};

TEST_F(HealthListenerTest, AnswersHealthAndNothingElse) {
  ASSERT_GT(server_->health_port(), 0);
  ASSERT_NE(server_->health_port(), server_->port());
  absl::StatusOr<std::unique_ptr<IndexerClient>> health =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", server_->health_port()));
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*(*health)->Health(""), HealthStatus::kServing);
  EXPECT_EQ(*(*health)->Health("indexer.v1.Indexer"), HealthStatus::kServing);
  // Neither the indexer's RPCs nor reflection.
  EXPECT_EQ((*health)->ServerInfo().status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(RawCall((*health)->channel().get(),
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
                .error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // The main listener still has reflection.
  EXPECT_NE(RawCall(client_->channel().get(),
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
                .error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(HealthListenerTest, TurnsNotServingWhenTheDrainStarts) {
  absl::StatusOr<std::unique_ptr<IndexerClient>> health =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", server_->health_port()));
  ASSERT_TRUE(health.ok());
  ASSERT_EQ(*(*health)->Health(""), HealthStatus::kServing);
  std::thread stop([&] { server_->Shutdown(absl::Seconds(1), absl::Milliseconds(800)); });
  bool not_serving = false;
  for (int i = 0; i < 200 && !not_serving; ++i) {
    absl::StatusOr<HealthStatus> h = (*health)->Health("indexer.v1.Indexer");
    not_serving = h.ok() && *h == HealthStatus::kNotServing;
    if (!not_serving) absl::SleepFor(absl::Milliseconds(2));
  }
  stop.join();
  EXPECT_TRUE(not_serving) << "the health listener never answered NOT_SERVING during the drain";
  EXPECT_EQ((*health)->Health("", client::CallOptions::Timeout(absl::Seconds(1))).status().code(),
            absl::StatusCode::kUnavailable)
      << "the health listener closes with the server";
}

TEST(HealthListenerStart, ABusyHealthPortStopsStartup) {
  TcpListener busy;
  server::ServerOptions options = SmallServerOptions();
  options.health_listen = absl::StrCat("127.0.0.1:", busy.port());
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--health_listen"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("address in use"));
}

}  // namespace
}  // namespace indexer::testing
