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
