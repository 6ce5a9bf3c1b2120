#include "server/regions/call_regions.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace indexer::server {

absl::StatusOr<uint8_t*> CallRegions::Resolve(size_t item, const RegionRefView& ref,
                                              absl::string_view field, bool output) {
  // A call's references mostly name one region: the last one found is checked first.
  if (last_ == nullptr || ref.region != last_name_) {
    auto held = held_.find(ref.region);
    if (held == held_.end()) {
      absl::StatusOr<std::shared_ptr<const Region>> found =
          registry_ != nullptr
              ? registry_->Find(tenant_, ref.region)
              : absl::NotFoundError(absl::StrCat("region \"", ref.region, "\" is not registered"));
      if (!found.ok()) {
        return absl::Status(found.status().code(),
                            absl::StrCat(field, ": ", found.status().message()));
      }
      held = held_.emplace(ref.region, *std::move(found)).first;
    }
    last_ = held->second.get();
    last_name_.assign(ref.region.data(), ref.region.size());
  }
  const Region& region = *last_;
  const uint64_t size = region.size();
  if (ref.byte_size == 0 || ref.offset > size || ref.byte_size > size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset ", ref.offset, " + byte_size ", ref.byte_size, " is not within region \"",
        ref.region, "\" of ", size, " bytes", ref.byte_size == 0 ? " (byte_size is 0)" : ""));
  }
  uint8_t* data = region.data() + ref.offset;
  if (output && reinterpret_cast<uintptr_t>(data) % alignof(int32_t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset ", ref.offset, " is not a multiple of 4; int32 outputs must be aligned"));
  }
  ranges_.push_back(Range{&region, ref.offset, ref.offset + ref.byte_size, item, output});
  any_output_ = any_output_ || output;
  return data;
}

absl::StatusOr<ResolvedInput> CallRegions::Input(size_t item, const RegionRefView& ref,
                                                 absl::string_view field) {
  absl::StatusOr<uint8_t*> data = Resolve(item, ref, field, false);
  if (!data.ok()) return data.status();
  return ResolvedInput{absl::string_view(reinterpret_cast<const char*>(*data), ref.byte_size),
                       last_->device()};
}

absl::StatusOr<ResolvedOutput> CallRegions::Output(size_t item, const RegionRefView& ref,
                                                   absl::string_view field) {
  absl::StatusOr<uint8_t*> data = Resolve(item, ref, field, true);
  if (!data.ok()) return data.status();
  return ResolvedOutput{
      std::span<int32_t>(reinterpret_cast<int32_t*>(*data), ref.byte_size / sizeof(int32_t)),
      last_->device()};
}

std::vector<std::pair<size_t, absl::Status>> CallRegions::Conflicts() const {
  std::vector<std::pair<size_t, absl::Status>> out;
  if (!any_output_) return out;  // reads only: nothing can collide
  auto by_start = [](const Range& a, const Range& b) {
    return std::tie(a.region, a.begin) < std::tie(b.region, b.begin);
  };
  // Each item's few references are ordered first: when the items' memory follows item order, as
  // a scheduler's slabs do, the whole is then ordered and needs no sort.
  std::vector<Range> sorted = ranges_;
  for (size_t begin = 0, end = 0; begin < sorted.size(); begin = end) {
    while (end < sorted.size() && sorted[end].item == sorted[begin].item) ++end;
    for (size_t i = begin + 1; i < end; ++i) {  // insertion sort: at most five references
      for (size_t j = i; j > begin && by_start(sorted[j], sorted[j - 1]); --j) {
        std::swap(sorted[j], sorted[j - 1]);
      }
    }
  }
  if (!std::is_sorted(sorted.begin(), sorted.end(), by_start)) {
    std::sort(sorted.begin(), sorted.end(), by_start);
  }
  // Sweeping in order of start, a range collides with an earlier-starting one exactly when it
  // starts before the furthest end so far (of any range, for an output; of an output, for an
  // input). Every colliding pair is found when its later-starting range is reached.
  const Region* region = nullptr;
  uint64_t any_end = 0, output_end = 0;
  for (const Range& r : sorted) {
    if (r.region != region) {
      region = r.region;
      any_end = output_end = 0;
    }
    if (r.begin < (r.output ? any_end : output_end)) {
      out.emplace_back(r.item, absl::InvalidArgumentError(absl::StrCat(
                                   "an output reference overlaps another reference of the call in "
                                   "region \"", region->info.name, "\" near offset ", r.begin)));
    }
    any_end = std::max(any_end, r.end);
    if (r.output) output_end = std::max(output_end, r.end);
  }
  return out;
}

}  // namespace indexer::server
