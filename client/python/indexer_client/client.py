"""IndexerClient: the blocking Python client of the indexer gRPC API (proto/indexer/v1).

One method per RPC, each with a per-call `timeout=`. Tensors go in as numpy arrays or torch
tensors (sent as bf16 unless asked for fp32; tensors.py); answers come back as dataclasses
holding numpy arrays (Selection, AppendResult, ServerInfo, ...). Before a request with tensors
is sent, their shapes are checked against the server's head_dim and layers (learned from
ServerInfo on first use): a mismatch raises ValueError and sends nothing. Failed calls raise
IndexerError with the gRPC status code and the server's message.

A caller on the server's host may pass tensors by reference instead: register a shared-memory
region (register_system_region; shared_memory.SystemRegion makes one), then give TensorRefs
where arrays are taken and OutputRefs as a step's outputs= (refs.py).

A client may be shared by threads. AsyncIndexerClient (aio.py) is the same client for asyncio.
"""
from typing import Iterable, List, Optional, Sequence

import grpc

from indexer_client import _rpc
from indexer_client._channel import DEFAULT, channel_settings
from indexer_client.errors import IndexerError
from indexer_client.results import (AppendResult, ForkResult, RegionStatus, ReleaseResult,
                                    SequenceInfo, ServerInfo, SnapshotResult, TruncateResult)
from indexer_client.selection import Selection
from indexer_client.steps import Shapes, Step
from indexer_client.stream import BatchStream


class IndexerClient:
    """A client of one indexer server at `target`.

    target: "host:port", or a Unix domain socket: "unix:/path/to.sock" (relative or absolute
      after "unix:") or "unix:///absolute/path/to.sock", for a server started with
      --listen=unix:/path/to.sock (a co-located scheduler saves the TCP stack).
    timeout: the default deadline of each call, in seconds (None: none); every method's
      `timeout=` overrides it for that call.
    max_message_bytes: largest message sent or received (the server's default is 64 MiB).
    check_shapes: check tensors against the server's head_dim and layers before sending (one
      ServerInfo call on first use; server_info() refreshes what is known).
    Security (docs/SECURITY.md), all keyword-only:
      tls: connect with TLS (implied by any of the PEM arguments).
      root_certificates: PEM bytes of the CA that signed the server's certificate (None: gRPC's
        default roots).
      certificate_chain, private_key: PEM bytes of this client's certificate and key, for servers
        that require mutual TLS.
      server_name: the name to check the server's certificate against, when not the target host.
      token: bearer token sent with every call as "authorization: Bearer <token>".
    """

    def __init__(self, target: str, timeout: Optional[float] = 30.0,
                 max_message_bytes: int = 64 << 20, *, check_shapes: bool = True,
                 tls: bool = False, root_certificates: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 server_name: Optional[str] = None, token: Optional[str] = None):
        self.target = target
        self.timeout = timeout
        self._settings = channel_settings(target, timeout, max_message_bytes, tls,
                                          root_certificates, certificate_chain, private_key,
                                          server_name, token)
        options = list(self._settings.options)
        if self._settings.credentials is not None:
            self._channel = grpc.secure_channel(target, self._settings.credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stubs = {}
        self._check_shapes = check_shapes
        self._shapes: Optional[Shapes] = None

    def _run(self, call: _rpc.Call, timeout):
        stub = self._stubs.get(call.service)
        if stub is None:
            stub = self._stubs[call.service] = _rpc.stub(self._channel, call.service)
        try:
            response = getattr(stub, call.method)(
                call.request, timeout=self._settings.deadline(timeout),
                metadata=self._settings.call_metadata(call.request))
        except grpc.RpcError as e:
            raise IndexerError.from_rpc(e) from None
        return call.convert(response)

    def shapes(self, timeout=DEFAULT) -> Optional[Shapes]:
        """The server's head_dim and layers (None when check_shapes is off); asks ServerInfo
        the first time."""
        if self._check_shapes and self._shapes is None:
            self.server_info(timeout=timeout)
        return self._shapes if self._check_shapes else None

    def append_keys(self, sequence_id: str, keys, layer: int = 0,
                    all_layers: Optional[bool] = None, attention_pages: Sequence[int] = (),
                    wire_dtype: str = "bf16", *, timeout=DEFAULT) -> AppendResult:
        """Appends keys ([n][head_dim], or [n][layers][head_dim] for every layer; an array or a
        TensorRef), creating the sequence on its first append. ValueError, before sending, when
        the shape is not the server's."""
        call = _rpc.append_keys(sequence_id, keys, layer, all_layers, attention_pages,
                                wire_dtype, self.shapes(timeout))
        return self._run(call, timeout)

    def select_blocks(self, sequence_id: str, queries, *, timeout=DEFAULT, **step) -> Selection:
        """Selects blocks for queries [n][H][head_dim] (or [H][head_dim]; an array or a
        TensorRef) of one sequence.

        Keyword arguments are Step's: layer, keys (appended first, atomically), append_layer,
        all_layers, attention_pages, start_position, topk, init_blocks, local_blocks,
        wire_dtype, outputs (OutputRefs: the outputs go to regions; see Selection.written).
        """
        return self._run(_rpc.select_blocks(sequence_id, queries, step, self.shapes(timeout)),
                         timeout)

    def batch(self, steps: Iterable[Step], request_id: int = 0, return_exceptions: bool = False,
              *, timeout=DEFAULT) -> list:
        """Runs many steps in one Batch call; returns one Selection per step, in order.

        A failed item raises its IndexerError (with .index); with return_exceptions=True it is
        returned in the item's place instead, and the other items' results are kept.
        """
        call = _rpc.batch(steps, request_id, return_exceptions, self.shapes(timeout))
        return self._run(call, timeout)

    def register_system_region(self, name: str, key: str, byte_size: int, offset: int = 0, *,
                               timeout=DEFAULT) -> None:
        """Registers `byte_size` bytes at `offset` of the POSIX shared memory object `key`
        ("/name", SystemRegion.key) as the caller's region `name`, which references then name.
        The server maps it read-write until it is unregistered; the object must keep at least
        that size meanwhile. ALREADY_EXISTS for a name taken, NOT_FOUND for no such object,
        INVALID_ARGUMENT for a range outside it."""
        self._run(_rpc.register_system_region(name, key, byte_size, offset), timeout)

    def register_cuda_region(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                             offset: int = 0, *, timeout=DEFAULT) -> None:
        """Registers GPU memory shared by its CUDA IPC handle (cuda_region.CudaRegion has the
        arguments) as the caller's region `name`: byte_size bytes at `offset` of the allocation,
        on the server's GPU `device_id`, which the server's kernels read and write in place.
        FAILED_PRECONDITION for a server that reads no GPU memory or another GPU,
        INVALID_ARGUMENT for a handle it cannot open or a range past the allocation."""
        self._run(_rpc.register_cuda_region(name, raw_handle, device_id, byte_size, offset),
                  timeout)

    def unregister_region(self, name: str = "", *, timeout=DEFAULT) -> int:
        """Unregisters the caller's region `name` ("" = all of them); how many were. NOT_FOUND
        for a name not registered. Calls already running keep the memory they name."""
        return self._run(_rpc.unregister_region(name), timeout)

    def list_regions(self, name: str = "", *, timeout=DEFAULT) -> List[RegionStatus]:
        """The caller's regions by name (only `name`'s when given; NOT_FOUND if unknown)."""
        return self._run(_rpc.list_regions(name), timeout)

    def open_stream(self, *, timeout: Optional[float] = None,
                    max_in_flight: Optional[int] = None) -> BatchStream:
        """Opens a BatchStream: one long-lived call for a scheduler's every step, with batches
        in flight (stream.py). timeout: the whole stream's deadline (None: none)."""
        return BatchStream(_rpc.stub(self._channel, _rpc.INDEXER), self._settings.metadata,
                           self.shapes, timeout, max_in_flight)

    def release(self, sequence_id: str, *, timeout=DEFAULT) -> ReleaseResult:
        """Releases a sequence and every page only it references."""
        return self._run(_rpc.release(sequence_id), timeout)

    def truncate(self, sequence_id: str, length: int, *, timeout=DEFAULT) -> TruncateResult:
        """Shortens every layer to at most `length` tokens (rolls back speculative tokens)."""
        return self._run(_rpc.truncate(sequence_id, length), timeout)

    def fork(self, source_id: str, target_id: str, length: Optional[int] = None, *,
             timeout=DEFAULT) -> ForkResult:
        """Copies a sequence (its first `length` tokens), sharing its pages copy-on-write."""
        return self._run(_rpc.fork(source_id, target_id, length), timeout)

    def get_sequence(self, sequence_id: str, *, timeout=DEFAULT) -> SequenceInfo:
        """Lengths, pages, attention pages and shared pages of one sequence."""
        return self._run(_rpc.get_sequence(sequence_id), timeout)

    def server_info(self, *, timeout=DEFAULT) -> ServerInfo:
        """The server's configuration, defaults, capacity and use; also what shapes are checked
        against from now on."""
        info = self._run(_rpc.server_info(), timeout)
        self._shapes = Shapes(info.head_dim, info.layers, self.target)
        return info

    def get_stats(self, *, timeout=DEFAULT) -> dict:
        """The server's metrics (GetStats): {family name: [(labels dict, value or
        (count, sum)), ...]}; histograms give (count, sum)."""
        return self._run(_rpc.get_stats(), timeout)

    def snapshot(self, name: str = "", *, timeout=DEFAULT) -> SnapshotResult:
        """IndexerAdmin.Snapshot: writes every sequence to a snapshot file `name` ("" = a
        timestamped name) in the server's --snapshot_dir. Needs an admin token when the server
        checks tokens."""
        return self._run(_rpc.snapshot(name), timeout)

    def health(self, service: str = "", *, timeout=DEFAULT) -> str:
        """The standard gRPC health status: "SERVING", "NOT_SERVING", ..."""
        return self._run(_rpc.health(service), timeout)

    def wait_until_serving(self, timeout: float = 10.0) -> None:
        """Waits for the channel to connect and health to be SERVING, else raises IndexerError."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s") from None
        status = self.health(timeout=timeout)
        if status != "SERVING":
            raise IndexerError(grpc.StatusCode.UNAVAILABLE, f"{self.target} is {status}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
