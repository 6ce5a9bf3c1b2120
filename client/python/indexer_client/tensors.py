"""Tensors given to the client (numpy arrays, torch tensors, nested lists) as wire values.

Keys and queries are accepted as:
  * numpy arrays of any real or integer dtype (converted to float32, then rounded to bf16 on
    the wire unless fp32 is asked for);
  * torch tensors on any device, where torch is importable: bf16 tensors travel as their own
    bits (no rounding, no float32 copy), other floating and integer dtypes as float32. torch is
    never imported here: a tensor can only exist once its caller has imported torch, so the
    check reads sys.modules;
  * anything np.asarray accepts.
"""
import sys
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from indexer_client.bf16 import from_bf16_bits, to_bf16_bits


@dataclass(frozen=True)
class WireValues:
    """A tensor ready to pack: float32 values, or bf16 bits (uint16) when `bf16_bits` is set."""

    array: np.ndarray
    bf16_bits: bool = False

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.array.shape

    @property
    def ndim(self) -> int:
        return self.array.ndim

    def reshape(self, shape) -> "WireValues":
        return WireValues(self.array.reshape(shape), self.bf16_bits)

    def packed(self, wire_dtype: str) -> np.ndarray:
        """The values as the wire holds them, a contiguous little-endian array: for "bf16" the
        bits as given or float32 rounded to nearest even (uint16), for "fp32" float32 (bf16
        bits widen exactly)."""
        if wire_dtype == "bf16":
            bits = self.array if self.bf16_bits else to_bf16_bits(self.array)
            return np.ascontiguousarray(bits, dtype="<u2")
        if wire_dtype == "fp32":
            values = from_bf16_bits(self.array) if self.bf16_bits else self.array
            return np.ascontiguousarray(values, dtype="<f4")
        raise ValueError(f"wire_dtype is {wire_dtype!r}; it must be 'bf16' or 'fp32'")

    def bf16_bytes(self) -> bytes:
        """Little-endian bf16, row-major: the bits as given, or float32 rounded to nearest even."""
        return self.packed("bf16").tobytes()

    def fp32_bytes(self) -> bytes:
        """Little-endian float32, row-major (bf16 bits widen exactly)."""
        return self.packed("fp32").tobytes()


def wire_values(tensor, what: str) -> WireValues:
    """Converts `tensor` (see the module docstring). `what` names it in errors ("keys").

    Raises TypeError for dtypes that are not real numbers (bool, complex, strings, objects).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        return _from_torch(tensor, torch, what)
    array = np.asarray(tensor)
    if array.dtype.kind not in "fiu":
        raise TypeError(f"{what} has dtype {array.dtype}; give real numbers (float or integer)")
    return WireValues(array.astype(np.float32, copy=False))


def _from_torch(tensor, torch, what: str) -> WireValues:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        # Same-size reinterpretation: the bits, exactly; numpy has no bf16 dtype of its own.
        return WireValues(t.contiguous().view(torch.int16).numpy().view(np.uint16), bf16_bits=True)
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what} is a torch tensor of dtype {t.dtype}; give real numbers")
    return WireValues(t.to(torch.float32).contiguous().numpy())
