"""Requests built from tensors, with their shapes checked before anything is sent.

Tensors travel as raw bytes, so a server can only count the tokens a request carries from its
byte size: keys of the wrong head_dim would be read as a different number of tokens. So every
request built here carries num_tokens (the server compares it with the byte size), and, given
the server's Shapes, the arrays are checked against its head_dim (and layers, for all-layer
appends) first: a mismatch raises ValueError saying what is wrong, and nothing is sent.

Keys and queries may also be TensorRefs (refs.py): tensors already in a registered region,
checked by their shape exactly as arrays are and sent as keys_ref / queries_ref, with num_tokens
from their shape. A step's outputs may go to regions too (Step.outputs).
"""
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from indexer_client._stubs import pb
from indexer_client.errors import IndexerError
from indexer_client.refs import OutputRefs, TensorRef
from indexer_client.selection import Selection
from indexer_client.tensors import WireValues, wire_values

# What the shape checks see: an array's values, or a reference's shape.
Tensor = Union[WireValues, TensorRef]


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


def _set_tensor(request, field: str, dtype_field: str, values: Tensor, wire_dtype: str) -> None:
    """Puts `values` into request.<field> as bytes, or a TensorRef into <field>_ref, with its
    dtype."""
    if isinstance(values, TensorRef):
        setattr(request, dtype_field, values.value_dtype(field))
        getattr(request, field + "_ref").CopyFrom(values.ref.to_proto())
        return
    dtype, data = _pack(values, wire_dtype)
    setattr(request, dtype_field, dtype)
    setattr(request, field, data)


def _tensor(tensor, what: str) -> Tensor:
    if isinstance(tensor, TensorRef):
        tensor.value_dtype(what)  # ValueError for int32 references
        return tensor
    return wire_values(tensor, what)


def _checked_keys(keys, all_layers: Optional[bool],
                  shapes: Optional[Shapes]) -> Tuple[Tensor, bool]:
    values = _tensor(keys, "keys")
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


def _checked_queries(queries, shapes: Optional[Shapes]) -> Tensor:
    values = _tensor(queries, "queries")
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
    for every layer (all_layers defaults to keys.ndim == 3), as an array or a TensorRef.
    attention_pages: one id per block this append opens, for sequences with attention pages.
    With `shapes`, keys are checked against the server's head_dim and layers (ValueError).
    """
    values, all_layers = _checked_keys(keys, all_layers, shapes)
    request = pb.AppendKeysRequest(sequence_id=sequence_id, layer=layer, all_layers=all_layers,
                                   attention_pages=list(attention_pages),
                                   num_tokens=values.shape[0])
    _set_tensor(request, "keys", "dtype", values, wire_dtype)
    return request


@dataclass
class Step:
    """One Batch item: append `keys` (optional), then select for `queries` (optional).

    queries: [n][H][head_dim], or [H][head_dim] for one token. keys: as in append_request; they
    go to `layer` unless append_layer says otherwise (or they hold all layers). Both may be
    numpy arrays or torch tensors (tensors.py), or TensorRefs into registered regions (refs.py;
    wire_dtype converts arrays only). start_position defaults to length - n (the span ends at
    the last appended token); topk, init_blocks and local_blocks default to the server's.
    outputs: OutputRefs naming where the selection's outputs are written instead of answered;
    the Selection then says which were written (Selection.written, Selection.read).
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
    outputs: Optional[OutputRefs] = None

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
            _set_tensor(r, "queries", "query_dtype", q, self.wire_dtype)
        if self.outputs is not None:
            if self.queries is None:
                raise ValueError("outputs are given but no queries: a step without queries "
                                 "selects nothing")
            r.output_refs.CopyFrom(self.outputs.to_proto())
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


def output_refs(request) -> Optional[object]:
    """The SelectOutputRefs of a SelectBlocksRequest, or None when it has none."""
    return request.output_refs if request.HasField("output_refs") else None


def batch_outputs(request) -> List[Optional[object]]:
    """output_refs of each item of a BatchRequest, for batch_results."""
    return [output_refs(item) for item in request.items]


def batch_results(response, return_exceptions: bool, outputs: Sequence = ()) -> List:
    """One Selection per item of a BatchResponse; a failed item raises its IndexerError (with
    .index), or with return_exceptions stands in its place. outputs: batch_outputs() of the
    request, so that each Selection says which of its outputs went to regions."""
    results = []
    for i, item in enumerate(response.results):
        if item.code == 0:
            refs = outputs[i] if i < len(outputs) else None
            results.append(Selection.from_proto(item.result, refs))
            continue
        error = IndexerError.from_item(item.code, item.message, i)
        if not return_exceptions:
            raise error
        results.append(error)
    return results
