"""SystemRegion: a POSIX shared memory object on the server's host, for tensors passed by reference.

A SystemRegion is one object (Python's multiprocessing.shared_memory.SharedMemory) together with
the name the caller registers it under on a server:

    with SystemRegion.create("io", 1 << 20) as region:
        client.register_system_region(region.name, region.key, region.byte_size)
        queries = region.write(q, offset=0)                       # a TensorRef
        outputs = region.output_refs(queries.end, n, h, topk)     # an OutputRefs
        selection = client.select_blocks("s1", queries, outputs=outputs).read(region)

Offsets here are offsets of the object, which are the region's when the whole object is
registered (offset 0, as above). POSIX only.

Ownership: the process that creates an object owns its unlink (unlink(), or leaving the `with`
block); unlinking while a server maps it is fine, the server's mapping keeps the memory.
Python's resource tracker would unlink, with a "leaked shared_memory" warning, every object a
process created or attached to when that process exits, which is wrong both for an object the
creator deliberately keeps and for one another process created; so SystemRegion keeps its
objects out of the tracker, and unlinks only when asked.

Not thread-safe: callers that share a region between threads keep their byte ranges apart.
"""
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import numpy as np

from indexer_client.bf16 import from_bf16_bits
from indexer_client.refs import ITEM_DTYPES, OutputRefs, RegionRef, TensorRef
from indexer_client.tensors import wire_values

# SharedMemory(track=False) exists from Python 3.13; before, objects are taken out of the
# tracker by hand after the constructor registered them.
_HAS_TRACK_ARGUMENT = sys.version_info >= (3, 13)
_INT32 = ITEM_DTYPES["int32"].itemsize


def _shm_name(key: str) -> str:
    if not key.startswith("/") or len(key) < 2 or "/" in key[1:]:
        raise ValueError(f"key is {key!r}; a shm_open name is '/' then 1 or more characters "
                         "without '/'")
    return key[1:]


def _open_untracked(name: Optional[str], create: bool, size: int) -> shared_memory.SharedMemory:
    if _HAS_TRACK_ARGUMENT:
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    shm = shared_memory.SharedMemory(name, create=create, size=size)
    resource_tracker.unregister("/" + shm.name, "shared_memory")
    return shm


def _unlink_untracked(shm: shared_memory.SharedMemory) -> None:
    if _HAS_TRACK_ARGUMENT:
        shm.unlink()
        return
    # unlink() unregisters the object from the tracker, which must then know it.
    key = "/" + shm.name
    resource_tracker.register(key, "shared_memory")
    try:
        shm.unlink()
    except BaseException:
        resource_tracker.unregister(key, "shared_memory")
        raise


class SystemRegion:
    """A shared memory object mapped read-write into this process, and `name`, the caller's
    name for it on servers (the name refs made here carry).

    key: the object's shm_open name, "/" + the SharedMemory's name (RegisterSystemRegion's key).
    byte_size: the object's size. owner: whether this process created it (and so unlinks it
    when leaving a `with` block).
    """

    def __init__(self, name: str, shm: shared_memory.SharedMemory, owner: bool):
        self.name = name
        self._shm = shm
        self.owner = owner
        self._unlinked = False

    @classmethod
    def create(cls, name: str, byte_size: int, key: Optional[str] = None) -> "SystemRegion":
        """A new zero-filled object of byte_size bytes named `key` ("/..."; None: a fresh unique
        name). FileExistsError when `key` exists."""
        shm_name = None if key is None else _shm_name(key)
        return cls(name, _open_untracked(shm_name, True, byte_size), owner=True)

    @classmethod
    def attach(cls, name: str, key: str) -> "SystemRegion":
        """Maps the existing object `key`, which another process created and will unlink.
        FileNotFoundError when there is none."""
        return cls(name, _open_untracked(_shm_name(key), False, 0), owner=False)

    @property
    def key(self) -> str:
        return "/" + self._shm.name

    @property
    def byte_size(self) -> int:
        return self._shm.size

    def array(self, shape, dtype, offset: int = 0) -> np.ndarray:
        """A numpy view of the bytes at `offset` as `shape` and `dtype` (writes go to the shared
        memory). close() fails while such views are alive."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in np.atleast_1d(shape))
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._check_range(offset, size)
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def ref(self, offset: int, byte_size: int) -> RegionRef:
        """A reference to byte_size bytes at `offset`; ValueError past the object's end."""
        self._check_range(offset, byte_size)
        return RegionRef(self.name, offset, byte_size)

    def write(self, tensor, offset: int = 0, dtype: str = "bf16") -> TensorRef:
        """Stores `tensor` (what keys= and queries= take: numpy arrays, torch tensors, ...) at
        `offset` as little-endian bf16 (rounded to nearest even; torch bf16 as its own bits) or
        fp32, row-major; returns the TensorRef to pass instead of the tensor."""
        if dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype is {dtype!r}; tensors are stored as 'bf16' or 'fp32'")
        values = wire_values(tensor, "tensor")
        self.array(values.shape, ITEM_DTYPES[dtype], offset)[...] = values.packed(dtype)
        return TensorRef(self.name, offset, values.shape, dtype)

    def read(self, ref: TensorRef) -> np.ndarray:
        """A copy of the tensor `ref` names: int32 as int32, bf16 and fp32 as float32."""
        if ref.region != self.name:
            raise ValueError(f"the reference names region {ref.region!r}; this is {self.name!r}")
        view = self.array(ref.shape, ITEM_DTYPES[ref.dtype], ref.offset)
        if ref.dtype == "bf16":
            return from_bf16_bits(view).reshape(ref.shape)
        return view.astype(np.float32 if ref.dtype == "fp32" else np.int32)

    def output_refs(self, offset: int, num_tokens: int, num_heads: int, topk: int,
                    pages_per_block: int = 0) -> OutputRefs:
        """OutputRefs for a selection of num_tokens x num_heads x topk, laid out from `offset`
        (4-byte aligned): block_ids, then, when pages_per_block > 0 (the server's, for sequences
        with attention pages), page_table and context_lens."""
        if offset % _INT32:
            raise ValueError(f"offset {offset} is not 4-byte aligned; outputs are int32")
        rows = num_tokens * num_heads
        block_ids = self.ref(offset, rows * topk * _INT32)
        if pages_per_block <= 0:
            return OutputRefs(block_ids=block_ids)
        page_table = self.ref(block_ids.end, rows * topk * pages_per_block * _INT32)
        return OutputRefs(block_ids, page_table, self.ref(page_table.end, rows * _INT32))

    def close(self) -> None:
        """Unmaps the object from this process (the object itself stays until unlinked)."""
        self._shm.close()

    def unlink(self) -> None:
        """Removes the object's name; processes (and servers) that map it keep the memory."""
        _unlink_untracked(self._shm)
        self._unlinked = True

    def __enter__(self) -> "SystemRegion":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self.owner and not self._unlinked:
                self.unlink()

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise ValueError(f"{size} bytes at offset {offset} do not fit region {self.name!r} "
                             f"of {self.byte_size} bytes")
