#!/usr/bin/python3
"""Tests the Python client's consistent-hash ring and ShardedClient (client/python/indexer_client).

- The ring maps ids exactly as the C++ ring does: the golden table shared with
  tests/bench/hash_ring_test.cc, and thousands of ids compared with the C++ helper
  indexer-hash-ring-dump (INDEXER_HASH_RING_DUMP).
- Balance over ten servers, and stability when a server is added or removed.
- ShardedClient against two real indexer-servers (INDEXER_SERVER_BIN): calls land on the owner,
  batches are split and merged in order, forks need a hash tag.
ctest -R python_hash_ring sets the variables and PYTHONPATH (the installed package).
"""
import os
import subprocess
import sys
import unittest
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from indexer_client.hash_ring import HashRing, fnv1a64, mix64, shard_key  # noqa: E402

GOLDEN_SERVERS = ["indexer-a:50051", "indexer-b:50051", "indexer-c:50051", "indexer-d:50051"]
# The same table as tests/bench/hash_ring_test.cc (GoldenTable).
GOLDEN = [
    ("seq-0", "indexer-d:50051"), ("seq-1", "indexer-b:50051"), ("seq-2", "indexer-a:50051"),
    ("seq-3", "indexer-a:50051"), ("seq-4", "indexer-a:50051"), ("seq-5", "indexer-c:50051"),
    ("seq-6", "indexer-c:50051"), ("seq-7", "indexer-a:50051"), ("seq-8", "indexer-a:50051"),
    ("seq-9", "indexer-b:50051"), ("", "indexer-a:50051"), ("{conv7}.a", "indexer-c:50051"),
    ("{conv7}.b", "indexer-c:50051"), ("conv7", "indexer-c:50051"),
    ("s\u00e9quence-\u00fc", "indexer-c:50051"), ("a}b{c", "indexer-a:50051"),
    ("{}x", "indexer-a:50051"), ("bench-123-1700000000000-s0-42", "indexer-d:50051"),
]


def servers(n):
    return [f"indexer-{i}.svc:50051" for i in range(n)]


def ids(n):
    return [f"bench-4242-1700000000000-s0-{i}" for i in range(n)]


class HashRingTest(unittest.TestCase):
    def test_fnv_matches_published_vectors(self):
        self.assertEqual(fnv1a64(b""), 0xCBF29CE484222325)
        self.assertEqual(fnv1a64(b"a"), 0xAF63DC4C8601EC8C)
        self.assertEqual(fnv1a64(b"foobar"), 0x85944171F73967E8)
        self.assertEqual(mix64(0), 0)

    def test_shard_key(self):
        self.assertEqual(shard_key("plain"), "plain")
        self.assertEqual(shard_key("{conv7}.a"), "conv7")
        self.assertEqual(shard_key("x{conv7}y{z}"), "conv7")
        self.assertEqual(shard_key("{}x"), "{}x")
        self.assertEqual(shard_key("a}b{c"), "a}b{c")

    def test_golden_table(self):
        ring = HashRing(GOLDEN_SERVERS)
        for sequence_id, server in GOLDEN:
            self.assertEqual(ring.lookup(sequence_id), server, repr(sequence_id))

    def test_agrees_with_the_cpp_ring(self):
        dump = os.environ.get("INDEXER_HASH_RING_DUMP")
        if not dump or not os.access(dump, os.X_OK):
            self.skipTest("INDEXER_HASH_RING_DUMP (the C++ indexer-hash-ring-dump) is not set; "
                          "ctest -R python_hash_ring sets it")
        sample = ids(3000) + [f"{{tag-{i}}}.x" for i in range(200)] + \
            [f"\u00fcnic\u00f8de-{i}-\u6f22" for i in range(200)] + [g[0] for g in GOLDEN]
        for server_list, vnodes in ((servers(3), 256), (servers(11), 256), (GOLDEN_SERVERS, 16),
                                    (["a", "b"], 1)):
            out = subprocess.run([dump, ",".join(server_list), str(vnodes)], check=True,
                                 input="\n".join(sample) + "\n", capture_output=True,
                                 encoding="utf-8").stdout
            cpp = [line.split("\t")[1] for line in out.split("\n")[:len(sample)]]
            ring = HashRing(server_list, vnodes)
            mismatched = [(i, c) for i, c in zip(sample, cpp) if ring.lookup(i) != c]
            self.assertEqual(mismatched[:5], [], f"{len(server_list)} servers, {vnodes} vnodes")

    def test_balanced_over_ten_servers(self):
        ring = HashRing(servers(10))
        load = Counter(ring.lookup(i) for i in ids(50000))
        self.assertEqual(len(load), 10)
        for server, n in load.items():
            self.assertAlmostEqual(n, 5000, delta=750, msg=server)

    def test_adding_and_removing_a_server(self):
        ring = HashRing(servers(10))
        sample = ids(20000)
        before = [ring.lookup(i) for i in sample]
        ring.add("indexer-10.svc:50051")
        after = [ring.lookup(i) for i in sample]
        moved = [(b, a) for b, a in zip(before, after) if a != b]
        self.assertTrue(all(a == "indexer-10.svc:50051" for _, a in moved))
        self.assertAlmostEqual(len(moved), 20000 / 11, delta=0.2 * 20000 / 11)
        ring.remove("indexer-10.svc:50051")
        self.assertEqual([ring.lookup(i) for i in sample], before)
        ring.remove("indexer-3.svc:50051")
        for sequence_id, old in zip(sample, before):
            if old != "indexer-3.svc:50051":
                self.assertEqual(ring.lookup(sequence_id), old)

    def test_errors(self):
        with self.assertRaises(ValueError):
            HashRing(["a", "a"])
        with self.assertRaises(ValueError):
            HashRing([""])
        with self.assertRaises(ValueError):
            HashRing(["a"], virtual_nodes=0)
        with self.assertRaises(LookupError):
            HashRing().lookup("x")
        with self.assertRaises(KeyError):
            HashRing(["a"]).remove("b")


class ShardedClientTest(unittest.TestCase):
    """Two real servers (the CPU backend) behind one ShardedClient."""

    @classmethod
    def setUpClass(cls):
        binary = os.environ.get("INDEXER_SERVER_BIN")
        if not binary or not os.access(binary, os.X_OK):
            raise unittest.SkipTest("INDEXER_SERVER_BIN is not set (ctest -R python_hash_ring sets it)")
        try:
            import numpy  # noqa: F401
            from server_process import Server
        except ImportError as e:
            raise unittest.SkipTest(f"cannot import the server helper: {e}")
        cls.servers = [Server(binary), Server(binary)]
        from indexer_client import IndexerClient, ShardedClient
        cls.targets = [s.target for s in cls.servers]
        cls.client = ShardedClient(cls.targets, timeout=20)
        cls.direct = [IndexerClient(t, timeout=20) for t in cls.targets]
        cls.client.wait_until_serving()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        for d in cls.direct:
            d.close()
        for s in cls.servers:
            s.stop()

    def test_calls_and_batches_reach_the_owner(self):
        import numpy as np
        from indexer_client import IndexerError, Step
        from server_process import HEAD_DIM, LAYERS
        rng = np.random.default_rng(3)
        sequence_ids = [f"py-shard-{i}" for i in range(12)]
        owners = {self.client.server_index(s) for s in sequence_ids}
        self.assertEqual(owners, {0, 1}, "the ids should cover both servers")
        for s in sequence_ids:
            self.client.append_keys(s, rng.integers(-3, 4, size=(150, LAYERS, HEAD_DIM)).astype(np.float32))
        for s in sequence_ids:
            owner = self.client.server_index(s)
            self.assertEqual(self.direct[owner].get_sequence(s).lengths[0], 150)
            with self.assertRaises(IndexerError):
                self.direct[1 - owner].get_sequence(s)
        steps = [Step(s, queries=rng.integers(-3, 4, size=(1, 1 + k % 2, HEAD_DIM)).astype(np.float32),
                      keys=rng.integers(-3, 4, size=(1, LAYERS, HEAD_DIM)).astype(np.float32))
                 for k, s in enumerate(sequence_ids)]
        # A step with the wrong head_dim stops the whole batch before any server gets a part.
        bad = Step(sequence_ids[0], queries=np.ones((1, 1, HEAD_DIM * 2), np.float32))
        with self.assertRaises(ValueError):
            self.client.batch(steps + [bad])
        for s in sequence_ids:
            self.assertEqual(self.client.get_sequence(s).lengths.tolist(), [150] * LAYERS)
        results = self.client.batch(steps, timeout=10)
        self.assertEqual(len(results), len(steps))
        for k, r in enumerate(results):
            self.assertEqual(r.start_position, 150)
            self.assertEqual(r.block_ids.shape[1], 1 + k % 2)
        # Forks: a hash tag keeps both ids on one server.
        self.client.append_keys("{chat}.main", rng.integers(-3, 4, size=(200, LAYERS, HEAD_DIM)).astype(np.float32))
        self.assertEqual(list(self.client.fork("{chat}.main", "{chat}.alt").lengths), [200] * LAYERS)
        for s in sequence_ids + ["{chat}.main", "{chat}.alt"]:
            self.client.release(s)


if __name__ == "__main__":
    unittest.main(verbosity=2)
