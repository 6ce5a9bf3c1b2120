"""ShardedClient: one IndexerClient per server, every call routed by sequence id on a HashRing.

The Python counterpart of client/cpp/sharded_client.h, with the same ring (hash_ring.py), so a
Python scheduler and a C++ one (or indexer-bench) agree on where each sequence lives.

batch() splits the steps by server, runs the parts in parallel and returns results in step
order; with return_exceptions=True a server whose part failed (say it is down) puts its
IndexerError (message prefixed with the server's address) in each of its steps' places, and the
other servers' results are kept. fork() needs source and target on one server: use a hash tag
("{conv7}.a", "{conv7}.b").
"""
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import grpc

from indexer_client import _rpc
from indexer_client._channel import DEFAULT
from indexer_client.client import IndexerClient
from indexer_client.errors import IndexerError
from indexer_client.hash_ring import DEFAULT_VIRTUAL_NODES, HashRing
from indexer_client.steps import Step


class ShardedClient:
    """Clients of `targets` ("host:port" or "unix:/path" each); keyword arguments go to every
    IndexerClient. Every method takes `timeout=` as IndexerClient's do."""

    def __init__(self, targets: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
                 **client_options):
        if not targets:
            raise ValueError("the server list is empty")
        self.ring = HashRing(targets, virtual_nodes)
        self.targets = list(targets)
        self.clients = [IndexerClient(t, **client_options) for t in self.targets]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.targets)),
                                        thread_name_prefix="sharded-batch")

    def server_index(self, sequence_id: str) -> int:
        return self.ring.lookup_index(sequence_id)

    def target_for(self, sequence_id: str) -> str:
        return self.ring.lookup(sequence_id)

    def client_for(self, sequence_id: str) -> IndexerClient:
        return self.clients[self.server_index(sequence_id)]

    # --- calls of one sequence -----------------------------------------------------------------

    def append_keys(self, sequence_id: str, keys, **kwargs):
        return self.client_for(sequence_id).append_keys(sequence_id, keys, **kwargs)

    def select_blocks(self, sequence_id: str, queries, **step):
        return self.client_for(sequence_id).select_blocks(sequence_id, queries, **step)

    def release(self, sequence_id: str, *, timeout=DEFAULT):
        return self.client_for(sequence_id).release(sequence_id, timeout=timeout)

    def truncate(self, sequence_id: str, length: int, *, timeout=DEFAULT):
        return self.client_for(sequence_id).truncate(sequence_id, length, timeout=timeout)

    def get_sequence(self, sequence_id: str, *, timeout=DEFAULT):
        return self.client_for(sequence_id).get_sequence(sequence_id, timeout=timeout)

    def fork(self, source_id: str, target_id: str, length: Optional[int] = None, *,
             timeout=DEFAULT):
        source = self.server_index(source_id)
        if self.server_index(target_id) != source:
            raise IndexerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"fork source {source_id!r} lives on {self.targets[source]} but "
                               f"target {target_id!r} hashes to {self.target_for(target_id)}; give "
                               "both ids one hash tag (e.g. '{conv}.a' and '{conv}.b')")
        return self.clients[source].fork(source_id, target_id, length, timeout=timeout)

    # --- many sequences ------------------------------------------------------------------------

    def batch(self, steps: Iterable[Step], request_id: int = 0,
              return_exceptions: bool = False, *, timeout=DEFAULT) -> list:
        """One decode step over every server: results (or errors) in step order."""
        steps = list(steps)
        parts = {}
        for i, step in enumerate(steps):
            parts.setdefault(self.server_index(step.sequence_id), []).append(i)

        # Every part is built (and its shapes checked) before any is sent, so a ValueError
        # leaves every server untouched; a server whose ServerInfo fails fails its part only.
        calls, failed = {}, {}
        for server, indices in parts.items():
            client = self.clients[server]
            try:
                calls[server] = _rpc.batch([steps[i] for i in indices], request_id, True,
                                           client.shapes(timeout))
            except IndexerError as e:
                failed[server] = e
        futures = {server: self._pool.submit(self.clients[server]._run, call, timeout)
                   for server, call in calls.items()}
        results: list = [None] * len(steps)
        for server, indices in parts.items():
            try:
                if server in failed:
                    raise failed[server]
                answers = futures[server].result()
            except IndexerError as e:  # the whole part failed
                answers = [e] * len(indices)
            for i, answer in zip(indices, answers):
                if isinstance(answer, IndexerError):
                    answer = IndexerError(answer.code,
                                          f"{self.targets[server]}: {answer.message}", i)
                results[i] = answer
        if not return_exceptions:
            for r in results:
                if isinstance(r, IndexerError):
                    raise r
        return results

    def server_info_all(self, *, timeout=DEFAULT) -> list:
        return [c.server_info(timeout=timeout) for c in self.clients]

    def wait_until_serving(self, timeout: float = 10.0) -> None:
        for c in self.clients:
            c.wait_until_serving(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
