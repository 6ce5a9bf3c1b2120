#include "engine/wire_values.h"

#include <bit>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "kernels/bf16_scan.h"
#include "kernels/numeric.h"

namespace indexer::engine {

static_assert(std::endian::native == std::endian::little,
              "wire tensors are little-endian; a big-endian host needs byte swaps here");

namespace {

absl::Status CheckRowBytes(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                           absl::string_view field, int64_t* rows) {
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
  return absl::OkStatus();
}

// Rounds fp32 values to bf16 bits (or copies bf16 bits) into dst.
void ToBf16(absl::string_view bytes, WireDtype dtype, uint16_t* dst) {
  if (dtype == WireDtype::kBf16) {
    std::memcpy(dst, bytes.data(), bytes.size());
    return;
  }
  const int64_t n = static_cast<int64_t>(bytes.size()) / 4;
  for (int64_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, bytes.data() + i * 4, 4);
    dst[i] = kernels::FloatToBf16(f);
  }
}

// INVALID_ARGUMENT naming the first value of `values` that is not finite; when all are, their
// summary into *summary (when given).
absl::Status CheckFinite(const uint16_t* values, int64_t n, WireDtype dtype, int64_t row_values,
                         absl::string_view field, kernels::Bf16Summary* summary = nullptr) {
  // One vectorised scan first (the common case: every value finite), the position only on
  // failure; the summary comes from the same pass.
  const kernels::Bf16Scan scan = kernels::ScanBf16Bits(values, n);
  if (scan.all_finite) {
    if (summary != nullptr) {
      *summary = kernels::Bf16Summary{true, scan.max_magnitude, scan.fits_f16};
    }
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!kernels::Bf16IsFinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i / row_values, "][", i % row_values, "] is ",
          dtype == WireDtype::kFp32 ? "not finite or too large for bf16" : "not finite",
          "; every value must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRows(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                        absl::string_view field, std::vector<uint16_t>* out, int64_t* rows) {
  if (absl::Status s = CheckRowBytes(bytes, dtype, row_values, field, rows); !s.ok()) return s;
  const int64_t width = dtype == WireDtype::kBf16 ? 2 : 4;
  out->resize(bytes.size() / width);
  ToBf16(bytes, dtype, out->data());
  return CheckFinite(out->data(), static_cast<int64_t>(out->size()), dtype, row_values, field);
}

absl::Status DecodeRowsView(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                            absl::string_view field, Bf16Rows* out) {
  if (absl::Status s = CheckRowBytes(bytes, dtype, row_values, field, &out->rows); !s.ok()) {
    return s;
  }
  const int64_t width = dtype == WireDtype::kBf16 ? 2 : 4;
  const int64_t n = static_cast<int64_t>(bytes.size()) / width;
  if (dtype == WireDtype::kBf16 && reinterpret_cast<uintptr_t>(bytes.data()) % 2 == 0) {
    out->data = reinterpret_cast<const uint16_t*>(bytes.data());
  } else {
    out->owned.resize(n);
    ToBf16(bytes, dtype, out->owned.data());
    out->data = out->owned.data();
  }
  return CheckFinite(out->data, n, dtype, row_values, field, &out->summary);
}

absl::Status DeviceRowsView(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                            absl::string_view field, Bf16Rows* out) {
  if (dtype != WireDtype::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is in a CUDA region: its dtype must be BF16 (the server converts no other dtype "
        "there)"));
  }
  INDEXER_RETURN_IF_ERROR(CheckRowBytes(bytes, dtype, row_values, field, &out->rows));
  if (reinterpret_cast<uintptr_t>(bytes.data()) % kDeviceTensorAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is in a CUDA region at an address that is not a multiple of ",
        kDeviceTensorAlignment, " bytes; align its offset"));
  }
  out->data = reinterpret_cast<const uint16_t*>(bytes.data());
  return absl::OkStatus();
}

}  // namespace indexer::engine
