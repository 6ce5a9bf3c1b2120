"""bfloat16 on the wire: fp32 -> bf16 rounding (nearest, ties to even) and back, vectorized.

numpy has no bf16 type, so bf16 values are carried as their raw 16 bits (uint16), exactly as the
server's kernels/numeric.h does, and as float32 arrays holding bf16-representable values.
"""
import numpy as np


def to_bf16_bits(array) -> np.ndarray:
    """Rounds values to bf16 (nearest, ties to even) and returns their bits as uint16.

    Any float input is converted to float32 first. NaN stays NaN (quiet) and values beyond the
    bf16 range become +-Inf, so the server refuses them (INVALID_ARGUMENT) rather than the
    client hiding them.
    """
    u = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> 16) | np.uint32(0x0040), rounded).astype(np.uint16)


def to_bf16_bytes(array) -> bytes:
    """Rounds `array` to bf16 and packs it as little-endian bytes, row-major (the wire format)."""
    return to_bf16_bits(array).astype("<u2").tobytes()


def from_bf16_bits(bits) -> np.ndarray:
    """Widens bf16 bits (uint16) to float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def from_bf16_bytes(data: bytes, shape=None) -> np.ndarray:
    """Unpacks little-endian bf16 bytes to a float32 array, optionally reshaped."""
    values = from_bf16_bits(np.frombuffer(data, dtype="<u2"))
    return values if shape is None else values.reshape(shape)


def round_to_bf16(array) -> np.ndarray:
    """The float32 values the server stores for `array`: each rounded to the nearest bf16."""
    return from_bf16_bits(to_bf16_bits(array)).reshape(np.shape(array))


def round_to_fp8_e4m3(array) -> np.ndarray:
    """The float32 values an fp8 e4m3 cache stores for finite float32 `array`: nearest e4m3 value,
    ties to even, saturating at +-448 (SPEC.md "Index-K cache")."""
    x = np.asarray(array, dtype=np.float32)
    a = np.abs(x)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): the binade's step is 2^(e - 4)
    step = np.where(a < np.float32(2.0 ** -6), np.float32(2.0 ** -9),
                    np.ldexp(np.float32(1), e - 4).astype(np.float32))
    mag = np.minimum(np.round(a / step) * step, np.float32(448)).astype(np.float32)
    return np.copysign(mag, x).astype(np.float32)


def round_to_fp4_e2m1(array) -> np.ndarray:
    """The float32 values an fp4 cache stores for keys `array` [..., head_dim] (bf16 values):
    per group of 16, scale = e4m3(amax / 6), each value code * scale with code the nearest e2m1
    value of value / scale, ties to the even mantissa, saturating at +-6 (SPEC.md "fp4 key
    storage")."""
    x = np.asarray(array, dtype=np.float32)
    groups = x.reshape(x.shape[:-1] + (x.shape[-1] // 16, 16))
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    scale = round_to_fp8_e4m3(amax / np.float32(6))
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(scale > 0, groups / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    a = np.abs(r).astype(np.float32)
    # Steps of the e2m1 magnitudes {0, 0.5, 1, 1.5} {2, 3} {4, 6}; np.round ties to even.
    step = np.where(a < 2, np.float32(0.5), np.where(a < 4, np.float32(1), np.float32(2)))
    mag = np.minimum(np.round(a / step) * step, np.float32(6)).astype(np.float32)
    return (np.copysign(mag, r) * scale).astype(np.float32).reshape(x.shape)
