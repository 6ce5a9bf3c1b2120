// RegionRefView: a RegionRef message as the server reads it from a request's bytes
// (ReadStepRequest) and resolves it (CallRegions): `byte_size` bytes at `offset` of the caller's
// registered region `region`. The name views the request.
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"

namespace indexer::server {

struct RegionRefView {
  absl::string_view region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

}  // namespace indexer::server
