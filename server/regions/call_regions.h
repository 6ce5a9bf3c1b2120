// CallRegions: a call's tensor references (RegionRefView) resolved against the caller's regions.
// It holds every region it resolves until it is destroyed, so the memory a running call reads
// and writes stays mapped even if the region is unregistered meanwhile; the call (StepCall)
// owns one and keeps it until its answer is sent.
//
// Each reference is bounds-checked (offset + byte_size within the region, overflow included);
// outputs must be int32-aligned. Once every reference of the call is resolved, Conflicts()
// names the items whose output overlaps another reference of the call, so that no call reads
// bytes it writes or writes bytes twice.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/regions/region_ref.h"
#include "server/regions/region_registry.h"

namespace indexer::server {

// What a reference names: host memory, or memory of CUDA device `device` (>= 0: a CUDA region,
// which only that device's kernels may touch).
struct ResolvedInput {
  absl::string_view bytes;
  int device = -1;
};
struct ResolvedOutput {
  std::span<int32_t> values;
  int device = -1;
};

class CallRegions {
 public:
  // `registry` may be null (a server without regions: every reference is NOT_FOUND); it must
  // outlive this object.
  CallRegions(const RegionRegistry* registry, absl::string_view tenant)
      : registry_(registry), tenant_(tenant) {}

  // The bytes `ref` names, for item `item`'s input `field` ("keys_ref", "queries_ref").
  absl::StatusOr<ResolvedInput> Input(size_t item, const RegionRefView& ref,
                                      absl::string_view field);
  // The int32 values `ref` names (byte_size / 4 of them), for item `item`'s output `field`.
  absl::StatusOr<ResolvedOutput> Output(size_t item, const RegionRefView& ref,
                                        absl::string_view field);

  // For each item whose output overlaps another reference of the call (its own included): the
  // item and why. Of two overlapping references one item is named, which suffices: a named
  // item is refused whole.
  std::vector<std::pair<size_t, absl::Status>> Conflicts() const;

 private:
  struct Range {
    const Region* region;
    uint64_t begin, end;
    size_t item;
    bool output;
  };
  absl::StatusOr<uint8_t*> Resolve(size_t item, const RegionRefView& ref, absl::string_view field,
                                   bool output);

  const RegionRegistry* const registry_;
  const absl::string_view tenant_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Region>> held_;
  const Region* last_ = nullptr;  // the region last resolved (held in held_), named last_name_
  std::string last_name_;
  std::vector<Range> ranges_;
  bool any_output_ = false;
};

}  // namespace indexer::server
