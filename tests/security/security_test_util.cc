#include "tests/security/security_test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {

void WriteFile(const std::string& path, const std::string& contents, int mode) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << contents;
    ASSERT_TRUE(out.good()) << "cannot write " << path;
  }
  chmod(path.c_str(), static_cast<mode_t>(mode));
}

bool FileExists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

std::vector<std::string> FolderEntries(const std::string& path) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<TestPki> MakeTestPki(const std::string& dir) {
  const char* script = std::getenv("INDEXER_MAKE_TEST_CERTS");
  if (script == nullptr || *script == '\0') {
    return absl::FailedPreconditionError("INDEXER_MAKE_TEST_CERTS is not set (run through ctest)");
  }
  const std::string command = absl::StrCat("sh '", script, "' '", dir, "'");
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("'", command, "' failed: is openssl installed?"));
  }
  TestPki pki;
  pki.dir = dir;
  pki.ca = dir + "/ca.pem";
  pki.server_cert = dir + "/server.pem";
  pki.server_key = dir + "/server.key";
  pki.client_cert = dir + "/client.pem";
  pki.client_key = dir + "/client.key";
  pki.rogue_cert = dir + "/rogue.pem";
  pki.rogue_key = dir + "/rogue.key";
  return pki;
}

std::string TokenFileText(const std::string& beta_quota) {
  return absl::StrCat(
      "# tokens of the security tests\n",
      kAlphaToken, "  alpha  admin\n",
      "\n",
      kAlphaToken2, "\talpha\n",
      kBetaToken, " beta", beta_quota.empty() ? "" : absl::StrCat(" quota=", beta_quota), "\n",
      "   # an indented comment\n",
      kOpsToken, " ops admin\n");
}

std::unique_ptr<server::IndexerServer> StartServer(const server::ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::unique_ptr<client::IndexerClient> ConnectTo(int port, client::ClientOptions options) {
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(absl::StrCat("127.0.0.1:", port), options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

client::ClientOptions WithToken(const std::string& token, client::ClientOptions options) {
  options.bearer_token = token;
  return options;
}

client::CallOptions Quick() { return client::CallOptions::Timeout(absl::Seconds(5)); }

namespace {

std::vector<float> RealValues(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void MustAppend(client::IndexerClient& c, const v1::AppendKeysRequest& r) {
  absl::StatusOr<v1::AppendKeysResponse> got = c.AppendKeys(r);
  ASSERT_TRUE(got.ok()) << r.sequence_id() << ": " << got.status();
}

}  // namespace

void BuildRichState(client::IndexerClient& c, const std::string& prefix, int head_dim, int layers,
                    std::mt19937& rng) {
  const auto all_layers = [&](const std::string& id, int tokens, std::vector<int32_t> attn) {
    v1::AppendKeysRequest r = client::MakeAppendAllLayers(
        id, RealValues(rng, static_cast<size_t>(tokens) * layers * head_dim));
    for (int32_t a : attn) r.add_attention_pages(a);
    MustAppend(c, r);
  };
  const auto one_layer = [&](const std::string& id, int layer, int tokens, std::vector<int32_t> attn) {
    v1::AppendKeysRequest r =
        client::MakeAppend(id, layer, RealValues(rng, static_cast<size_t>(tokens) * head_dim));
    for (int32_t a : attn) r.add_attention_pages(a);
    MustAppend(c, r);
  };
  // a: attention pages, every layer, then one layer further (an uneven, partial last block).
  all_layers(prefix + "a", 300, {10, 11, 12});
  one_layer(prefix + "a", 0, 100, {13});
  // b: no attention pages, layers appended separately.
  one_layer(prefix + "b", layers - 1, 200, {});
  one_layer(prefix + "b", 0, 50, {});
  // c: a fork of a sharing its pages; its append into a shared block copies that page.
  ASSERT_TRUE(c.ForkSequence(prefix + "a", prefix + "c").ok());
  one_layer(prefix + "c", layers - 1, 10, {});
  // d: a shorter fork (its last shared block is partial for it).
  ASSERT_TRUE(c.ForkSequence(prefix + "a", prefix + "d", 200u).ok());
  // e: truncated; empty: truncated to nothing; gone: released.
  all_layers(prefix + "e", 260, {});
  ASSERT_TRUE(c.TruncateSequence(prefix + "e", 130).ok());
  all_layers(prefix + "empty", 5, {});
  ASSERT_TRUE(c.TruncateSequence(prefix + "empty", 0).ok());
  all_layers(prefix + "gone", 129, {});
  ASSERT_TRUE(c.ReleaseSequence(prefix + "gone").ok());
}

std::vector<std::string> RichStateIds(const std::string& prefix) {
  return {prefix + "a", prefix + "b", prefix + "c", prefix + "d", prefix + "e", prefix + "empty"};
}

std::vector<SelectionProbe> Probe(client::IndexerClient& c, const std::string& prefix,
                                  int head_dim, int layers, std::mt19937& rng) {
  std::vector<SelectionProbe> probes;
  for (const std::string& id : RichStateIds(prefix)) {
    absl::StatusOr<v1::GetSequenceResponse> info = c.GetSequence(id);
    EXPECT_TRUE(info.ok()) << id << ": " << info.status();
    if (!info.ok()) continue;
    for (int layer = 0; layer < layers; ++layer) {
      const int64_t len = info->lengths(layer);
      if (len == 0) continue;
      // A decode step at the end, with the server's defaults.
      SelectionProbe decode;
      decode.request = client::MakeSelect(id, layer, 2, RealValues(rng, 2 * head_dim));
      probes.push_back(decode);
      // A span in the middle, explicit parameters.
      const int n = static_cast<int>(std::min<int64_t>(len, 5));
      SelectionProbe span;
      span.request = client::MakeSelect(id, layer, 3, RealValues(rng, size_t{3} * n * head_dim));
      span.request.set_start_position(std::uniform_int_distribution<int64_t>(0, len - n)(rng));
      span.request.set_topk(4);
      span.request.set_init_blocks(1);
      span.request.set_local_blocks(1);
      probes.push_back(span);
    }
  }
  for (SelectionProbe& p : probes) {
    absl::StatusOr<client::Selection> s = c.Select(p.request);
    EXPECT_TRUE(s.ok()) << p.request.sequence_id() << ": " << s.status();
    if (s.ok()) p.answer = *std::move(s);
  }
  return probes;
}

void ExpectSameAnswers(client::IndexerClient& c, const std::vector<SelectionProbe>& probes,
                       const std::string& where) {
  for (size_t i = 0; i < probes.size(); ++i) {
    const SelectionProbe& p = probes[i];
    absl::StatusOr<client::Selection> s = c.Select(p.request);
    ASSERT_TRUE(s.ok()) << where << " probe " << i << " (" << p.request.sequence_id()
                        << "): " << s.status();
    ExpectSameSelection(*s, p.answer,
                        absl::StrCat(where, " probe ", i, " of ", p.request.sequence_id(),
                                     " layer ", p.request.layer()));
  }
}

std::vector<v1::GetSequenceResponse> Describe(client::IndexerClient& c,
                                              const std::vector<std::string>& ids) {
  std::vector<v1::GetSequenceResponse> out;
  for (const std::string& id : ids) {
    absl::StatusOr<v1::GetSequenceResponse> r = c.GetSequence(id);
    EXPECT_TRUE(r.ok()) << id << ": " << r.status();
    out.push_back(r.ok() ? *r : v1::GetSequenceResponse());
  }
  return out;
}

void ExpectSameSequences(const std::vector<v1::GetSequenceResponse>& before,
                         client::IndexerClient& after, const std::vector<std::string>& ids) {
  const std::vector<v1::GetSequenceResponse> now = Describe(after, ids);
  for (size_t i = 0; i < ids.size(); ++i) {
    SCOPED_TRACE(ids[i]);
    EXPECT_EQ(std::vector<uint32_t>(now[i].lengths().begin(), now[i].lengths().end()),
              std::vector<uint32_t>(before[i].lengths().begin(), before[i].lengths().end()));
    EXPECT_EQ(std::vector<int32_t>(now[i].attention_pages().begin(), now[i].attention_pages().end()),
              std::vector<int32_t>(before[i].attention_pages().begin(),
                                   before[i].attention_pages().end()));
    EXPECT_EQ(now[i].pages_size(), before[i].pages_size());
    EXPECT_EQ(now[i].shared_pages(), before[i].shared_pages()) << "page sharing was not restored";
  }
}

}  // namespace indexer::testing
