"""Requests built from tensors, with their shapes checked before anything is sent.

Tensors travel as raw bytes, so a server can only count the tokens a request carries from its
byte size: keys of the wrong head_dim would be read as a different number of tokens. So every
request built here carries num_tokens (the server compares it with the byte size), and, given
the server's Shapes, the arrays are checked against its head_dim (and layers, for all-layer
appends) first: a mismatch raises ValueError saying what is wrong, and nothing is sent.
"""
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from indexer_client._stubs import pb
from indexer_client.errors import IndexerError
from indexer_client.selection import Selection
from indexer_client.tensors import WireValues, wire_values


@dataclass(frozen=True)
class Shapes:
    """What a server's tensors look like, from its ServerInfo; `target` names it in errors."""

    head_dim: int
    layers: int
    target: str = ""

    def where(self) -> str:
        return f"the server at {self.target}" if self.target else "the server"


def _pack(values: WireValues, wire_dtype: str) -> Tuple[int, bytes]:
    if wire_dtype == "bf16":
        return pb.VALUE_DTYPE_BF16, values.bf16_bytes()
    if wire_dtype == "fp32":
        return pb.VALUE_DTYPE_FP32, values.fp32_bytes()
    raise ValueError(f"wire_dtype is {wire_dtype!r}; it must be 'bf16' or 'fp32'")


def _checked_keys(keys, all_layers: Optional[bool],
                  shapes: Optional[Shapes]) -> Tuple[WireValues, bool]:
    values = wire_values(keys, "keys")
    if all_layers is None:
        all_layers = values.ndim == 3
    if not all_layers and values.ndim == 1:  # one token's key
        values = values.reshape((1,) + values.shape)
    layout = "[n][layers][head_dim]" if all_layers else "[n][head_dim]"
    kind = "an all-layer append" if all_layers else "a one-layer append"
    if values.ndim != (3 if all_layers else 2):
        raise ValueError(f"keys has shape {values.shape}; {kind} takes {layout}")
    if values.shape[0] == 0:
        raise ValueError(f"keys has shape {values.shape}: an append needs at least one token")
    if shapes is None:
        return values, all_layers
    if values.shape[-1] != shapes.head_dim:
        raise ValueError(f"keys has shape {values.shape} ({layout}) but {shapes.where()} has "
                         f"head_dim {shapes.head_dim}: the last dimension must be "
                         f"{shapes.head_dim}")
    if all_layers and values.shape[1] != shapes.layers:
        raise ValueError(f"keys has shape {values.shape} ({layout}) but {shapes.where()} has "
                         f"{shapes.layers} layers: {kind} takes "
                         f"[n][{shapes.layers}][{shapes.head_dim}]")
    return values, all_layers


def _checked_queries(queries, shapes: Optional[Shapes]) -> WireValues:
    values = wire_values(queries, "queries")
    if values.ndim == 2:  # one token's queries, [H][head_dim]
        values = values.reshape((1,) + values.shape)
    if values.ndim != 3:
        raise ValueError(f"queries has shape {values.shape}; it must be [n][H][head_dim] "
                         "(or [H][head_dim] for one token)")
    if values.shape[0] == 0 or values.shape[1] == 0:
        raise ValueError(f"queries has shape {values.shape}: a selection needs at least one "
                         "token and one head")
    if shapes is not None and values.shape[2] != shapes.head_dim:
        raise ValueError(f"queries has shape {values.shape} ([n][H][head_dim]) but "
                         f"{shapes.where()} has head_dim {shapes.head_dim}: the last dimension "
                         f"must be {shapes.head_dim}")
    return values


def append_request(sequence_id: str, keys, layer: int = 0, all_layers: Optional[bool] = None,
                   attention_pages: Sequence[int] = (), wire_dtype: str = "bf16",
                   shapes: Optional[Shapes] = None):
    """Builds an AppendKeysRequest, num_tokens set.

    keys: [n][head_dim] (or [head_dim] for one token) for one layer, or [n][layers][head_dim]
    for every layer (all_layers defaults to keys.ndim == 3). attention_pages: one id per block
    this append opens, for sequences with attention pages. With `shapes`, keys are checked
    against the server's head_dim and layers (ValueError).
    """
    values, all_layers = _checked_keys(keys, all_layers, shapes)
    dtype, data = _pack(values, wire_dtype)
    return pb.AppendKeysRequest(sequence_id=sequence_id, layer=layer, all_layers=all_layers,
                                dtype=dtype, keys=data, attention_pages=list(attention_pages),
                                num_tokens=values.shape[0])


@dataclass
class Step:
    """One Batch item: append `keys` (optional), then select for `queries` (optional).

    queries: [n][H][head_dim], or [H][head_dim] for one token. keys: as in append_request; they
    go to `layer` unless append_layer says otherwise (or they hold all layers). Both may be
    numpy arrays or torch tensors (tensors.py). start_position defaults to length - n (the span
    ends at the last appended token); topk, init_blocks and local_blocks default to the server's.
    """

    sequence_id: str
    queries: Optional[object] = None
    keys: Optional[object] = None
    layer: int = 0
    append_layer: Optional[int] = None
    all_layers: Optional[bool] = None
    attention_pages: Sequence[int] = ()
    start_position: Optional[int] = None
    topk: Optional[int] = None
    init_blocks: Optional[int] = None
    local_blocks: Optional[int] = None
    wire_dtype: str = "bf16"

    def to_proto(self, shapes: Optional[Shapes] = None):
        """The SelectBlocksRequest for this step (num_tokens set on it and on its append);
        with `shapes`, checked against the server's (ValueError)."""
        r = pb.SelectBlocksRequest(sequence_id=self.sequence_id, layer=self.layer)
        if self.keys is not None:
            layer = self.layer if self.append_layer is None else self.append_layer
            r.append.CopyFrom(append_request("", self.keys, layer, self.all_layers,
                                             self.attention_pages, self.wire_dtype, shapes))
        if self.queries is not None:
            q = _checked_queries(self.queries, shapes)
            r.num_tokens, r.num_heads = q.shape[0], q.shape[1]
            r.query_dtype, r.queries = _pack(q, self.wire_dtype)
        for field in ("start_position", "topk", "init_blocks", "local_blocks"):
            if getattr(self, field) is not None:
                setattr(r, field, getattr(self, field))
        return r


def batch_request(steps: Iterable[Step], request_id: int, shapes: Optional[Shapes]):
    """A BatchRequest of `steps`; a step whose shapes are wrong raises ValueError naming it."""
    items = []
    for i, step in enumerate(steps):
        try:
            items.append(step.to_proto(shapes))
        except ValueError as e:
            raise ValueError(f"step {i} ({step.sequence_id!r}): {e}") from None
    return pb.BatchRequest(request_id=request_id, items=items)


def batch_results(response, return_exceptions: bool) -> List:
    """One Selection per item of a BatchResponse; a failed item raises its IndexerError (with
    .index), or with return_exceptions stands in its place."""
    results = []
    for i, item in enumerate(response.results):
        if item.code == 0:
            results.append(Selection.from_proto(item.result))
            continue
        error = IndexerError.from_item(item.code, item.message, i)
        if not return_exceptions:
            raise error
        results.append(error)
    return results
