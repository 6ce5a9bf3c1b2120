"""HashRing: client-side consistent hashing of sequence ids over server addresses.

The same mapping as the C++ client's HashRing (client/cpp/hash_ring.h); the two must agree on
every id, and both are held to one golden table (tests/python/test_hash_ring.py and
tests/bench/hash_ring_test.cc):

    hash(s)      = mix64(fnv1a64(UTF-8 bytes of s))
    ring points  = hash(f"{server}#{i}") for i in range(virtual_nodes), for every server
    owner(id)    = the server of the first point (by hash, ties by server name) at or after
                   hash(shard_key(id)), wrapping around
    shard_key(id)= the text between the first "{" and the next "}" when non-empty (a hash tag:
                   "{conv7}.a" and "{conv7}.b" live on one server, so forks work), else the id

A HashRing may be read from many threads; add/remove must not run concurrently with anything.
"""
import bisect
from typing import Iterable, List

DEFAULT_VIRTUAL_NODES = 256

_MASK = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of `data`."""
    h = _FNV_OFFSET
    for byte in data:
        h ^= byte
        h = (h * _FNV_PRIME) & _MASK
    return h


def mix64(x: int) -> int:
    """The 64-bit finalizer (splitmix64's) applied after FNV-1a."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return x


def ring_hash(text: str) -> int:
    return mix64(fnv1a64(text.encode("utf-8")))


def shard_key(sequence_id: str) -> str:
    """The part of a sequence id that is hashed: its hash tag, if it has a non-empty one."""
    start = sequence_id.find("{")
    if start < 0:
        return sequence_id
    end = sequence_id.find("}", start + 1)
    if end < 0 or end == start + 1:
        return sequence_id
    return sequence_id[start + 1:end]


class HashRing:
    """Servers on a consistent-hash ring with `virtual_nodes` points each.

    Raises ValueError for an empty or repeated server, or virtual_nodes < 1.
    """

    def __init__(self, servers: Iterable[str] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes is {virtual_nodes}; it must be >= 1")
        self.virtual_nodes = virtual_nodes
        self._servers: List[str] = []
        self._hashes: List[int] = []
        self._owners: List[str] = []
        for server in servers:
            self.add(server)

    @property
    def servers(self) -> List[str]:
        """The servers, in the order they were added."""
        return list(self._servers)

    def __len__(self) -> int:
        return len(self._servers)

    def add(self, server: str) -> None:
        if not server:
            raise ValueError("a server address is empty")
        if server in self._servers:
            raise ValueError(f"server {server!r} is already on the ring")
        self._servers.append(server)
        self._rebuild()

    def remove(self, server: str) -> None:
        if server not in self._servers:
            raise KeyError(f"server {server!r} is not on the ring")
        self._servers.remove(server)
        self._rebuild()

    def _rebuild(self) -> None:
        points = sorted((ring_hash(f"{server}#{i}"), server)
                        for server in self._servers for i in range(self.virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [s for _, s in points]

    def lookup(self, sequence_id: str) -> str:
        """The server owning `sequence_id`. Raises LookupError when the ring is empty."""
        if not self._hashes:
            raise LookupError("the hash ring has no servers")
        i = bisect.bisect_left(self._hashes, ring_hash(shard_key(sequence_id)))
        return self._owners[i if i < len(self._owners) else 0]

    def lookup_index(self, sequence_id: str) -> int:
        """Index into `servers` of the owner."""
        return self._servers.index(self.lookup(sequence_id))
