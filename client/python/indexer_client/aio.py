"""AsyncIndexerClient: the client for asyncio programs (schedulers), on grpc.aio.

The same methods, arguments, checks and results as IndexerClient, as coroutines. Create it
inside the running event loop and close it there (`async with AsyncIndexerClient(...)`). One
client may serve any number of concurrent tasks; `await asyncio.gather(...)` of many calls
shares one channel.
"""
import asyncio
import collections
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import grpc
import grpc.aio

from indexer_client import _rpc
from indexer_client._channel import DEFAULT, channel_settings
from indexer_client.errors import IndexerError
from indexer_client.results import (AppendResult, ForkResult, RegionStatus, ReleaseResult,
                                    SequenceInfo, ServerInfo, SnapshotResult, TruncateResult)
from indexer_client.selection import Selection
from indexer_client.steps import Shapes, Step, batch_outputs, batch_request, batch_results


class AsyncIndexerClient:
    """A client of one indexer server at `target`, for asyncio; the arguments are
    IndexerClient's (targets may be "host:port" or "unix:/path/to.sock")."""

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
            self._channel = grpc.aio.secure_channel(target, self._settings.credentials,
                                                    options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stubs = {}
        self._check_shapes = check_shapes
        self._shapes: Optional[Shapes] = None

    async def _run(self, call: _rpc.Call, timeout):
        stub = self._stubs.get(call.service)
        if stub is None:
            stub = self._stubs[call.service] = _rpc.stub(self._channel, call.service)
        try:
            response = await getattr(stub, call.method)(
                call.request, timeout=self._settings.deadline(timeout),
                metadata=self._settings.call_metadata(call.request))
        except grpc.RpcError as e:
            raise IndexerError.from_rpc(e) from None
        return call.convert(response)

    async def shapes(self, timeout=DEFAULT) -> Optional[Shapes]:
        """The server's head_dim and layers (None when check_shapes is off); asks ServerInfo
        the first time."""
        if self._check_shapes and self._shapes is None:
            await self.server_info(timeout=timeout)
        return self._shapes if self._check_shapes else None

    async def append_keys(self, sequence_id: str, keys, layer: int = 0,
                          all_layers: Optional[bool] = None, attention_pages: Sequence[int] = (),
                          wire_dtype: str = "bf16", *, timeout=DEFAULT) -> AppendResult:
        """IndexerClient.append_keys."""
        call = _rpc.append_keys(sequence_id, keys, layer, all_layers, attention_pages,
                                wire_dtype, await self.shapes(timeout))
        return await self._run(call, timeout)

    async def select_blocks(self, sequence_id: str, queries, *, timeout=DEFAULT,
                            **step) -> Selection:
        """IndexerClient.select_blocks."""
        call = _rpc.select_blocks(sequence_id, queries, step, await self.shapes(timeout))
        return await self._run(call, timeout)

    async def batch(self, steps: Iterable[Step], request_id: int = 0,
                    return_exceptions: bool = False, *, timeout=DEFAULT) -> list:
        """IndexerClient.batch."""
        call = _rpc.batch(steps, request_id, return_exceptions, await self.shapes(timeout))
        return await self._run(call, timeout)

    async def register_system_region(self, name: str, key: str, byte_size: int,
                                     offset: int = 0, *, timeout=DEFAULT) -> None:
        """IndexerClient.register_system_region."""
        await self._run(_rpc.register_system_region(name, key, byte_size, offset), timeout)

    async def register_cuda_region(self, name: str, raw_handle: bytes, device_id: int,
                                   byte_size: int, offset: int = 0, *, timeout=DEFAULT) -> None:
        """IndexerClient.register_cuda_region."""
        await self._run(_rpc.register_cuda_region(name, raw_handle, device_id, byte_size, offset),
                        timeout)

    async def unregister_region(self, name: str = "", *, timeout=DEFAULT) -> int:
        """IndexerClient.unregister_region."""
        return await self._run(_rpc.unregister_region(name), timeout)

    async def list_regions(self, name: str = "", *, timeout=DEFAULT) -> List[RegionStatus]:
        """IndexerClient.list_regions."""
        return await self._run(_rpc.list_regions(name), timeout)

    def open_stream(self, *, timeout: Optional[float] = None,
                    max_in_flight: Optional[int] = None) -> "AsyncBatchStream":
        """Opens a BatchStream (AsyncBatchStream), from inside the event loop."""
        return AsyncBatchStream(_rpc.stub(self._channel, _rpc.INDEXER), self._settings.metadata,
                                self.shapes, timeout, max_in_flight)

    async def release(self, sequence_id: str, *, timeout=DEFAULT) -> ReleaseResult:
        """IndexerClient.release."""
        return await self._run(_rpc.release(sequence_id), timeout)

    async def truncate(self, sequence_id: str, length: int, *, timeout=DEFAULT) -> TruncateResult:
        """IndexerClient.truncate."""
        return await self._run(_rpc.truncate(sequence_id, length), timeout)

    async def fork(self, source_id: str, target_id: str, length: Optional[int] = None, *,
                   timeout=DEFAULT) -> ForkResult:
        """IndexerClient.fork."""
        return await self._run(_rpc.fork(source_id, target_id, length), timeout)

    async def get_sequence(self, sequence_id: str, *, timeout=DEFAULT) -> SequenceInfo:
        """IndexerClient.get_sequence."""
        return await self._run(_rpc.get_sequence(sequence_id), timeout)

    async def server_info(self, *, timeout=DEFAULT) -> ServerInfo:
        """IndexerClient.server_info."""
        info = await self._run(_rpc.server_info(), timeout)
        self._shapes = Shapes(info.head_dim, info.layers, self.target)
        return info

    async def get_stats(self, *, timeout=DEFAULT) -> dict:
        """IndexerClient.get_stats."""
        return await self._run(_rpc.get_stats(), timeout)

    async def snapshot(self, name: str = "", *, timeout=DEFAULT) -> SnapshotResult:
        """IndexerClient.snapshot."""
        return await self._run(_rpc.snapshot(name), timeout)

    async def health(self, service: str = "", *, timeout=DEFAULT) -> str:
        """IndexerClient.health."""
        return await self._run(_rpc.health(service), timeout)

    async def wait_until_serving(self, timeout: float = 10.0) -> None:
        """IndexerClient.wait_until_serving."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s") from None
        status = await self.health(timeout=timeout)
        if status != "SERVING":
            raise IndexerError(grpc.StatusCode.UNAVAILABLE, f"{self.target} is {status}")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


@dataclass
class _Pending:
    request_id: int
    future: asyncio.Future
    return_exceptions: bool
    outputs: List  # batch_outputs() of the request


class AsyncBatchStream:
    """An open BatchStream of the asyncio client, with batches in flight: BatchStream's
    contract (stream.py) with coroutines. `async with client.open_stream() as stream:`.

    submit() sends a batch and returns an asyncio.Future of its results; step() awaits it. A
    reader task matches answers to requests, in order, by request_id. Tasks may share a stream.
    """

    def __init__(self, stub, metadata, shapes, timeout: Optional[float] = None,
                 max_in_flight: Optional[int] = None):
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight is {max_in_flight}; it must be >= 1 (or None)")
        self._shapes = shapes
        self._call = stub.BatchStream(timeout=timeout, metadata=metadata)
        self._pending = collections.deque()
        self._send_lock = asyncio.Lock()  # one write at a time, in the order of _pending
        self._max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self._next_id = 1
        self._closing = False
        self._ended: Optional[IndexerError] = None
        self._reader = asyncio.ensure_future(self._read())

    @property
    def in_flight(self) -> int:
        """Batches sent and not answered yet."""
        return len(self._pending)

    async def submit(self, steps: Iterable[Step], return_exceptions: bool = False,
                     timeout: Optional[float] = None) -> asyncio.Future:
        """Sends one batch; returns a Future of its results. ValueError (nothing sent) for wrong
        shapes; IndexerError when the stream has ended or is closed, and DEADLINE_EXCEEDED
        (nothing sent) when no slot freed within timeout seconds while max_in_flight batches
        are unanswered (None: wait as long as it takes)."""
        request = batch_request(steps, 0, await self._shapes())
        if self._slots is not None:
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout)
            except asyncio.TimeoutError:
                raise IndexerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{self._max_in_flight} batches still unanswered after "
                                   f"{timeout} s (max_in_flight); this one was not sent") from None
        future = asyncio.get_running_loop().create_future()
        async with self._send_lock:
            if self._ended is not None or self._closing:
                self._release_slot()
                raise self._ended or IndexerError(grpc.StatusCode.FAILED_PRECONDITION,
                                                  "the stream is closed")
            request.request_id = self._next_id
            self._next_id += 1
            self._pending.append(_Pending(request.request_id, future, return_exceptions,
                                          batch_outputs(request)))
            try:
                await self._call.write(request)
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # the stream is ending: the reader fails every pending batch, this one too
        return future

    async def step(self, steps: Iterable[Step], return_exceptions: bool = False,
                   timeout: Optional[float] = None) -> List:
        """submit() and await the answer; a timeout as in BatchStream.step (DEADLINE_EXCEEDED;
        the batch may still be applied; the stream stays usable)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        future = await self.submit(steps, return_exceptions, timeout)
        try:
            return await asyncio.wait_for(
                asyncio.shield(future),
                None if deadline is None else max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            future.add_done_callback(_forget)
            raise IndexerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no answer on the stream within {timeout} s; the batch may "
                               "still be applied") from None

    async def close(self) -> None:
        """Ends the stream once every batch sent has been answered. Never raises."""
        async with self._send_lock:
            if not self._closing:
                self._closing = True
                try:
                    await self._call.done_writing()
                except (grpc.RpcError, asyncio.InvalidStateError):
                    pass
        await self._reader

    async def cancel(self) -> None:
        """Cancels the stream now; unanswered batches fail with CANCELLED."""
        self._call.cancel()
        await self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _read(self) -> None:
        error = IndexerError(grpc.StatusCode.UNAVAILABLE, "the server ended the stream")
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                pending = self._pending.popleft() if self._pending else None
                if pending is None or pending.request_id != response.request_id:
                    expected = "none" if pending is None else pending.request_id
                    error = IndexerError(grpc.StatusCode.INTERNAL,
                                         f"the server answered request {response.request_id} "
                                         f"while the next unanswered request was {expected}")
                    if pending is not None:
                        _settle(pending.future, error=error)
                        self._release_slot()
                    self._call.cancel()
                    break
                try:
                    _settle(pending.future, batch_results(response, pending.return_exceptions,
                                                          pending.outputs))
                except Exception as e:  # an item's IndexerError, or an answer that does not parse
                    _settle(pending.future, error=e)
                self._release_slot()
        except grpc.RpcError as e:
            error = IndexerError.from_rpc(e)
        except asyncio.CancelledError:
            error = IndexerError(grpc.StatusCode.CANCELLED, "the stream was cancelled")
        if self._closing and not self._pending:
            error = IndexerError(grpc.StatusCode.FAILED_PRECONDITION, "the stream is closed")
        self._ended = error
        while self._pending:
            _settle(self._pending.popleft().future, error=error)
            self._release_slot()

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()


def _settle(future: asyncio.Future, result=None, error: Optional[BaseException] = None) -> None:
    if future.done():  # cancelled by its owner
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _forget(future: asyncio.Future) -> None:
    # The answer of a step that timed out is dropped; retrieving it keeps asyncio from
    # reporting an unretrieved exception.
    if not future.cancelled():
        future.exception()
