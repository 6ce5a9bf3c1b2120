"""BatchStream: one open BatchStream call of the blocking client, with batches in flight.

The server answers a stream's requests one by one, in order, each answer carrying its request's
request_id. submit() sends a batch and returns a concurrent.futures.Future at once, so a
scheduler can keep several steps in flight (two micro-batches, say) and collect each answer when
it needs it; step() is submit() followed by waiting for the answer. A reader thread matches each
answer to the oldest unanswered request and checks that their ids agree.

Threads may share a stream: submit() from any thread; answers resolve in submission order.
"""
import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import grpc

from indexer_client.errors import IndexerError
from indexer_client.steps import Shapes, Step, batch_outputs, batch_request, batch_results


@dataclass
class _Pending:
    request_id: int
    future: concurrent.futures.Future
    return_exceptions: bool
    outputs: List  # batch_outputs() of the request

    def finish(self, response) -> None:
        try:
            self.future.set_result(batch_results(response, self.return_exceptions,
                                                 self.outputs))
        except Exception as e:  # an item's IndexerError, or an answer that does not parse
            self.future.set_exception(e)


class BatchStream:
    """An open BatchStream (IndexerClient.open_stream). Use as a context manager, or close().

    timeout: the deadline of the whole stream, in seconds (None: none). max_in_flight: submit()
    blocks while this many batches are unanswered (None: no limit).
    """

    _CLOSE = object()

    def __init__(self, stub, metadata, shapes: Callable[[], Optional[Shapes]],
                 timeout: Optional[float] = None, max_in_flight: Optional[int] = None):
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight is {max_in_flight}; it must be >= 1 (or None)")
        self._shapes = shapes
        self._lock = threading.Lock()
        self._pending = collections.deque()  # _Pending, in the order they were sent
        self._max_in_flight = max_in_flight
        self._slots = threading.Semaphore(max_in_flight) if max_in_flight else None
        self._next_id = 1
        self._closing = False
        self._ended: Optional[IndexerError] = None  # set once no answer can come any more
        self._requests = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._responses = stub.BatchStream(self._outgoing(), timeout=timeout, metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="indexer-batch-stream",
                                        daemon=True)
        self._reader.start()

    @property
    def in_flight(self) -> int:
        """Batches sent and not answered yet."""
        with self._lock:
            return len(self._pending)

    def submit(self, steps: Iterable[Step], return_exceptions: bool = False,
               timeout: Optional[float] = None) -> concurrent.futures.Future:
        """Sends one batch; returns a Future of its results (as IndexerClient.batch returns them,
        or raising its IndexerError).

        timeout: seconds to wait for a free slot when max_in_flight batches are unanswered
        (None: as long as it takes).

        Raises ValueError, sending nothing, when a step's shapes are wrong; IndexerError when the
        stream has ended or is closed, and DEADLINE_EXCEEDED, sending nothing, when no slot
        freed within timeout.
        """
        request = batch_request(steps, 0, self._shapes())
        if self._slots is not None and not self._slots.acquire(timeout=timeout):
            raise IndexerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{self._max_in_flight} batches still unanswered after {timeout} s "
                               "(max_in_flight); this one was not sent")
        future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # sent requests cannot be taken back
        with self._lock:
            if self._ended is not None or self._closing:
                self._release_slot()
                raise self._ended or IndexerError(grpc.StatusCode.FAILED_PRECONDITION,
                                                  "the stream is closed")
            request.request_id = self._next_id
            self._next_id += 1
            self._pending.append(_Pending(request.request_id, future, return_exceptions,
                                          batch_outputs(request)))
            self._requests.append(request)
            self._wake.notify()
        return future

    def step(self, steps: Iterable[Step], return_exceptions: bool = False,
             timeout: Optional[float] = None) -> List:
        """Like IndexerClient.batch, over the stream: submit() and wait for the answer.

        timeout: seconds to wait for it. When they pass, IndexerError DEADLINE_EXCEEDED is raised
        and the stream stays usable; the batch was sent and may still be applied (check with
        get_sequence), and its answer is dropped when it comes.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self.submit(steps, return_exceptions, timeout)
        try:
            return future.result(None if deadline is None
                                 else max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise IndexerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no answer on the stream within {timeout} s; the batch may "
                               "still be applied") from None

    def close(self) -> None:
        """Ends the stream once every batch sent has been answered (their futures resolve).

        Never raises: a stream that already failed (say, the server shut down) reported that
        through its futures.
        """
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._reader.join()

    def cancel(self) -> None:
        """Cancels the stream now; unanswered batches fail with CANCELLED (each may or may not
        have been applied)."""
        self._responses.cancel()
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _outgoing(self):
        # gRPC's sending thread iterates this; it ends the stream once closed and drained.
        while True:
            with self._lock:
                while not self._requests and not self._closing and self._ended is None:
                    self._wake.wait()
                if not self._requests:
                    return
                request = self._requests.popleft()
            yield request

    def _read(self) -> None:
        error = IndexerError(grpc.StatusCode.UNAVAILABLE, "the server ended the stream")
        try:
            for response in self._responses:
                with self._lock:
                    pending = self._pending.popleft() if self._pending else None
                if pending is None or pending.request_id != response.request_id:
                    expected = "none" if pending is None else pending.request_id
                    error = IndexerError(grpc.StatusCode.INTERNAL,
                                         f"the server answered request {response.request_id} "
                                         f"while the next unanswered request was {expected}")
                    with self._lock:
                        self._ended = error  # before any future fails: no submit after that
                    if pending is not None:
                        pending.future.set_exception(error)
                        self._release_slot()
                    self._responses.cancel()
                    break
                pending.finish(response)
                self._release_slot()
        except grpc.RpcError as e:
            error = IndexerError.from_rpc(e)
        with self._lock:
            if self._closing and not self._pending:
                error = IndexerError(grpc.StatusCode.FAILED_PRECONDITION, "the stream is closed")
            self._ended = error
            left = list(self._pending)
            self._pending.clear()
            self._wake.notify()
        for pending in left:
            pending.future.set_exception(error)
            self._release_slot()

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()
