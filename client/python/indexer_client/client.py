"""IndexerClient: a blocking Python client for the indexer gRPC API (proto/indexer/v1).

One method per RPC. Tensors go in as numpy arrays (sent as bf16 unless asked for fp32) and
selections come back as Selection objects holding numpy arrays. Failed calls raise IndexerError
with the gRPC status code and the server's message. A client may be shared by threads; a
BatchStream belongs to one thread at a time.
"""
import queue
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import grpc
import numpy as np

from indexer_client._stubs import health_modules, pb, pb_grpc
from indexer_client.bf16 import to_bf16_bytes
from indexer_client.selection import Selection

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class IndexerError(Exception):
    """A failed call or batch item: `code` is a grpc.StatusCode, `message` the server's text.

    `index` is the item's position for a failed Batch / BatchStream item, else None.
    """

    def __init__(self, code: grpc.StatusCode, message: str, index: Optional[int] = None):
        where = "" if index is None else f"item {index}: "
        super().__init__(f"{where}{code.name}: {message}")
        self.code = code
        self.message = message
        self.index = index

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "IndexerError":
        return cls(error.code(), error.details() or "")


def _pack(values, wire_dtype: str):
    if wire_dtype == "bf16":
        return pb.VALUE_DTYPE_BF16, to_bf16_bytes(values)
    if wire_dtype == "fp32":
        return pb.VALUE_DTYPE_FP32, np.ascontiguousarray(values, dtype="<f4").tobytes()
    raise ValueError(f"wire_dtype is {wire_dtype!r}; it must be 'bf16' or 'fp32'")


def append_request(sequence_id: str, keys, layer: int = 0, all_layers: Optional[bool] = None,
                   attention_pages: Sequence[int] = (), wire_dtype: str = "bf16"):
    """Builds an AppendKeysRequest.

    keys: [n][head_dim] for one layer, or [n][layers][head_dim] for every layer (all_layers
    defaults to keys.ndim == 3). attention_pages: one id per block this append opens, for
    sequences with attention pages.
    """
    keys = np.asarray(keys)
    if all_layers is None:
        all_layers = keys.ndim == 3
    dtype, data = _pack(keys, wire_dtype)
    return pb.AppendKeysRequest(sequence_id=sequence_id, layer=layer, all_layers=all_layers,
                                dtype=dtype, keys=data, attention_pages=list(attention_pages))


@dataclass
class Step:
    """One Batch item: append `keys` (optional), then select for `queries` (optional).

    queries: [n][H][head_dim], or [H][head_dim] for one token. keys: as in append_request; they
    go to `layer` unless append_layer says otherwise (or they hold all layers). start_position
    defaults to length - n (the span ends at the last appended token); topk, init_blocks and
    local_blocks default to the server's.
    """

    sequence_id: str
    queries: Optional[np.ndarray] = None
    keys: Optional[np.ndarray] = None
    layer: int = 0
    append_layer: Optional[int] = None
    all_layers: Optional[bool] = None
    attention_pages: Sequence[int] = ()
    start_position: Optional[int] = None
    topk: Optional[int] = None
    init_blocks: Optional[int] = None
    local_blocks: Optional[int] = None
    wire_dtype: str = "bf16"

    def to_proto(self):
        """The SelectBlocksRequest for this step."""
        r = pb.SelectBlocksRequest(sequence_id=self.sequence_id, layer=self.layer)
        if self.keys is not None:
            layer = self.layer if self.append_layer is None else self.append_layer
            r.append.CopyFrom(append_request("", self.keys, layer, self.all_layers,
                                             self.attention_pages, self.wire_dtype))
        if self.queries is not None:
            q = np.asarray(self.queries)
            if q.ndim == 2:
                q = q[None]
            if q.ndim != 3:
                raise ValueError(f"queries has shape {q.shape}; it must be [n][H][head_dim]")
            r.num_heads = q.shape[1]
            r.query_dtype, r.queries = _pack(q, self.wire_dtype)
        for field in ("start_position", "topk", "init_blocks", "local_blocks"):
            if getattr(self, field) is not None:
                setattr(r, field, getattr(self, field))
        return r


def _batch_results(response, return_exceptions: bool) -> list:
    results = []
    for i, item in enumerate(response.results):
        if item.code == 0:
            results.append(Selection.from_proto(item.result))
            continue
        error = IndexerError(_CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.message, i)
        if not return_exceptions:
            raise error
        results.append(error)
    return results


class BatchStream:
    """One open BatchStream call: each step() sends one BatchRequest and waits for its answer.

    Use as a context manager, or call close(). Not for concurrent use by several threads.
    """

    _CLOSE = object()

    def __init__(self, stub, metadata=None):
        self._requests = queue.Queue()
        self._next_id = 1
        self._responses = stub.BatchStream(iter(self._requests.get, self._CLOSE), metadata=metadata)

    def step(self, steps: Iterable[Step], return_exceptions: bool = False) -> list:
        """Like IndexerClient.batch, over the open stream."""
        request_id = self._next_id
        self._next_id += 1
        self._requests.put(pb.BatchRequest(request_id=request_id,
                                           items=[s.to_proto() for s in steps]))
        try:
            response = next(self._responses)
        except grpc.RpcError as e:
            raise IndexerError.from_rpc(e) from None
        except StopIteration:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE, "the server ended the stream") from None
        if response.request_id != request_id:
            raise IndexerError(grpc.StatusCode.INTERNAL, f"answer {response.request_id} came for "
                               f"request {request_id}")
        return _batch_results(response, return_exceptions)

    def close(self) -> None:
        """Ends the stream: the server finishes it once it has answered every request.

        Never raises: a stream that already failed (say, the server shut down) reported that
        from step().
        """
        self._requests.put(self._CLOSE)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class IndexerClient:
    """A client of one indexer server at `target` ("host:port").

    timeout: seconds each unary call may take (its gRPC deadline); None for no deadline.
    max_message_bytes: largest message sent or received (the server's default is 64 MiB).
    Security (docs/SECURITY.md), all keyword-only:
      tls: connect with TLS (implied by any of the PEM arguments).
      root_certificates: PEM bytes of the CA that signed the server's certificate (None: gRPC's
        default roots).
      certificate_chain, private_key: PEM bytes of this client's certificate and key, for servers
        that require mutual TLS.
      server_name: the name to check the server's certificate against, when not the target host.
      token: bearer token sent with every call as "authorization: Bearer <token>".
    Results: select_blocks/batch return Selection objects; the other calls return the response
    message of their RPC (see proto/indexer/v1/indexer.proto).
    """

    def __init__(self, target: str, timeout: Optional[float] = 30.0,
                 max_message_bytes: int = 64 << 20, *, tls: bool = False,
                 root_certificates: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 server_name: Optional[str] = None, token: Optional[str] = None):
        self.target = target
        self.timeout = timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls or root_certificates or certificate_chain or private_key:
            if (certificate_chain is None) != (private_key is None):
                raise ValueError("certificate_chain and private_key go together: give both or neither")
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        # Plain metadata rather than call credentials, which gRPC sends over TLS only: a token
        # must also work over loopback or behind a TLS-terminating proxy.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.IndexerStub(self._channel)
        self._admin_stub = pb_grpc.IndexerAdminStub(self._channel)

    def _call(self, method, request):
        # `x-sequence-id` lets a proxy route every call of a sequence to the server holding it
        # (docs/DEPLOY.md); only for calls about one sequence, and only printable ids.
        metadata = self._metadata
        key = getattr(request, "sequence_id", "") or getattr(request, "source_id", "")
        if not key and getattr(request, "items", None):
            ids = {item.sequence_id for item in request.items}
            key = ids.pop() if len(ids) == 1 else ""
        if key and key.isascii() and key.isprintable():
            metadata = (metadata or ()) + (("x-sequence-id", key),)
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise IndexerError.from_rpc(e) from None

    def append_keys(self, sequence_id: str, keys, layer: int = 0,
                    all_layers: Optional[bool] = None, attention_pages: Sequence[int] = (),
                    wire_dtype: str = "bf16"):
        """Appends keys ([n][head_dim], or [n][layers][head_dim] for every layer), creating the
        sequence on its first append. Returns AppendKeysResponse (lengths, num_blocks, created)."""
        return self._call(self._stub.AppendKeys, append_request(
            sequence_id, keys, layer, all_layers, attention_pages, wire_dtype))

    def select_blocks(self, sequence_id: str, queries, **step) -> Selection:
        """Selects blocks for queries [n][H][head_dim] (or [H][head_dim]) of one sequence.

        Keyword arguments are Step's: layer, keys (appended first, atomically),
        attention_pages, start_position, topk, init_blocks, local_blocks, wire_dtype.
        """
        request = Step(sequence_id, queries=queries, **step).to_proto()
        return Selection.from_proto(self._call(self._stub.SelectBlocks, request))

    def batch(self, steps: Iterable[Step], request_id: int = 0,
              return_exceptions: bool = False) -> list:
        """Runs many steps in one Batch call; returns one Selection per step, in order.

        A failed item raises its IndexerError (with .index); with return_exceptions=True it is
        returned in the item's place instead, and the other items' results are kept.
        """
        request = pb.BatchRequest(request_id=request_id, items=[s.to_proto() for s in steps])
        return _batch_results(self._call(self._stub.Batch, request), return_exceptions)

    def open_stream(self) -> BatchStream:
        """Opens a BatchStream: one long-lived call for a scheduler's every step."""
        return BatchStream(self._stub, self._metadata)

    def release(self, sequence_id: str):
        """Releases a sequence. Returns ReleaseSequenceResponse (pages_freed)."""
        return self._call(self._stub.ReleaseSequence,
                          pb.ReleaseSequenceRequest(sequence_id=sequence_id))

    def truncate(self, sequence_id: str, length: int):
        """Shortens every layer to at most `length` tokens. Returns TruncateSequenceResponse."""
        return self._call(self._stub.TruncateSequence,
                          pb.TruncateSequenceRequest(sequence_id=sequence_id, length=length))

    def fork(self, source_id: str, target_id: str, length: Optional[int] = None):
        """Copies a sequence (its first `length` tokens), sharing full pages. Returns
        ForkSequenceResponse."""
        request = pb.ForkSequenceRequest(source_id=source_id, target_id=target_id)
        if length is not None:
            request.length = length
        return self._call(self._stub.ForkSequence, request)

    def get_sequence(self, sequence_id: str):
        """Returns GetSequenceResponse (lengths, pages, attention_pages, shared_pages)."""
        return self._call(self._stub.GetSequence, pb.GetSequenceRequest(sequence_id=sequence_id))

    def server_info(self):
        """Returns ServerInfoResponse: configuration, defaults, capacity and use."""
        return self._call(self._stub.ServerInfo, pb.ServerInfoRequest())

    def get_stats(self) -> dict:
        """The server's metrics (GetStats): {family name: [(labels dict, value or
        (count, sum)), ...]}; histograms give (count, sum)."""
        response = self._call(self._stub.GetStats, pb.GetStatsRequest())
        out = {}
        for f in response.families:
            rows = out.setdefault(f.name, [])
            for m in f.metrics:
                value = (m.count, m.sum) if f.type == "histogram" else m.value
                rows.append((dict(m.labels), value))
        return out

    def snapshot(self, name: str = ""):
        """IndexerAdmin.Snapshot: writes every sequence to a snapshot file `name` ("" = a
        timestamped name) in the server's --snapshot_dir. Needs an admin token when the server
        checks tokens. Returns SnapshotResponse (path, bytes, sequences, pages, seconds)."""
        return self._call(self._admin_stub.Snapshot, pb.SnapshotRequest(name=name))

    def health(self, service: str = "") -> str:
        """The standard gRPC health status: "SERVING", "NOT_SERVING", ..."""
        health_pb2, health_pb2_grpc = health_modules()
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout: float = 10.0) -> None:
        """Waits for the channel to connect and health to be SERVING, else raises IndexerError."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s") from None
        status = self.health()
        if status != "SERVING":
            raise IndexerError(grpc.StatusCode.UNAVAILABLE, f"{self.target} is {status}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
