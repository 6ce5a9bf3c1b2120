"""Selection: one step's answer (SelectBlocksResponse) as numpy arrays of known shapes."""
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True, eq=False)
class Selection:
    """The blocks selected for the query tokens at positions start_position .. + n - 1.

    block_ids:    int32 [n][H][topk], descending score, -1 padded.
    page_table:   int32 [n][H][topk * pages_per_block], only for sequences with attention pages
                  (else None).
    context_lens: int32 [n][H], with page_table (else None).
    lengths:      int64 [layers], the sequence's tokens per layer after any append the step
                  carried.
    An append-only batch item has no selection: block_ids is None and num_tokens is 0.
    """

    start_position: int
    lengths: np.ndarray
    block_ids: Optional[np.ndarray]
    page_table: Optional[np.ndarray] = None
    context_lens: Optional[np.ndarray] = None
    pages_per_block: int = 0

    @property
    def num_tokens(self) -> int:
        return 0 if self.block_ids is None else self.block_ids.shape[0]

    @property
    def num_heads(self) -> int:
        return 0 if self.block_ids is None else self.block_ids.shape[1]

    @property
    def topk(self) -> int:
        return 0 if self.block_ids is None else self.block_ids.shape[2]

    @property
    def positions(self) -> np.ndarray:
        """int64 [n]: the query positions answered, one per token."""
        return np.arange(self.start_position, self.start_position + self.num_tokens, dtype=np.int64)

    @classmethod
    def from_proto(cls, response) -> "Selection":
        """Parses a SelectBlocksResponse; ValueError when its byte sizes disagree with its shape."""
        lengths = np.array(response.lengths, dtype=np.int64)
        n, h, k = response.num_tokens, response.num_heads, response.topk
        if n == 0:
            return cls(start_position=0, lengths=lengths, block_ids=None)
        page_table = context_lens = None
        if response.page_table:
            ppb = response.pages_per_block
            page_table = int32_array(response.page_table, (n, h, k * ppb), "page_table")
            context_lens = int32_array(response.context_lens, (n, h), "context_lens")
        return cls(start_position=response.start_position, lengths=lengths,
                   block_ids=int32_array(response.block_ids, (n, h, k), "block_ids"),
                   page_table=page_table, context_lens=context_lens,
                   pages_per_block=response.pages_per_block)


def int32_array(data: bytes, shape, what: str) -> np.ndarray:
    """Little-endian int32 bytes as a writable native-order array of `shape`."""
    want = int(np.prod(shape)) * 4
    if len(data) != want:
        raise ValueError(f"the server's {what} holds {len(data)} bytes; shape {tuple(shape)} "
                         f"needs {want}")
    return np.frombuffer(data, dtype="<i4").astype(np.int32).reshape(shape)
