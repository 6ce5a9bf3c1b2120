#include "tests/testing/server_fixture.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"
#include "tests/testing/host_key_pool.h"

namespace indexer::testing {

std::vector<float> IntValues(std::mt19937& rng, size_t n, int lo, int hi) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

void HostSequence::Append(int layer, const std::vector<float>& keys) {
  for (float k : keys) keys_[layer].push_back(kernels::FloatToBf16(k));
}

void HostSequence::AppendAllLayers(const std::vector<float>& keys) {
  const size_t layers = keys_.size();
  const size_t row = layers * head_dim_;
  for (size_t t = 0; t < keys.size() / row; ++t) {
    for (size_t l = 0; l < layers; ++l) {
      for (int d = 0; d < head_dim_; ++d) {
        keys_[l].push_back(kernels::FloatToBf16(keys[t * row + l * head_dim_ + d]));
      }
    }
  }
}

void HostSequence::Truncate(int64_t length) {
  for (auto& k : keys_) {
    if (static_cast<int64_t>(k.size()) > length * head_dim_) k.resize(length * head_dim_);
  }
  int64_t longest = 0;
  for (size_t l = 0; l < keys_.size(); ++l) longest = std::max(longest, this->length(static_cast<int>(l)));
  const size_t blocks = static_cast<size_t>((longest + kernels::kBlockSize - 1) / kernels::kBlockSize);
  if (attention_pages.size() > blocks) attention_pages.resize(blocks);
}

Selection HostSequence::Select(int layer, const std::vector<float>& queries, int num_heads,
                               int64_t p0, const kernels::SelectParams& params,
                               const kernels::PageTableParams& pt) const {
  const int n = static_cast<int>(queries.size() / (static_cast<size_t>(num_heads) * head_dim_));
  const int64_t blocks = kernels::VisibleBlocks(p0 + n - 1);
  // The host copy as a pool whose page b is block b.
  HostKeyPool pool(head_dim_, storage, blocks);
  const std::vector<int32_t> table = IdentityTable(blocks);
  pool.Write(table, keys_[layer].data(), std::min(length(layer), blocks * kernels::kBlockSize));
  std::vector<uint16_t> q(queries.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = kernels::FloatToBf16(queries[i]);
  SpanResult r = RunSelectSpan(pool.view(), table, attention_pages, p0, n, num_heads, q, params, pt);

  Selection s;
  s.num_tokens = n;
  s.num_heads = num_heads;
  s.topk = params.topk;
  s.start_position = p0;
  s.block_ids = std::move(r.block_ids);
  if (!attention_pages.empty()) {
    s.pages_per_block = pt.pages_per_block;
    s.page_table = std::move(r.page_table);
    s.context_lens = std::move(r.context_lens);
  }
  return s;
}

void ExpectSameSelection(const Selection& got, const Selection& want, const std::string& where) {
  SCOPED_TRACE(where);
  ASSERT_EQ(got.num_tokens, want.num_tokens);
  ASSERT_EQ(got.num_heads, want.num_heads);
  ASSERT_EQ(got.topk, want.topk);
  EXPECT_EQ(got.start_position, want.start_position);
  ASSERT_EQ(got.block_ids.size(), want.block_ids.size());
  for (int t = 0; t < want.num_tokens; ++t) {
    for (int h = 0; h < want.num_heads; ++h) {
      EXPECT_EQ(std::vector<int32_t>(got.blocks(t, h).begin(), got.blocks(t, h).end()),
                std::vector<int32_t>(want.blocks(t, h).begin(), want.blocks(t, h).end()))
          << "block ids of token " << t << " (position " << want.position(t) << ") head " << h;
    }
  }
  ASSERT_EQ(got.has_page_table(), want.has_page_table());
  if (want.has_page_table()) {
    EXPECT_EQ(got.pages_per_block, want.pages_per_block);
    EXPECT_EQ(got.page_table, want.page_table);
    EXPECT_EQ(got.context_lens, want.context_lens);
  }
}

void ServerTest::Restart() {
  Stop();
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> server =
      make_backends_ ? server::IndexerServer::Start(options_, make_backends_())
                     : server::IndexerServer::Start(options_);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = std::move(*server);
  absl::StatusOr<std::unique_ptr<IndexerClient>> client =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", server_->port()));
  ASSERT_TRUE(client.ok()) << client.status();
  client_ = std::move(*client);
  hosts_.clear();
}

void ServerTest::Stop() {
  client_.reset();
  if (server_ != nullptr) server_->Shutdown(absl::Seconds(1));
  server_.reset();
}

HostSequence& ServerTest::Host(const std::string& id) {
  return hosts_.try_emplace(id, layers(), head_dim()).first->second;
}

void ServerTest::AppendRandom(const std::string& id, int layer, int tokens,
                              std::vector<int32_t> attn) {
  const std::vector<float> keys = IntValues(rng_, static_cast<size_t>(tokens) * head_dim());
  v1::AppendKeysRequest request = client::MakeAppend(id, layer, tokens, keys);
  for (int32_t a : attn) request.add_attention_pages(a);
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(request);
  ASSERT_TRUE(r.ok()) << r.status();
  Host(id).Append(layer, keys);
  Host(id).attention_pages.insert(Host(id).attention_pages.end(), attn.begin(), attn.end());
}

void ServerTest::AppendRandomAllLayers(const std::string& id, int tokens, std::vector<int32_t> attn) {
  const std::vector<float> keys =
      IntValues(rng_, static_cast<size_t>(tokens) * layers() * head_dim());
  v1::AppendKeysRequest request = client::MakeAppendAllLayers(id, tokens, keys);
  for (int32_t a : attn) request.add_attention_pages(a);
  absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(request);
  ASSERT_TRUE(r.ok()) << r.status();
  Host(id).AppendAllLayers(keys);
  Host(id).attention_pages.insert(Host(id).attention_pages.end(), attn.begin(), attn.end());
}

v1::SelectBlocksRequest ServerTest::RandomSelect(const std::string& id, int layer, int heads,
                                                 int tokens, std::vector<float>* queries) {
  *queries = IntValues(rng_, static_cast<size_t>(tokens) * heads * head_dim());
  return client::MakeSelect(id, layer, heads, tokens, *queries);
}

int64_t ServerTest::FreePages() {
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? static_cast<int64_t>(info->free_pages()) : -1;
}

std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

double StatValue(const v1::GetStatsResponse& stats, const std::string& family,
                 const std::map<std::string, std::string>& labels) {
  for (const auto& f : stats.families()) {
    if (f.name() != family) continue;
    for (const auto& m : f.metrics()) {
      if (std::map<std::string, std::string>(m.labels().begin(), m.labels().end()) == labels) {
        return f.type() == "histogram" ? static_cast<double>(m.count()) : m.value();
      }
    }
  }
  return -1;
}

}  // namespace indexer::testing
