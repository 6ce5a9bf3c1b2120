// The real binaries: indexer-server's snapshot on SIGTERM and restore, a snapshot over the admin
// RPC survived by SIGKILL, refused restores and security flags, and indexer-cli over TLS with
// tokens. Paths come from INDEXER_SERVER_BINARY / INDEXER_CLI_BINARY (tests/security/CMakeLists).
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/security/security_test_util.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kHeadDim = 64;
constexpr int kLayers = 2;

class SecurityBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("INDEXER_SERVER_BINARY") == nullptr) {
      GTEST_SKIP() << "INDEXER_SERVER_BINARY is not set (run through ctest)";
    }
    server_ = std::getenv("INDEXER_SERVER_BINARY");
    WriteFile(dir_.File("tokens"), TokenFileText());
  }

  // Flags of a small CPU server with tokens; `extra` appended.
  std::vector<std::string> Flags(std::vector<std::string> extra) const {
    std::vector<std::string> f = {"--capacity=64", absl::StrCat("--head_dim=", kHeadDim),
                                  absl::StrCat("--layers=", kLayers), "--cpu_threads=1",
                                  "--handler_threads=4", "--not_serving_seconds=0",
                                  "--drain_seconds=5", "--token_file=" + dir_.File("tokens")};
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  }

  struct State {
    std::vector<SelectionProbe> alpha, beta;
    std::vector<v1::GetSequenceResponse> alpha_described;
  };

  // Builds two tenants' state on the server at `port` and probes it.
  State Build(int port) {
    State s;
    auto alpha = ConnectTo(port, WithToken(kAlphaToken));
    auto beta = ConnectTo(port, WithToken(kBetaToken));
    EXPECT_TRUE(alpha->WaitUntilServing(absl::Seconds(10)).ok());
    std::mt19937 rng(77);
    BuildRichState(*alpha, "", kHeadDim, kLayers, rng);
    BuildRichState(*beta, "b-", kHeadDim, kLayers, rng);
    s.alpha = Probe(*alpha, "", kHeadDim, kLayers, rng);
    s.beta = Probe(*beta, "b-", kHeadDim, kLayers, rng);
    s.alpha_described = Describe(*alpha, RichStateIds(""));
    return s;
  }

  void ExpectSame(int port, const State& s, const std::string& where) {
    auto alpha = ConnectTo(port, WithToken(kAlphaToken));
    auto beta = ConnectTo(port, WithToken(kBetaToken));
    ExpectSameAnswers(*alpha, s.alpha, where + " alpha");
    ExpectSameAnswers(*beta, s.beta, where + " beta");
    ExpectSameSequences(s.alpha_described, *alpha, RichStateIds(""));
  }

  TempDir dir_;
  std::string server_;
};

TEST_F(SecurityBinaryTest, SnapshotOnSigtermThenRestoreAnswersIdentically) {
  const std::string snap = dir_.File("shutdown.snap");
  int port = 0;
  std::unique_ptr<Child> first =
      StartServerBinary(Flags({"--key_dtype=fp8", "--snapshot_on_shutdown=" + snap}), &port);
  ASSERT_NE(first, nullptr);
  const State state = Build(port);
  ASSERT_EQ(kill(first->pid(), SIGTERM), 0);
  ASSERT_EQ(first->Wait(absl::Seconds(20)), std::optional<int>(0)) << first->Log();
  EXPECT_THAT(first->Log(), HasSubstr("snapshot on shutdown: 12 sequences"));
  for (const std::string& name : FolderEntries(dir_.path())) {
    EXPECT_FALSE(absl::StartsWith(name, "shutdown.snap.tmp")) << "left behind: " << name;
  }

  std::unique_ptr<Child> second =
      StartServerBinary(Flags({"--key_dtype=fp8", "--restore=" + snap}), &port);
  ASSERT_NE(second, nullptr);
  EXPECT_THAT(second->Log(), HasSubstr("restored 12 sequences"));
  ExpectSame(port, state, "after SIGTERM and restore");
}

TEST_F(SecurityBinaryTest, SnapshotOverRpcSurvivesSigkill) {
  int port = 0;
  std::unique_ptr<Child> first = StartServerBinary(Flags({"--snapshot_dir=" + dir_.path()}), &port);
  ASSERT_NE(first, nullptr);
  const State state = Build(port);
  auto ops = ConnectTo(port, WithToken(kOpsToken));
  absl::StatusOr<v1::SnapshotResponse> snap = ops->Snapshot("live.snap");
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->path(), dir_.File("live.snap"));
  // Changes after the snapshot are lost with the process.
  auto alpha = ConnectTo(port, WithToken(kAlphaToken));
  ASSERT_TRUE(alpha->AppendKeys(client::MakeAppend("late", 0, std::vector<float>(kHeadDim, 1))).ok());
  ASSERT_TRUE(alpha->ReleaseSequence("b").ok());
  ASSERT_EQ(kill(first->pid(), SIGKILL), 0);
  ASSERT_EQ(first->Wait(absl::Seconds(10)), std::optional<int>(-SIGKILL));

  std::unique_ptr<Child> second = StartServerBinary(Flags({"--restore=" + snap->path()}), &port);
  ASSERT_NE(second, nullptr);
  ExpectSame(port, state, "after SIGKILL and restore");
  alpha = ConnectTo(port, WithToken(kAlphaToken));
  EXPECT_EQ(alpha->GetSequence("late").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(alpha->GetSequence("b").ok());
}

TEST_F(SecurityBinaryTest, RefusedRestoresExitWithStatus1AndSayWhy) {
  int port = 0;
  std::unique_ptr<Child> first = StartServerBinary(Flags({"--snapshot_dir=" + dir_.path()}), &port);
  ASSERT_NE(first, nullptr);
  auto alpha = ConnectTo(port, WithToken(kAlphaToken));
  ASSERT_TRUE(alpha->AppendKeys(client::MakeAppend("s", 0, std::vector<float>(kHeadDim * 300, 1))).ok());
  ASSERT_TRUE(alpha->Snapshot("good.snap").ok());
  std::string corrupt = ReadFile(dir_.File("good.snap"));
  corrupt[corrupt.size() / 2] ^= 0x01;
  WriteFile(dir_.File("corrupt.snap"), corrupt);

  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  const Case cases[] = {
      {{"--restore=" + dir_.File("corrupt.snap")}, "checksum"},
      {{"--restore=" + dir_.File("missing.snap")}, "cannot open snapshot file"},
      {{"--restore=" + dir_.File("good.snap"), "--head_dim=128"}, "head_dim 64 (this server: 128)"},
      {{"--restore=" + dir_.File("good.snap"), "--key_dtype=fp8"}, "key_dtype bf16 (this server: fp8)"},
      {{"--restore=" + dir_.File("good.snap"), "--layers=3"}, "layers 2 (this server: 3)"},
      {{"--restore=" + dir_.File("good.snap"), "--capacity=2"}, "capacity is 2 pages"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {server_, "--listen=127.0.0.1:0", "--device=cpu"};
    for (const std::string& f : Flags(c.flags)) argv.push_back(f);
    const RunResult r = RunToEnd(argv);
    EXPECT_EQ(r.code, 1) << absl::StrJoin(c.flags, " ") << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << absl::StrJoin(c.flags, " ");
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("serving on port")));
  }
}

TEST_F(SecurityBinaryTest, SecurityFlagsAreCheckedAtStart) {
  WriteFile(dir_.File("bad-tokens"), absl::StrCat(kAlphaToken, " alpha\n", "x y\n"));
  struct Case {
    std::vector<std::string> flags;
    int code;
    std::string message;
  };
  const Case cases[] = {
      {{"--tls_cert=" + dir_.File("c.pem")}, 2, "--tls_cert and --tls_key go together"},
      {{"--tls_client_ca=" + dir_.File("ca.pem")}, 2, "--tls_client_ca needs --tls_cert"},
      {{"--tenant_quota=lots"}, 2, "--tenant_quota is 'lots'"},
      {{"--token_file=" + dir_.File("bad-tokens")}, 1, "line 2"},
      {{"--token_file=" + dir_.File("none")}, 1, "cannot read the token file"},
      {{"--tls_cert=" + dir_.File("c.pem"), "--tls_key=" + dir_.File("k.pem")}, 1, "--tls_cert"},
      {{"--snapshot_dir=" + dir_.File("nowhere")}, 1, "--snapshot_dir"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {server_, "--listen=127.0.0.1:0", "--device=cpu"};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const RunResult r = RunToEnd(argv);
    EXPECT_EQ(r.code, c.code) << absl::StrJoin(c.flags, " ") << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << absl::StrJoin(c.flags, " ");
  }
  // Flags also come from the environment, as every other flag does.
  const RunResult env = RunToEnd({server_, "--listen=127.0.0.1:0", "--device=cpu"},
                                 {"INDEXER_TENANT_QUOTA=lots"});
  EXPECT_EQ(env.code, 2) << env.output;
}

TEST_F(SecurityBinaryTest, AFailedShutdownSnapshotExitsWithStatus1) {
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary(
      Flags({"--snapshot_on_shutdown=" + dir_.File("no/such/folder/s.snap")}), &port);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  EXPECT_EQ(server->Wait(absl::Seconds(20)), std::optional<int>(1));
  EXPECT_THAT(server->Log(), HasSubstr("snapshot on shutdown failed"));
}

TEST_F(SecurityBinaryTest, CliSpeaksTlsAndTokens) {
  const char* cli = std::getenv("INDEXER_CLI_BINARY");
  if (cli == nullptr) GTEST_SKIP() << "INDEXER_CLI_BINARY is not set";
  absl::StatusOr<TestPki> pki = MakeTestPki(dir_.File("pki"));
  ASSERT_TRUE(pki.ok()) << pki.status();
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary(
      Flags({"--tls_cert=" + pki->server_cert, "--tls_key=" + pki->server_key,
             "--snapshot_dir=" + dir_.path()}),
      &port);
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("--server=127.0.0.1:", port);
  const std::string ca = "--tls_ca=" + pki->ca;
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> env;
    int code;
    std::string output;
  };
  const Case cases[] = {
      {{ca, "health"}, {}, 0, "SERVING"},
      {{ca, "info"}, {}, 1, "UNAUTHENTICATED"},
      {{ca, std::string("--token=") + kBetaToken, "info"}, {}, 0, "tenant                beta"},
      {{ca, "info"}, {std::string("INDEXER_TOKEN=") + kBetaToken}, 0, "beta: 0 pages held"},
      {{ca, "append", "--sequence=s", "--tokens=200"}, {std::string("INDEXER_TOKEN=") + kBetaToken}, 0,
       "created"},
      {{ca, "snapshot", "--name=cli.snap"}, {std::string("INDEXER_TOKEN=") + kBetaToken}, 1,
       "PERMISSION_DENIED"},
      {{ca, "snapshot", "--name=cli.snap"}, {std::string("INDEXER_TOKEN=") + kOpsToken}, 0,
       "1 sequences"},
      {{"info"}, {std::string("INDEXER_TOKEN=") + kBetaToken}, 1, "UNAVAILABLE"},
      {{"--tls_ca=" + dir_.File("missing.pem"), "info"}, {}, 2, "cannot read"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {cli, address, "--timeout=5s"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const RunResult r = RunToEnd(argv, c.env);
    const std::string what = absl::StrCat("indexer-cli ", absl::StrJoin(c.args, " "));
    EXPECT_EQ(r.code, c.code) << what << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.output)) << what;
  }
  EXPECT_TRUE(FileExists(dir_.File("cli.snap")));
}

}  // namespace
}  // namespace indexer::testing
