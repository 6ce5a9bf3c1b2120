// HashRing: client-side consistent hashing of sequence ids over a list of server addresses, so
// that a scheduler (or indexer-bench) spreading sequences over many indexer servers always
// reaches the one holding a sequence, and adding or removing a server moves only the ids that
// must move (about 1/N of them, all to or from that server).
//
// The mapping is a contract shared with the Python client (client/python/indexer_client/
// hash_ring.py), which must map every id to the same server; both are tested against one golden
// table (tests/bench/hash_ring_test.cc, tests/python/test_hash_ring.py). Change neither alone.
//
//   hash(s)     = Mix64(Fnv1a64(UTF-8 bytes of s))
//   ring points = hash(server + "#" + i) for i in [0, virtual_nodes), per server
//   owner(id)   = the server of the first point (by hash, ties by server name) at or after
//                 hash(ShardKey(id)), wrapping around
//   ShardKey(id)= the text between the first '{' and the next '}' when that text is non-empty
//                 (a "hash tag", as in Redis Cluster: "{conv7}.a" and "{conv7}.b" share a
//                 server, so a fork can stay on one), else the whole id.
//
// Threads: a HashRing is a plain value. Const methods may run concurrently; Add/Remove must not
// run concurrently with anything else.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::client {

// 64-bit FNV-1a of the bytes of `s`.
uint64_t Fnv1a64(absl::string_view s);
// A 64-bit finalizer (splitmix64's) that spreads FNV's weak low-order mixing over all bits.
uint64_t Mix64(uint64_t x);
// Mix64(Fnv1a64(s)): the hash of ids and ring points.
uint64_t RingHash(absl::string_view s);
// The part of a sequence id that is hashed (see the header comment).
absl::string_view ShardKey(absl::string_view sequence_id);

class HashRing {
 public:
  // Points per server. 256 keeps each of 10 servers within a few percent of its fair share.
  static constexpr int kDefaultVirtualNodes = 256;

  explicit HashRing(int virtual_nodes = kDefaultVirtualNodes);

  // A ring over `servers`. INVALID_ARGUMENT for an empty or repeated address, or
  // virtual_nodes < 1.
  static absl::StatusOr<HashRing> Create(const std::vector<std::string>& servers,
                                         int virtual_nodes = kDefaultVirtualNodes);

  // Adds a server. INVALID_ARGUMENT when `server` is empty, ALREADY_EXISTS when present.
  absl::Status Add(absl::string_view server);
  // Removes a server. NOT_FOUND when absent.
  absl::Status Remove(absl::string_view server);

  // The server owning `sequence_id`. FAILED_PRECONDITION when the ring is empty.
  absl::StatusOr<std::string> Lookup(absl::string_view sequence_id) const;
  // Index into servers() of the owner. Requires a non-empty ring.
  size_t LookupIndex(absl::string_view sequence_id) const;

  // The servers, in the order they were added.
  const std::vector<std::string>& servers() const { return servers_; }
  size_t size() const { return servers_.size(); }
  bool empty() const { return servers_.empty(); }
  int virtual_nodes() const { return virtual_nodes_; }

 private:
  struct Point {
    uint64_t hash;
    uint32_t server;  // index into servers_
  };
  void Rebuild();

  int virtual_nodes_;
  std::vector<std::string> servers_;
  std::vector<Point> points_;  // sorted by (hash, server name)
};

}  // namespace indexer::client
