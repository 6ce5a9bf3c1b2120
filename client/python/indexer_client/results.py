"""Typed answers of the calls other than selections (those are Selection, selection.py).

Each dataclass has the fields of its response message (proto/indexer/v1/indexer.proto), with
repeated integers as numpy arrays: lengths are int64 [layers], page ids int32 [blocks].
"""
from dataclasses import dataclass, fields

import numpy as np

_KEY_STORAGE = {0: "unspecified", 1: "bf16", 2: "fp8_e4m3", 3: "fp4_e2m1"}


def _lengths(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _ids(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class AppendResult:
    """AppendKeys: tokens per layer after the append, the blocks held, whether it created the
    sequence."""

    lengths: np.ndarray
    num_blocks: int
    created: bool

    @classmethod
    def from_proto(cls, r) -> "AppendResult":
        return cls(_lengths(r.lengths), r.num_blocks, r.created)


@dataclass(frozen=True)
class ReleaseResult:
    """ReleaseSequence: pages returned to the pool (pages still shared with forks stay)."""

    pages_freed: int

    @classmethod
    def from_proto(cls, r) -> "ReleaseResult":
        return cls(r.pages_freed)


@dataclass(frozen=True, eq=False)
class TruncateResult:
    """TruncateSequence: lengths and blocks after the cut, and the pages it freed."""

    lengths: np.ndarray
    num_blocks: int
    pages_freed: int

    @classmethod
    def from_proto(cls, r) -> "TruncateResult":
        return cls(_lengths(r.lengths), r.num_blocks, r.pages_freed)


@dataclass(frozen=True, eq=False)
class ForkResult:
    """ForkSequence: the fork's lengths and blocks, and how many pages it shares with its
    source."""

    lengths: np.ndarray
    num_blocks: int
    pages_shared: int

    @classmethod
    def from_proto(cls, r) -> "ForkResult":
        return cls(_lengths(r.lengths), r.num_blocks, r.pages_shared)


@dataclass(frozen=True, eq=False)
class SequenceInfo:
    """GetSequence: lengths, cache page per block, attention page per block (empty when the
    sequence has none), pages shared with other sequences."""

    sequence_id: str
    lengths: np.ndarray
    pages: np.ndarray
    attention_pages: np.ndarray
    shared_pages: int

    @classmethod
    def from_proto(cls, r) -> "SequenceInfo":
        return cls(r.sequence_id, _lengths(r.lengths), _ids(r.pages), _ids(r.attention_pages),
                   r.shared_pages)


@dataclass(frozen=True)
class ServerInfo:
    """ServerInfo: the server's configuration, defaults, limits, capacity and use (pages), and
    the caller's tenant (its pages and sequences, with their limits; 0: none). key_storage is
    "bf16", "fp8_e4m3" or "fp4_e2m1". max_regions: the shared-memory regions a tenant may
    register at once (0: the server takes none)."""

    version: str
    backend: str
    device: str
    head_dim: int
    layers: int
    key_storage: str
    block_size: int
    max_index_heads: int
    max_topk: int
    default_topk: int
    default_init_blocks: int
    default_local_blocks: int
    pages_per_block: int
    block_page_stride: int
    total_pages: int
    free_pages: int
    bytes_per_page: int
    live_sequences: int
    max_tokens_per_sequence: int
    max_message_bytes: int
    tenant: str
    tenant_pages: int
    tenant_page_quota: int
    max_sequences: int
    max_query_tokens: int
    max_batch_items: int
    tenant_sequences: int
    tenant_max_sequences: int
    max_regions: int

    @classmethod
    def from_proto(cls, r) -> "ServerInfo":
        values = {f.name: getattr(r, f.name) for f in fields(cls)}
        values["key_storage"] = _KEY_STORAGE.get(r.key_storage, str(r.key_storage))
        return cls(**values)


@dataclass(frozen=True)
class RegionStatus:
    """ListRegions: one of the caller's registered regions, `byte_size` bytes at `offset` of the
    object `key` (kind "system": POSIX shared memory) or of a CUDA allocation on GPU device_id
    (kind "cuda"). pinned: a system region a CUDA server's GPUs read and write in place."""

    name: str
    kind: str
    key: str
    offset: int
    byte_size: int
    device_id: int = 0
    pinned: bool = False

    @classmethod
    def from_proto(cls, r) -> "RegionStatus":
        return cls(r.name, r.kind, r.key, r.offset, r.byte_size, r.device_id, r.pinned)


@dataclass(frozen=True)
class SnapshotResult:
    """IndexerAdmin.Snapshot: the file written (as the server sees it), its size, the sequences
    and distinct pages it holds, and the seconds it took."""

    path: str
    bytes: int
    sequences: int
    pages: int
    seconds: float

    @classmethod
    def from_proto(cls, r) -> "SnapshotResult":
        return cls(r.path, r.bytes, r.sequences, r.pages, r.seconds)
