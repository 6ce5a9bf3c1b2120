// Support for the security tests: test certificates made with the openssl tool
// (make_test_certs.sh), token files, in-process servers with security options, clients with TLS
// and tokens, and a workload that exercises every kind of state a snapshot must keep.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/cpp/indexer_client.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "tests/testing/child_process.h"
#include "tests/testing/files.h"

namespace indexer::testing {

void WriteFile(const std::string& path, const std::string& contents, int mode = 0600);
bool FileExists(const std::string& path);
// The names in a folder (not . and ..), sorted; empty when it cannot be read.
std::vector<std::string> FolderEntries(const std::string& path);

// Test PKI made by make_test_certs.sh (path from $INDEXER_MAKE_TEST_CERTS) in `dir`: file paths
// and PEM contents of a CA, a server certificate for 127.0.0.1, a client certificate it signed
// and a self-signed "rogue" client certificate.
struct TestPki {
  std::string dir;
  std::string ca, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key;  // paths
  std::string Pem(const std::string& path) const { return ReadFile(path); }
};
absl::StatusOr<TestPki> MakeTestPki(const std::string& dir);

// Tokens of the test token file: two tenants (alpha with admin rights), a second token of
// alpha's, and the admin-only "ops" tenant.
inline constexpr char kAlphaToken[] = "alpha-token-0123456789abcdef";
inline constexpr char kAlphaToken2[] = "alpha-second-token-fedcba9876543210";
inline constexpr char kBetaToken[] = "beta-token-0123456789abcdef";
inline constexpr char kOpsToken[] = "ops-token-0123456789abcdef0123";
// The token file text for the tokens above (beta gets `beta_quota` when non-empty).
std::string TokenFileText(const std::string& beta_quota = "");

// Starts a server with `options`; fails the test (returns nullptr) when it cannot start.
std::unique_ptr<server::IndexerServer> StartServer(const server::ServerOptions& options);
// A client of `server` on 127.0.0.1 with `options`.
std::unique_ptr<client::IndexerClient> ConnectTo(int port, client::ClientOptions options = {});
client::ClientOptions WithToken(const std::string& token, client::ClientOptions options = {});

// A short call deadline: refused TLS handshakes fail within it instead of the default 30 s.
client::CallOptions Quick();

// One selection to repeat after a restore, and its answer before.
struct SelectionProbe {
  v1::SelectBlocksRequest request;
  client::Selection answer;
};

// Builds state with everything a snapshot must keep, through `c` (a tenant's client): sequences
// with and without attention pages, one-layer and all-layer appends, partial blocks, forks
// sharing pages (and a copy-on-write after a fork), a truncation, a released sequence. Keys are
// real-valued (so fp8 rounding matters). Ids are prefixed with `prefix`.
void BuildRichState(client::IndexerClient& c, const std::string& prefix, int head_dim, int layers,
                    std::mt19937& rng);
// Ids BuildRichState leaves live.
std::vector<std::string> RichStateIds(const std::string& prefix);

// Selections over every live sequence of BuildRichState, every layer, decode and span shapes,
// with default and explicit parameters, asked now: the probes keep requests and answers.
std::vector<SelectionProbe> Probe(client::IndexerClient& c, const std::string& prefix,
                                  int head_dim, int layers, std::mt19937& rng);
// Asks every probe again and expects identical answers.
void ExpectSameAnswers(client::IndexerClient& c, const std::vector<SelectionProbe>& probes,
                       const std::string& where);
// Expects GetSequence to describe `ids` the same on both (lengths, attention pages, sharing).
void ExpectSameSequences(const std::vector<v1::GetSequenceResponse>& before,
                         client::IndexerClient& after, const std::vector<std::string>& ids);
std::vector<v1::GetSequenceResponse> Describe(client::IndexerClient& c,
                                              const std::vector<std::string>& ids);


}  // namespace indexer::testing
