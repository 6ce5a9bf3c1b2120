// HashRing (client/cpp/hash_ring.h): hashing, balance over servers, stability when a server is
// added or removed, hash tags, and the golden table the Python ring is held to as well
// (tests/python/test_hash_ring.py has the same table).
#include "client/cpp/hash_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace indexer::client {
namespace {

std::vector<std::string> Servers(int n) {
  std::vector<std::string> s;
  for (int i = 0; i < n; ++i) s.push_back(absl::StrCat("indexer-", i, ".svc:50051"));
  return s;
}

std::vector<std::string> Ids(int n) {
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) ids.push_back(absl::StrCat("bench-4242-1700000000000-s0-", i));
  return ids;
}

TEST(HashRingTest, FnvMatchesPublishedVectors) {
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_EQ(Mix64(0), 0u);
  EXPECT_NE(RingHash("a"), RingHash("b"));
}

TEST(HashRingTest, ShardKeyUsesHashTags) {
  EXPECT_EQ(ShardKey("plain"), "plain");
  EXPECT_EQ(ShardKey("{conv7}.a"), "conv7");
  EXPECT_EQ(ShardKey("x{conv7}y{z}"), "conv7");
  EXPECT_EQ(ShardKey("{}x"), "{}x");  // an empty tag hashes the whole id
  EXPECT_EQ(ShardKey("a}b{c"), "a}b{c");
  EXPECT_EQ(ShardKey("{open"), "{open");
}

TEST(HashRingTest, RefusesBadServers) {
  EXPECT_FALSE(HashRing::Create({}).ok() && !HashRing::Create({})->empty());
  EXPECT_EQ(HashRing::Create({"a", "a"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HashRing::Create({""}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HashRing::Create({"a"}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  HashRing ring;
  EXPECT_EQ(ring.Lookup("x").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ring.Add("a").ok());
  EXPECT_EQ(ring.Add("a").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ring.Remove("b").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*ring.Lookup("anything"), "a");
}

TEST(HashRingTest, BalancedOverTenServers) {
  absl::StatusOr<HashRing> ring = HashRing::Create(Servers(10));
  ASSERT_TRUE(ring.ok());
  std::map<std::string, int> load;
  const std::vector<std::string> ids = Ids(100000);
  for (const std::string& id : ids) ++load[*ring->Lookup(id)];
  ASSERT_EQ(load.size(), 10u);
  const double mean = 100000.0 / 10;
  for (const auto& [server, n] : load) {
    EXPECT_NEAR(n, mean, 0.15 * mean) << server;
  }
}

TEST(HashRingTest, AddingAServerMovesOnlyItsShare) {
  absl::StatusOr<HashRing> ring = HashRing::Create(Servers(10));
  ASSERT_TRUE(ring.ok());
  const std::vector<std::string> ids = Ids(100000);
  std::vector<std::string> before;
  for (const std::string& id : ids) before.push_back(*ring->Lookup(id));
  const std::string added = "indexer-10.svc:50051";
  ASSERT_TRUE(ring->Add(added).ok());
  int moved = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string now = *ring->Lookup(ids[i]);
    if (now == before[i]) continue;
    ++moved;
    ASSERT_EQ(now, added) << ids[i] << " moved from " << before[i] << " to a server that was there";
  }
  // About 1/11 of the ids move, all to the new server.
  EXPECT_NEAR(moved, 100000.0 / 11, 0.2 * 100000.0 / 11);
}

TEST(HashRingTest, RemovingAServerMovesOnlyItsIds) {
  absl::StatusOr<HashRing> ring = HashRing::Create(Servers(10));
  ASSERT_TRUE(ring.ok());
  const std::vector<std::string> ids = Ids(50000);
  std::vector<std::string> before;
  for (const std::string& id : ids) before.push_back(*ring->Lookup(id));
  const std::string removed = "indexer-3.svc:50051";
  ASSERT_TRUE(ring->Remove(removed).ok());
  int moved = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string now = *ring->Lookup(ids[i]);
    if (before[i] == removed) {
      ++moved;
      EXPECT_NE(now, removed);
    } else {
      ASSERT_EQ(now, before[i]) << ids[i];
    }
  }
  EXPECT_GT(moved, 0);
  // Adding it back restores the original mapping exactly.
  ASSERT_TRUE(ring->Add(removed).ok());
  for (size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(*ring->Lookup(ids[i]), before[i]);
}

TEST(HashRingTest, IndependentOfServerOrder) {
  std::vector<std::string> servers = Servers(7);
  absl::StatusOr<HashRing> a = HashRing::Create(servers);
  std::reverse(servers.begin(), servers.end());
  absl::StatusOr<HashRing> b = HashRing::Create(servers);
  ASSERT_TRUE(a.ok() && b.ok());
  for (const std::string& id : Ids(5000)) EXPECT_EQ(*a->Lookup(id), *b->Lookup(id));
}

TEST(HashRingTest, HashTagsColocate) {
  absl::StatusOr<HashRing> ring = HashRing::Create(Servers(10));
  ASSERT_TRUE(ring.ok());
  for (int c = 0; c < 100; ++c) {
    const std::string tag = absl::StrCat("conversation-", c);
    EXPECT_EQ(*ring->Lookup(absl::StrCat("{", tag, "}.a")), *ring->Lookup(tag));
    EXPECT_EQ(*ring->Lookup(absl::StrCat("{", tag, "}.fork-2")), *ring->Lookup(tag));
  }
}

// The contract with the Python ring: the same table is in tests/python/test_hash_ring.py.
TEST(HashRingTest, GoldenTable) {
  absl::StatusOr<HashRing> ring = HashRing::Create(
      {"indexer-a:50051", "indexer-b:50051", "indexer-c:50051", "indexer-d:50051"});
  ASSERT_TRUE(ring.ok());
  const std::vector<std::pair<std::string, std::string>> golden = {
      {"seq-0", "indexer-d:50051"},
      {"seq-1", "indexer-b:50051"},
      {"seq-2", "indexer-a:50051"},
      {"seq-3", "indexer-a:50051"},
      {"seq-4", "indexer-a:50051"},
      {"seq-5", "indexer-c:50051"},
      {"seq-6", "indexer-c:50051"},
      {"seq-7", "indexer-a:50051"},
      {"seq-8", "indexer-a:50051"},
      {"seq-9", "indexer-b:50051"},
      {"", "indexer-a:50051"},
      {"{conv7}.a", "indexer-c:50051"},
      {"{conv7}.b", "indexer-c:50051"},
      {"conv7", "indexer-c:50051"},
      {"s\xc3\xa9quence-\xc3\xbc", "indexer-c:50051"},
      {"a}b{c", "indexer-a:50051"},
      {"{}x", "indexer-a:50051"},
      {"bench-123-1700000000000-s0-42", "indexer-d:50051"},
  };
  for (const auto& [id, server] : golden)
    EXPECT_EQ(*ring->Lookup(id), server) << "id '" << id << "'";
}

}  // namespace
}  // namespace indexer::client
