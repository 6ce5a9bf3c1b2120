// ScanBf16Bits: one pass over bf16 values that tells whether all are finite and sums up their
// range by numeric.h's rule (the largest magnitude, and whether every value lies in f16's range).
// The engine's finiteness check of host tensors and the CUDA backend's staging scan both use it,
// so the rule is applied one way. Host memory only. Inline: callers scan many short tensors (one
// key or query row each), where a call would cost about as much as the scan.
#pragma once

#include <cstdint>

#include "kernels/numeric.h"

namespace indexer::kernels {

struct Bf16Scan {
  bool all_finite = true;
  // Of finite values (meaningless when all_finite is false): the bf16 bits of the largest
  // magnitude (sign cleared), and whether every value is zero or in [2^-14, 65504].
  uint16_t max_magnitude = 0;
  bool fits_f16 = true;
};

// Branch-free and in 16-bit lanes only (magnitudes fit int16), so the loop vectorises at full
// width. A value is not finite when its exponent bits are all ones: adding one to the exponent
// then carries into bit 15.
inline Bf16Scan ScanBf16Bits(const uint16_t* values, int64_t n) {
  uint16_t carry = 0;
  int16_t max_bits = 0;
  int16_t least = kBf16NoNonzero;
  for (int64_t i = 0; i < n; ++i) {
    carry |= static_cast<uint16_t>((values[i] & 0x7f80u) + 0x0080u);
    const int16_t a = static_cast<int16_t>(values[i] & 0x7fff);
    max_bits = a > max_bits ? a : max_bits;
    const int16_t key = Bf16LeastNonzeroKey(a);
    least = key < least ? key : least;
  }
  return Bf16Scan{(carry & 0x8000u) == 0, static_cast<uint16_t>(max_bits),
                  Bf16MagnitudesFitF16(least, max_bits)};
}

}  // namespace indexer::kernels
