"""Selection: one step's answer (SelectBlocksResponse) as numpy arrays."""
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Selection:
    """The blocks selected for the query tokens at positions start_position .. + n - 1.

    block_ids:    int32 [n][H][topk], descending score, -1 padded.
    page_table:   int32 [n][H][topk * pages_per_block], only for sequences with attention pages.
    context_lens: int32 [n][H], with page_table.
    lengths:      the sequence's tokens per layer after any append the step carried.
    An append-only batch item has no selection: block_ids is None and n is 0.
    """

    start_position: int
    lengths: tuple
    block_ids: Optional[np.ndarray]
    page_table: Optional[np.ndarray] = None
    context_lens: Optional[np.ndarray] = None
    pages_per_block: int = 0

    @property
    def num_tokens(self) -> int:
        return 0 if self.block_ids is None else self.block_ids.shape[0]

    @property
    def positions(self) -> np.ndarray:
        """The query positions answered, one per token."""
        return np.arange(self.start_position, self.start_position + self.num_tokens)

    @classmethod
    def from_proto(cls, response) -> "Selection":
        """Parses a SelectBlocksResponse."""
        lengths = tuple(response.lengths)
        n, h, k = response.num_tokens, response.num_heads, response.topk
        if n == 0:
            return cls(start_position=0, lengths=lengths, block_ids=None)
        page_table = context_lens = None
        if response.page_table:
            ppb = response.pages_per_block
            page_table = _int32s(response.page_table, (n, h, k * ppb))
            context_lens = _int32s(response.context_lens, (n, h))
        return cls(start_position=response.start_position, lengths=lengths,
                   block_ids=_int32s(response.block_ids, (n, h, k)), page_table=page_table,
                   context_lens=context_lens, pages_per_block=response.pages_per_block)


def _int32s(data: bytes, shape) -> np.ndarray:
    # Little-endian on the wire; astype gives a writable native-order copy.
    return np.frombuffer(data, dtype="<i4").astype(np.int32).reshape(shape)
