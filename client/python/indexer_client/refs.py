"""References to bytes of a registered shared-memory region, for tensors passed by reference.

A caller on the server's host registers a region once (register_system_region) and then names
bytes in it instead of sending them (proto/indexer/v1/indexer.proto, "Tensors by reference"):
  * TensorRef: a tensor stored in a region, with its shape and dtype. keys= and queries= take
    one wherever they take an array; it is shape-checked as an array would be, and its shape
    gives num_tokens (its byte size / one token's row).
  * RegionRef: a plain byte range, the wire's RegionRef.
  * OutputRefs: where a selection writes block_ids, page_table and context_lens instead of
    answering them (Step.outputs, select_blocks(outputs=)).
Offsets are relative to the registered region's first byte. SystemRegion (shared_memory.py)
writes tensors into a region and returns TensorRefs, and reads outputs back.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from indexer_client._stubs import pb

# Little-endian element types of the dtypes a region holds: bf16 travels as its bits.
ITEM_DTYPES = {"bf16": np.dtype("<u2"), "fp32": np.dtype("<f4"), "int32": np.dtype("<i4")}
_VALUE_DTYPES = {"bf16": pb.VALUE_DTYPE_BF16, "fp32": pb.VALUE_DTYPE_FP32}
OUTPUT_FIELDS = ("block_ids", "page_table", "context_lens")


@dataclass(frozen=True)
class RegionRef:
    """`byte_size` bytes at `offset` of the caller's registered region `region`."""

    region: str
    offset: int
    byte_size: int

    @property
    def end(self) -> int:
        """The offset just past these bytes (where a following tensor may start)."""
        return self.offset + self.byte_size

    def to_proto(self):
        return pb.RegionRef(region=self.region, offset=self.offset, byte_size=self.byte_size)


@dataclass(frozen=True)
class TensorRef:
    """A row-major tensor of `shape` stored at `offset` of region `region`, as `dtype`: "bf16"
    (little-endian bits), "fp32" or "int32". Keys and queries are bf16 or fp32; the request
    carries this dtype whatever the step's wire_dtype (which converts arrays only)."""

    region: str
    offset: int
    shape: Tuple[int, ...]
    dtype: str = "bf16"

    def __post_init__(self):
        if self.dtype not in ITEM_DTYPES:
            raise ValueError(f"dtype is {self.dtype!r}; it must be one of {sorted(ITEM_DTYPES)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def byte_size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEM_DTYPES[self.dtype].itemsize

    @property
    def end(self) -> int:
        return self.offset + self.byte_size

    @property
    def ref(self) -> RegionRef:
        return RegionRef(self.region, self.offset, self.byte_size)

    def reshape(self, shape) -> "TensorRef":
        """The same bytes viewed as `shape` (same element count)."""
        if int(np.prod(shape, dtype=np.int64)) != int(np.prod(self.shape, dtype=np.int64)):
            raise ValueError(f"cannot view a tensor of shape {self.shape} as {tuple(shape)}")
        return TensorRef(self.region, self.offset, tuple(shape), self.dtype)

    def value_dtype(self, what: str) -> int:
        """The wire's ValueDtype of these bytes as `what` (keys or queries); ValueError for
        int32."""
        if self.dtype not in _VALUE_DTYPES:
            raise ValueError(f"{what} refers to {self.dtype} values; keys and queries are bf16 "
                             "or fp32")
        return _VALUE_DTYPES[self.dtype]


@dataclass(frozen=True)
class OutputRefs:
    """Where a selection writes its outputs instead of its answer; each is optional (None: that
    output is answered inline). Each must hold the output's full shape (int32 block_ids
    [n][H][topk], page_table [n][H][topk * pages_per_block], context_lens [n][H]), be 4-byte
    aligned and overlap no other reference of the call; the server checks. page_table and
    context_lens are written only for sequences with attention pages."""

    block_ids: Optional[RegionRef] = None
    page_table: Optional[RegionRef] = None
    context_lens: Optional[RegionRef] = None

    def __post_init__(self):
        for field in OUTPUT_FIELDS:
            ref = getattr(self, field)
            if ref is not None and not isinstance(ref, RegionRef):
                raise TypeError(f"outputs.{field} is a {type(ref).__name__}; give a RegionRef")

    @property
    def end(self) -> int:
        """The offset just past the last of these references, for references into one region (0
        when there is none)."""
        return max((getattr(self, f).end for f in OUTPUT_FIELDS if getattr(self, f)), default=0)

    def to_proto(self):
        out = pb.SelectOutputRefs()
        for field in OUTPUT_FIELDS:
            ref = getattr(self, field)
            if ref is not None:
                getattr(out, field).CopyFrom(ref.to_proto())
        return out
