#include "client/cpp/hash_ring.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace indexer::client {

uint64_t Fnv1a64(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t RingHash(absl::string_view s) { return Mix64(Fnv1a64(s)); }

absl::string_view ShardKey(absl::string_view sequence_id) {
  const size_t open = sequence_id.find('{');
  if (open == absl::string_view::npos) return sequence_id;
  const size_t close = sequence_id.find('}', open + 1);
  if (close == absl::string_view::npos || close == open + 1) return sequence_id;
  return sequence_id.substr(open + 1, close - open - 1);
}

HashRing::HashRing(int virtual_nodes) : virtual_nodes_(virtual_nodes) {}

absl::StatusOr<HashRing> HashRing::Create(const std::vector<std::string>& servers,
                                          int virtual_nodes) {
  if (virtual_nodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("virtual_nodes is ", virtual_nodes, "; it must be >= 1"));
  }
  HashRing ring(virtual_nodes);
  for (const std::string& s : servers) {
    if (absl::Status st = ring.Add(s); !st.ok()) return absl::InvalidArgumentError(st.message());
  }
  return ring;
}

absl::Status HashRing::Add(absl::string_view server) {
  if (server.empty()) return absl::InvalidArgumentError("a server address is empty");
  if (std::find(servers_.begin(), servers_.end(), server) != servers_.end()) {
    return absl::AlreadyExistsError(absl::StrCat("server '", server, "' is already on the ring"));
  }
  servers_.emplace_back(server);
  Rebuild();
  return absl::OkStatus();
}

absl::Status HashRing::Remove(absl::string_view server) {
  const auto it = std::find(servers_.begin(), servers_.end(), server);
  if (it == servers_.end()) {
    return absl::NotFoundError(absl::StrCat("server '", server, "' is not on the ring"));
  }
  servers_.erase(it);
  Rebuild();
  return absl::OkStatus();
}

void HashRing::Rebuild() {
  points_.clear();
  points_.reserve(servers_.size() * static_cast<size_t>(virtual_nodes_));
  for (uint32_t s = 0; s < servers_.size(); ++s) {
    for (int i = 0; i < virtual_nodes_; ++i) {
      points_.push_back(Point{RingHash(absl::StrCat(servers_[s], "#", i)), s});
    }
  }
  // Ties (two points with one hash) go to the smaller server name, so that the order does not
  // depend on the order servers were added in: the Python ring sorts the same way.
  std::sort(points_.begin(), points_.end(), [this](const Point& a, const Point& b) {
    if (a.hash != b.hash) return a.hash < b.hash;
    return servers_[a.server] < servers_[b.server];
  });
}

size_t HashRing::LookupIndex(absl::string_view sequence_id) const {
  const uint64_t h = RingHash(ShardKey(sequence_id));
  auto it = std::lower_bound(points_.begin(), points_.end(), h,
                             [](const Point& p, uint64_t v) { return p.hash < v; });
  if (it == points_.end()) it = points_.begin();
  return it->server;
}

absl::StatusOr<std::string> HashRing::Lookup(absl::string_view sequence_id) const {
  if (points_.empty()) return absl::FailedPreconditionError("the hash ring has no servers");
  return servers_[LookupIndex(sequence_id)];
}

}  // namespace indexer::client
