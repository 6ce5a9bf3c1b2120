// End-to-end test support: a real IndexerServer in-process on a loopback port, an IndexerClient
// talking to it over gRPC, and host copies of the keys each test sends so that every selection
// can be checked against the reference selector (kernels::SelectSpan).
//
// Keys and queries are small integers (exact in bf16, fp8 e4m3 and fp32 sums), so the server's
// answers must equal the reference exactly, ties included.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/cpp/indexer_client.h"
#include "kernels/select_types.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "tests/testing/server_config.h"

namespace indexer::testing {

namespace v1 = indexer::v1;
using client::CallOptions;
using client::IndexerClient;
using client::Selection;

// Uniform integers in [lo, hi] as floats.
std::vector<float> IntValues(std::mt19937& rng, size_t n, int lo = -4, int hi = 4);

// What the server should hold for one sequence: per layer, the bf16 bits of every key row, and
// the attention page ids.
class HostSequence {
 public:
  HostSequence(int layers, int head_dim) : head_dim_(head_dim), keys_(layers) {}

  // Records keys appended to one layer ([n][head_dim] floats, rounded to bf16 like the server).
  void Append(int layer, const std::vector<float>& keys);
  // Records an all-layers append ([n][layers][head_dim]).
  void AppendAllLayers(const std::vector<float>& keys);
  void Truncate(int64_t length);
  int64_t length(int layer) const { return static_cast<int64_t>(keys_[layer].size()) / head_dim_; }
  std::vector<int32_t> attention_pages;
  // How the reference stores the keys before selecting (the server's --key_dtype).
  kernels::KeyStorage storage = kernels::KeyStorage::kBf16;

  // The reference selection of queries [n][H][head_dim] at positions p0.. on `layer`.
  Selection Select(int layer, const std::vector<float>& queries, int num_heads, int64_t p0,
                   const kernels::SelectParams& params, const kernels::PageTableParams& pt) const;

 private:
  int head_dim_;
  std::vector<std::vector<uint16_t>> keys_;  // per layer, [tokens][head_dim] bf16 bits
};

// Compares a server answer with the reference: shape, start position and every id / page entry.
void ExpectSameSelection(const Selection& got, const Selection& want, const std::string& where);

// A sequence's per-layer lengths as an answer carries them, as a vector (for EXPECT_EQ).
inline std::vector<uint32_t> Lengths(const google::protobuf::RepeatedField<uint32_t>& lengths) {
  return std::vector<uint32_t>(lengths.begin(), lengths.end());
}

// GET http://127.0.0.1:port/metrics, plain sockets: the response body, or "" on failure.
std::string ScrapeMetrics(int port);

// Counter or gauge value (a histogram's count) of `family` with exactly these labels in a
// GetStats answer; -1 when there is no such series.
double StatValue(const v1::GetStatsResponse& stats, const std::string& family,
                 const std::map<std::string, std::string>& labels);

// A test that runs its own server. Tests may change options_ and call Restart().
class ServerTest : public ::testing::Test {
 protected:
  ServerTest() : options_(SmallServerOptions()) {}
  void SetUp() override { Restart(); }
  void TearDown() override { Stop(); }

  // (Re)starts the server with options_ and connects a fresh client.
  void Restart();
  void Stop();

  int head_dim() const { return options_.engine.head_dim; }
  int layers() const { return options_.engine.layers; }
  kernels::SelectParams Params(int topk, int init_blocks, int local_blocks) const {
    return kernels::SelectParams{topk, init_blocks, local_blocks};
  }
  kernels::SelectParams DefaultParams() const { return options_.engine.defaults; }
  const kernels::PageTableParams& PageTable() const { return options_.engine.page_table; }

  // Appends `tokens` random integer keys to one layer of `id` and records them in hosts_[id].
  // Fails the test when the server refuses.
  void AppendRandom(const std::string& id, int layer, int tokens, std::vector<int32_t> attn = {});
  // The same for every layer at once.
  void AppendRandomAllLayers(const std::string& id, int tokens, std::vector<int32_t> attn = {});
  HostSequence& Host(const std::string& id);

  // A selection request with random integer queries ([n][H][head_dim]); the queries are returned
  // in *queries for the reference.
  v1::SelectBlocksRequest RandomSelect(const std::string& id, int layer, int heads, int tokens,
                                       std::vector<float>* queries);

  int64_t FreePages();

  server::ServerOptions options_;
  std::unique_ptr<server::IndexerServer> server_;
  std::unique_ptr<IndexerClient> client_;
  std::map<std::string, HostSequence> hosts_;
  std::mt19937 rng_{12345};
  // When set, Restart starts the server on the backends this returns instead of building them
  // from options_ (fault injection).
  std::function<std::vector<engine::DeviceBackend>()> make_backends_;
};

}  // namespace indexer::testing
