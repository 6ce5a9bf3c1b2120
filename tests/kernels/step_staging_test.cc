// StepStaging's host side (kernels/cuda/step_staging.h), plain C++: the block tables it stages
// for key writes and selections are the page ids made relative to the device's page range, and
// the first id outside that range is the one it reports, for every range a pool can have. Runs
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/cuda/step_staging.h"

namespace indexer::testing {
namespace {

using kernels::KeyWrite;
using kernels::cuda::PageRange;
using kernels::cuda::SpanDesc;
using kernels::cuda::StagedSpan;
using kernels::cuda::StepStaging;

constexpr int kHeadDim = 16;

// The first id of `ids` that does not lie in the range, computed in 64 bits.
std::optional<int32_t> FirstOutside(const std::vector<int32_t>& ids, PageRange pages) {
  for (int32_t id : ids) {
    const int64_t local = int64_t{id} - pages.first;
    if (local < 0 || local >= pages.count) return id;
  }
  return std::nullopt;
}

// One selection over `table` (every entry visible), staged: what WriteInputs answers, and the
// staged table when it answers nullopt.
struct Staged {
  std::optional<int32_t> bad;
  std::vector<int32_t> table;
};

Staged StageSpan(const std::vector<int32_t>& table, PageRange pages) {
  std::vector<uint16_t> queries(kHeadDim, 0x3f80);
  std::vector<int32_t> block_ids(16);
  StagedSpan span;
  span.host.block_table = table.data();
  span.host.start_pos = (static_cast<int64_t>(table.size()) - 1) * kernels::kBlockSize;
  span.host.queries = queries.data();
  span.host.block_ids = block_ids.data();
  StepStaging staging;
  staging.Plan({}, std::span<const StagedSpan>(&span, 1), kHeadDim, kernels::KeyStorage::kBf16, {});
  std::vector<char> host(staging.input_bytes()), device(staging.input_bytes()), out(4096);
  Staged staged;
  staged.bad = staging.WriteInputs(host.data(), device.data(), out.data(), pages, {}, 1);
  if (staged.bad) return staged;
  SpanDesc desc;  // the selection batch's image starts with the descriptors
  std::memcpy(&desc, host.data(), sizeof(desc));
  const auto offset = reinterpret_cast<const char*>(desc.block_table) - device.data();
  staged.table.resize(table.size());
  std::memcpy(staged.table.data(), host.data() + offset, table.size() * 4);
  return staged;
}

// A key write of one token into the last block of `table`: what WriteInputs answers.
std::optional<int32_t> StageWrite(const std::vector<int32_t>& table, PageRange pages) {
  std::vector<uint16_t> keys(kHeadDim, 0x3f80);
  const int64_t start = 0;
  KeyWrite write;
  write.block_table = table.data();
  write.num_tokens = static_cast<int64_t>(table.size()) * kernels::kBlockSize;
  write.layer_start = &start;
  std::vector<uint16_t> all_keys(static_cast<size_t>(write.num_tokens) * kHeadDim, 0x3f80);
  write.keys = all_keys.data();
  StepStaging staging;
  staging.Plan(std::span<const KeyWrite>(&write, 1), {}, kHeadDim, kernels::KeyStorage::kBf16, {});
  std::vector<char> host(staging.input_bytes()), device(staging.input_bytes()), out(64);
  return staging.WriteInputs(host.data(), device.data(), out.data(), pages, {}, 1);
}

std::vector<int32_t> Ids(int64_t first, int n) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(first + (i * 37) % n);
  return ids;
}

TEST(StepStagingTest, TablesAreStagedRelativeToTheDevicesPages) {
  const PageRange pages{1000, 500};
  const std::vector<int32_t> ids = Ids(1000, 200);
  const Staged staged = StageSpan(ids, pages);
  ASSERT_FALSE(staged.bad.has_value());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i] - 1000, staged.table[i]) << i;
  EXPECT_FALSE(StageWrite(ids, pages).has_value());
}

TEST(StepStagingTest, TheFirstIdOutsideTheRangeIsReported) {
  const std::vector<PageRange> ranges = {
      {0, INT64_MAX},                          // no range: only negative ids are outside
      {1000, 500},
      {0, 1},
      {(int64_t{1} << 31) - 10, 10},           // the last pages an int32 id can name
      {(int64_t{1} << 31) - 10, INT64_MAX},
      {int64_t{1} << 31, 5},                   // past every int32 id
      {-5, 20},                                // a negative first page
      {7, 0},                                  // an empty range
  };
  const std::vector<int32_t> strays = {INT32_MIN, -1, 0, 999, 1499, 1500, INT32_MAX - 10,
                                       INT32_MAX, 14, 15};
  for (const PageRange& pages : ranges) {
    // Ids inside the range (where it has any an int32 can name), then one stray among them.
    const int64_t base = pages.first < 0 || pages.first > INT32_MAX ? 0 : pages.first;
    const int n = static_cast<int>(
        std::min({std::max<int64_t>(pages.count, 1), int64_t{70}, int64_t{INT32_MAX} - base + 1}));
    for (int32_t stray : strays) {
      for (int at : {0, 5, n / 2, n - 1}) {
        std::vector<int32_t> ids = Ids(base, n);
        ids[at] = stray;
        const std::optional<int32_t> want = FirstOutside(ids, pages);
        EXPECT_EQ(want, StageSpan(ids, pages).bad)
            << "first " << pages.first << " count " << pages.count << " stray " << stray << " at " << at;
        EXPECT_EQ(want, StageWrite(ids, pages))
            << "first " << pages.first << " count " << pages.count << " stray " << stray << " at " << at;
      }
    }
  }
}

}  // namespace
}  // namespace indexer::testing
