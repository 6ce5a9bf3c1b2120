"""Selection: one step's answer (SelectBlocksResponse) as numpy arrays of known shapes."""
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from indexer_client.refs import OUTPUT_FIELDS, TensorRef


@dataclass(frozen=True, eq=False)
class Selection:
    """The blocks selected for the query tokens at positions start_position .. + n - 1.

    block_ids:    int32 [n][H][topk], descending score, -1 padded.
    page_table:   int32 [n][H][topk * pages_per_block], only for sequences with attention pages
                  (else None).
    context_lens: int32 [n][H], with page_table (else None).
    lengths:      int64 [layers], the sequence's tokens per layer after any append the step
                  carried.
    written:      the outputs the server wrote to shared-memory regions (the step's outputs=)
                  instead of answering them, by field name, each a TensorRef of the shape
                  written; those fields are None here until read(regions) reads them. Outputs
                  a sequence without attention pages does not produce are not written.
    An append-only batch item has no selection: block_ids is None and num_tokens is 0.
    """

    start_position: int
    lengths: np.ndarray
    block_ids: Optional[np.ndarray]
    page_table: Optional[np.ndarray] = None
    context_lens: Optional[np.ndarray] = None
    pages_per_block: int = 0
    written: Dict[str, TensorRef] = field(default_factory=dict)

    def _dims(self) -> Tuple[int, int, int]:
        if self.block_ids is not None:
            return self.block_ids.shape
        ref = self.written.get("block_ids")
        return (0, 0, 0) if ref is None else ref.shape

    @property
    def num_tokens(self) -> int:
        return self._dims()[0]

    @property
    def num_heads(self) -> int:
        return self._dims()[1]

    @property
    def topk(self) -> int:
        return self._dims()[2]

    @property
    def positions(self) -> np.ndarray:
        """int64 [n]: the query positions answered, one per token."""
        return np.arange(self.start_position, self.start_position + self.num_tokens, dtype=np.int64)

    def read(self, *regions) -> "Selection":
        """This selection with its written outputs copied out of `regions` (SystemRegions, or
        anything with .name and .read(TensorRef)), matched by region name; `written` is then
        empty. Read before the region's bytes are reused. ValueError when an output's region is
        not given."""
        by_name = {region.name: region for region in regions}
        values = {}
        for name, ref in self.written.items():
            if ref.region not in by_name:
                raise ValueError(f"{name} was written to region {ref.region!r}, which is not "
                                 f"among the regions given ({sorted(by_name)})")
            values[name] = by_name[ref.region].read(ref)
        return dataclasses.replace(self, written={}, **values)

    @classmethod
    def from_proto(cls, response, output_refs=None) -> "Selection":
        """Parses a SelectBlocksResponse; ValueError when its byte sizes disagree with its shape.

        output_refs: the request's SelectOutputRefs, whose outputs the answer leaves empty.
        """
        lengths = np.array(response.lengths, dtype=np.int64)
        n, h, k = response.num_tokens, response.num_heads, response.topk
        if n == 0:
            return cls(start_position=0, lengths=lengths, block_ids=None)
        ppb = response.pages_per_block
        shapes = {"block_ids": (n, h, k), "page_table": (n, h, k * ppb), "context_lens": (n, h)}
        refs = {name: getattr(output_refs, name) for name in OUTPUT_FIELDS
                if output_refs is not None and output_refs.HasField(name)}
        # Attention outputs exist only for sequences with attention pages: inline, the answer
        # holds a page table; written, the answer still gives pages_per_block only for them.
        has_pages = bool(response.page_table) or (ppb > 0 and bool(refs))
        values, written = {}, {}
        for name in OUTPUT_FIELDS:
            if name != "block_ids" and not has_pages:
                values[name] = None
            elif name in refs:
                written[name] = TensorRef(refs[name].region, refs[name].offset, shapes[name],
                                          "int32")
                values[name] = None
            else:
                values[name] = int32_array(getattr(response, name), shapes[name], name)
        return cls(start_position=response.start_position, lengths=lengths,
                   pages_per_block=ppb, written=written, **values)


def int32_array(data: bytes, shape, what: str) -> np.ndarray:
    """Little-endian int32 bytes as a writable native-order array of `shape`."""
    want = int(np.prod(shape)) * 4
    if len(data) != want:
        raise ValueError(f"the server's {what} holds {len(data)} bytes; shape {tuple(shape)} "
                         f"needs {want}")
    return np.frombuffer(data, dtype="<i4").astype(np.int32).reshape(shape)
