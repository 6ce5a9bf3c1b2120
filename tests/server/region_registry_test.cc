// RegionRegistry, SystemRegion and CallRegions without a server: tenants see only their own
// regions, a region a call holds outlives its unregistration, every reference is bounds-checked
// (overflow included), and outputs that overlap another reference of the call are found.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "client/cpp/shared_memory.h"
#include "server/regions/call_regions.h"
#include "server/regions/region_registry.h"
#include "server/regions/system_region.h"

namespace indexer::server {
namespace {

using ::testing::HasSubstr;

std::string Key(absl::string_view what) {
  static int counter = 0;
  return absl::StrCat("/indexer-registry-test-", ::getpid(), "-", what, "-", ++counter);
}

std::unique_ptr<client::SharedMemoryRegion> Object(size_t bytes) {
  absl::StatusOr<std::unique_ptr<client::SharedMemoryRegion>> shm =
      client::SharedMemoryRegion::Create(Key("obj"), bytes);
  EXPECT_TRUE(shm.ok()) << shm.status();
  return shm.ok() ? *std::move(shm) : nullptr;
}

RegionRefView Ref(absl::string_view region, uint64_t offset, uint64_t size) {
  return RegionRefView{region, offset, size};
}

TEST(SystemRegion, MapsTheRangeAndRefusesWhatIsNotThere) {
  auto shm = Object(10000);
  ASSERT_NE(shm, nullptr);
  std::memcpy(shm->data() + 5000, "hello", 5);
  absl::StatusOr<std::unique_ptr<SystemRegion>> region = SystemRegion::Map(shm->key(), 5000, 100);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(std::memcmp((*region)->data(), "hello", 5), 0) << "the offset is not page aligned";
  (*region)->data()[5] = '!';
  EXPECT_EQ(shm->data()[5005], '!') << "the mapping is not shared";

  EXPECT_EQ(SystemRegion::Map(shm->key(), 9000, 1001).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SystemRegion::Map(shm->key(), std::numeric_limits<uint64_t>::max(), 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SystemRegion::Map(shm->key(), 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SystemRegion::Map("/indexer-no-such-object", 0, 1).status().code(),
            absl::StatusCode::kNotFound);
  for (const char* bad : {"", "/", "noslash", "/a/b"}) {
    EXPECT_EQ(SystemRegion::Map(bad, 0, 1).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SystemRegion, TheMappingOutlivesTheObjectsName) {
  auto shm = Object(4096);
  ASSERT_NE(shm, nullptr);
  absl::StatusOr<std::unique_ptr<SystemRegion>> region = SystemRegion::Map(shm->key(), 0, 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string key = shm->key();
  shm.reset();  // unmapped and unlinked by its creator
  EXPECT_EQ(SystemRegion::Map(key, 0, 1).status().code(), absl::StatusCode::kNotFound);
  (*region)->data()[4095] = 7;  // still mapped: the memory lives until the server unmaps it
  EXPECT_EQ((*region)->data()[4095], 7);
}

TEST(RegionRegistry, TenantsSeeOnlyTheirOwnRegions) {
  auto a = Object(4096), b = Object(4096);
  ASSERT_TRUE(a && b);
  RegionRegistry registry(4);
  ASSERT_TRUE(registry.RegisterSystem("alice", "r", a->key(), 0, 4096).ok());
  EXPECT_EQ(registry.Find("bob", "r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List("bob", "r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("bob", "r").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.RegisterSystem("bob", "r", b->key(), 0, 1024).ok())
      << "the same name for another tenant is another region";
  EXPECT_EQ(registry.RegisterSystem("alice", "r", b->key(), 0, 16).code(),
            absl::StatusCode::kAlreadyExists);
  absl::StatusOr<std::shared_ptr<const Region>> alice = registry.Find("alice", "r");
  absl::StatusOr<std::shared_ptr<const Region>> bob = registry.Find("bob", "r");
  ASSERT_TRUE(alice.ok() && bob.ok());
  EXPECT_EQ((*alice)->size(), 4096u);
  EXPECT_EQ((*bob)->size(), 1024u);
  absl::StatusOr<std::vector<RegionInfo>> listed = registry.List("bob", "");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].key, b->key());
  EXPECT_EQ((*listed)[0].kind, "system");
  EXPECT_EQ(*registry.Unregister("alice", ""), 1);
  EXPECT_TRUE(registry.Find("bob", "r").ok()) << "unregistering all of a tenant's took another's";
}

TEST(RegionRegistry, LimitsNamesAndCounts) {
  auto shm = Object(4096);
  ASSERT_NE(shm, nullptr);
  RegionRegistry registry(2);
  EXPECT_EQ(registry.RegisterSystem("t", "", shm->key(), 0, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("t", std::string(129, 'n'), shm->key(), 0, 1).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.RegisterSystem("t", "one", shm->key(), 0, 1).ok());
  ASSERT_TRUE(registry.RegisterSystem("t", "two", shm->key(), 1, 1).ok());
  const absl::Status third = registry.RegisterSystem("t", "three", shm->key(), 2, 1);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max_regions"));
  EXPECT_TRUE(registry.RegisterSystem("other", "three", shm->key(), 2, 1).ok())
      << "the limit is per tenant";
  EXPECT_EQ(RegionRegistry(0).RegisterSystem("t", "x", shm->key(), 0, 1).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RegionRegistry, AHeldRegionOutlivesItsUnregistration) {
  auto shm = Object(4096);
  ASSERT_NE(shm, nullptr);
  RegionRegistry registry(1);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", shm->key(), 0, 4096).ok());
  CallRegions call(&registry, "t");
  absl::StatusOr<ResolvedOutput> out = call.Output(0, Ref("r", 0, 64), "out");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->device, -1) << "a system region is host memory";
  EXPECT_EQ(*registry.Unregister("t", "r"), 1);
  EXPECT_EQ(registry.Find("t", "r").status().code(), absl::StatusCode::kNotFound);
  out->values[15] = 42;  // the call's hold keeps the mapping
  EXPECT_EQ(reinterpret_cast<const int32_t*>(shm->data())[15], 42);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", shm->key(), 0, 8).ok())
      << "the name is free again, and the held region does not count against the limit";
}

// A registry that pins system regions for the GPUs keeps a region it cannot pin (no GPU, or a
// build without CUDA) as host memory: registered, listed unpinned, resolved as host bytes.
TEST(RegionRegistry, ARegionThatCannotBePinnedStaysInHostMemory) {
  // No GPU for this process (before its first CUDA call): pinning fails as on CI. Pinned
  // regions are tested on the GPU (tests/gpu/cuda_region_test.cc).
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  auto shm = Object(4096);
  ASSERT_NE(shm, nullptr);
  RegionRegistry registry(4, {}, /*pin_system=*/true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", shm->key(), 0, 4096).ok());
  absl::StatusOr<std::vector<RegionInfo>> listed = registry.List("t", "r");
  ASSERT_TRUE(listed.ok());
  EXPECT_FALSE((*listed)[0].pinned);
  CallRegions call(&registry, "t");
  absl::StatusOr<ResolvedInput> in = call.Input(0, Ref("r", 16, 256), "q");
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->device, -1);
}

TEST(CallRegions, ChecksEveryReferenceAgainstItsRegion) {
  auto shm = Object(1000);
  ASSERT_NE(shm, nullptr);
  RegionRegistry registry(1);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", shm->key(), 0, 1000).ok());
  CallRegions call(&registry, "t");
  EXPECT_TRUE(call.Input(0, Ref("r", 0, 1000), "q").ok());
  EXPECT_TRUE(call.Input(0, Ref("r", 999, 1), "q").ok());
  const uint64_t huge = std::numeric_limits<uint64_t>::max();
  for (const auto& [offset, size] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 1001}, {1000, 1}, {999, 2}, {huge, 2}, {2, huge}, {0, 0}}) {
    const absl::Status s = call.Input(0, Ref("r", offset, size), "queries_ref").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << offset << " + " << size;
    EXPECT_THAT(s.message(), HasSubstr("queries_ref"));
  }
  EXPECT_EQ(call.Output(0, Ref("r", 2, 8), "out").status().code(),
            absl::StatusCode::kInvalidArgument)
      << "an unaligned int32 output";
  EXPECT_EQ(call.Input(0, Ref("nope", 0, 1), "q").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CallRegions(&registry, "other").Input(0, Ref("r", 0, 1), "q").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(CallRegions(nullptr, "t").Input(0, Ref("r", 0, 1), "q").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(CallRegions, FindsOutputsThatOverlapAnotherReference) {
  auto shm = Object(4096);
  ASSERT_NE(shm, nullptr);
  RegionRegistry registry(2);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", shm->key(), 0, 4096).ok());
  ASSERT_TRUE(registry.RegisterSystem("t", "s", shm->key(), 0, 4096).ok());
  {
    CallRegions call(&registry, "t");  // inputs may overlap each other
    ASSERT_TRUE(call.Input(0, Ref("r", 0, 100), "q").ok());
    ASSERT_TRUE(call.Input(1, Ref("r", 50, 100), "q").ok());
    ASSERT_TRUE(call.Output(1, Ref("r", 200, 40), "o").ok());
    ASSERT_TRUE(call.Output(2, Ref("r", 240, 40), "o").ok());  // adjacent, not overlapping
    ASSERT_TRUE(call.Output(3, Ref("s", 200, 40), "o").ok());  // another region's name
    EXPECT_THAT(call.Conflicts(), ::testing::IsEmpty());
  }
  {
    CallRegions call(&registry, "t");
    ASSERT_TRUE(call.Input(0, Ref("r", 0, 100), "q").ok());
    ASSERT_TRUE(call.Output(1, Ref("r", 96, 8), "o").ok());    // over item 0's input
    ASSERT_TRUE(call.Output(2, Ref("r", 400, 100), "o").ok());
    ASSERT_TRUE(call.Input(3, Ref("r", 450, 4), "q").ok());    // inside item 2's output
    ASSERT_TRUE(call.Output(4, Ref("r", 1000, 8), "o").ok());
    ASSERT_TRUE(call.Output(4, Ref("r", 1004, 8), "o").ok());  // its own other output
    std::vector<size_t> named;
    for (const auto& [item, status] : call.Conflicts()) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      named.push_back(item);
    }
    EXPECT_THAT(named, ::testing::UnorderedElementsAre(1, 3, 4));
  }
}

}  // namespace
}  // namespace indexer::server
