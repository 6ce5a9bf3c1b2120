// Decoding of keys and queries as they arrive on the wire (packed little-endian bf16 or fp32)
// into bf16 bits, with the checks SPEC.md requires: whole rows only, finite values only.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/select_types.h"

namespace indexer::engine {

enum class WireDtype { kUnspecified, kBf16, kFp32 };

// Decodes `bytes` as rows of `row_values` values of `dtype`, rounding fp32 to bf16 (nearest,
// ties to even), into *out (resized) and sets *rows. Returns INVALID_ARGUMENT naming `field` when
// the dtype is unspecified, the bytes are empty or not a whole number of rows, or any value is
// NaN, Inf, or (fp32) too large for bf16. On error *out and *rows are unspecified.
absl::Status DecodeRows(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                        absl::string_view field, std::vector<uint16_t>* out, int64_t* rows);

// Rows of bf16 bits as the engine reads them from a request: a view of the request's own bytes
// when they arrived as bf16 (the hot path copies nothing), else of `owned` (fp32 rounded to
// bf16, or bytes that were not 2-byte aligned). Move-only: `data` may point into `owned`.
struct Bf16Rows {
  const uint16_t* data = nullptr;
  int64_t rows = 0;
  std::vector<uint16_t> owned;
  kernels::Bf16Summary summary;  // known once DecodeRowsView has checked host values

  Bf16Rows() = default;
  Bf16Rows(Bf16Rows&&) = default;
  Bf16Rows& operator=(Bf16Rows&&) = default;
  Bf16Rows(const Bf16Rows&) = delete;
  Bf16Rows& operator=(const Bf16Rows&) = delete;
};

// DecodeRows with the same checks and errors, into *out: for bf16 bytes a view of `bytes`,
// which must then outlive *out; out->summary is what the check found.
absl::Status DecodeRowsView(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                            absl::string_view field, Bf16Rows* out);

// Where a request's tensor lives (AppendRequest::keys_device, StepRequest::queries_device,
// ProvidedOutputs::device): host memory the engine reads (kHostTensor); memory of CUDA device
// d >= 0 (a client's CUDA region); or host memory that every GPU of the host reads and writes
// in place (kMappedHostTensor: a system region the server pinned). The last two are read only
// by a backend that TakesDeviceTensors of them, never by the engine.
inline constexpr int kHostTensor = -1;
inline constexpr int kMappedHostTensor = -2;

// Device tensors start at a multiple of this many bytes: the device copies them in 16-byte
// words.
inline constexpr uintptr_t kDeviceTensorAlignment = 16;

// The checks DecodeRowsView makes that need no access to the values, for bytes a device reads
// (not kHostTensor): dtype BF16 only, whole rows, kDeviceTensorAlignment; *out views the bytes.
// Their values are checked on the device, when the step runs (SpanSelect::queries_nonfinite).
absl::Status DeviceRowsView(absl::string_view bytes, WireDtype dtype, int64_t row_values,
                            absl::string_view field, Bf16Rows* out);

}  // namespace indexer::engine
