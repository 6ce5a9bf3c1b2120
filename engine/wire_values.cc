#include "engine/wire_values.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"

namespace indexer::engine {

static_assert(std::endian::native == std::endian::little,
              "wire tensors are little-endian; a big-endian host needs byte swaps here");

absl::Status DecodeRows(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                        absl::string_view field, std::vector<uint16_t>* out, int64_t* rows) {
  if (dtype == WireDtype::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": dtype is unspecified; say BF16 or FP32"));
  }
  const int64_t width = dtype == WireDtype::kBf16 ? 2 : 4;
  const int64_t row_bytes = row_values * width;
  const int64_t size = static_cast<int64_t>(bytes.size());
  if (size == 0 || size % row_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", size, " bytes; it must be a non-zero multiple of one row, ", row_values,
        " values of ", width, " bytes = ", row_bytes, " bytes"));
  }
  *rows = size / row_bytes;
  const int64_t n = size / width;
  out->resize(n);
  uint16_t* dst = out->data();
  if (dtype == WireDtype::kBf16) {
    std::memcpy(dst, bytes.data(), size);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, bytes.data() + i * 4, 4);
      dst[i] = kernels::FloatToBf16(f);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!kernels::Bf16IsFinite(dst[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i / row_values, "][", i % row_values, "] is ",
          dtype == WireDtype::kFp32 ? "not finite or too large for bf16" : "not finite",
          "; every value must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace indexer::engine
