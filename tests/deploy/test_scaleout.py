#!/usr/bin/python3
"""Scale-out on loopback: three CPU servers, reached two ways, one of them killed mid-run.

1. Through Debian's nginx with docker/proxy/nginx.conf's routing (hash on the x-sequence-id
   header the clients send), one sequence per call.
2. Through client-side consistent hashing (indexer_client.ShardedClient).

Each time: many sequences are appended and selected through the router and every answer is
checked against the numpy reference; then one server is killed (SIGKILL), and afterwards exactly
the sequences it held fail, with a clear error, while every other sequence still answers
correctly.

Environment: INDEXER_SERVER_BIN, INDEXER_SOURCE_DIR; PYTHONPATH holds the generated stubs and
client/python.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

try:
    import grpc
    import numpy as np
    from indexer_client import IndexerClient, IndexerError, ShardedClient, reference_select
except ImportError as e:
    sys.exit(f"test_scaleout: {e}; run scripts/setup.sh and build the project (stubs)")

SERVER = os.environ.get("INDEXER_SERVER_BIN", "build/server/indexer-server")
SRC = os.environ.get("INDEXER_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
HEAD_DIM = 64
SEQUENCES = 48
TOKENS = 300  # three blocks each


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n):
    servers = []
    for _ in range(n):
        port = free_port()
        p = subprocess.Popen([SERVER, f"--listen=127.0.0.1:{port}", "--device=cpu", "--capacity=512",
                              f"--head_dim={HEAD_DIM}", "--cpu_threads=1", "--not_serving_seconds=0",
                              "--drain_seconds=1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append((p, f"127.0.0.1:{port}"))
    for p, target in servers:
        c = IndexerClient(target, timeout=5)
        c.wait_until_serving(timeout=20)
        c.close()
    return servers


def stop_servers(servers):
    for p, _ in servers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, _ in servers:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


class Workload:
    """Integer-valued keys and queries (exact sums), remembered to check every answer."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.keys = {}

    def ids(self):
        return [f"seq-{i:03d}" for i in range(SEQUENCES)]

    def new_keys(self, sid):
        k = self.rng.integers(-4, 5, size=(TOKENS, HEAD_DIM)).astype(np.float32)
        self.keys[sid] = k
        return k

    def check(self, test, sid, selection, queries):
        want = reference_select(self.keys[sid], queries, TOKENS - 1, 4, 0, 1)
        np.testing.assert_array_equal(selection.block_ids, want.block_ids, err_msg=sid)

    def queries(self):
        return self.rng.integers(-4, 5, size=(1, 2, HEAD_DIM)).astype(np.float32)


def holders(servers, ids):
    """Which server holds each sequence, asked of every server directly."""
    where = {}
    for i, (_, target) in enumerate(servers):
        c = IndexerClient(target, timeout=5)
        for sid in ids:
            try:
                c.get_sequence(sid)
                test_owner = where.setdefault(sid, i)
                assert test_owner == i, f"{sid} is on two servers"
            except IndexerError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND, e
        c.close()
    return where


class ScaleOut(unittest.TestCase):
    def run_and_kill(self, client, servers, victim_index):
        w = Workload(seed=victim_index)
        ids = w.ids()
        for sid in ids:
            client.append_keys(sid, w.new_keys(sid))
        for sid in ids:
            q = w.queries()
            w.check(self, sid, client.select_blocks(sid, q, topk=4), q)
        where = holders(servers, ids)
        self.assertEqual(sorted(where), sorted(ids), "every sequence lives on exactly one server")
        counts = [list(where.values()).count(i) for i in range(len(servers))]
        self.assertTrue(all(c > 0 for c in counts), f"sequences per server: {counts}")

        victim, _ = servers[victim_index]
        victim.kill()
        victim.wait()
        lost = {sid for sid, i in where.items() if i == victim_index}
        failures = {}
        for sid in ids:
            q = w.queries()
            try:
                sel = client.select_blocks(sid, q, topk=4)
            except IndexerError as e:
                failures[sid] = e
                continue
            w.check(self, sid, sel, q)
        self.assertEqual(set(failures), lost, "exactly the killed server's sequences fail")
        for sid, e in failures.items():
            self.assertIn(e.code, (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), f"{sid}: {e}")
            self.assertTrue(e.message, f"{sid}: an error without a message")
        # The survivors keep working: a decode step on each.
        for sid in ids:
            if sid in lost:
                continue
            q = w.queries()
            key = w.rng.integers(-4, 5, size=(1, HEAD_DIM)).astype(np.float32)
            w.keys[sid] = np.concatenate([w.keys[sid], key])
            sel = client.select_blocks(sid, q, keys=key, topk=4)
            want = reference_select(w.keys[sid], q, TOKENS, 4, 0, 1)
            np.testing.assert_array_equal(sel.block_ids, want.block_ids, err_msg=sid)
        return len(lost)

    def test_client_side_hashing(self):
        servers = start_servers(3)
        try:
            client = ShardedClient([t for _, t in servers], timeout=5)
            lost = self.run_and_kill(client, servers, victim_index=1)
            self.assertGreater(lost, 0)
            client.close()
        finally:
            stop_servers(servers)

    def test_nginx_consistent_hash_on_sequence_header(self):
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(nginx):
            self.fail("nginx is missing; run scripts/setup.sh")
        servers = start_servers(3)
        work = tempfile.mkdtemp(prefix="indexer-nginx-")
        proxy = None
        try:
            with open(os.path.join(SRC, "docker/proxy/nginx.conf")) as f:
                conf = f.read()
            port = free_port()
            upstreams = "".join(f"    server {t} max_fails=1 fail_timeout=10s;\n" for _, t in servers)
            conf = re.sub(r"(    server 127\.0\.0\.1:\d+ [^\n]*\n)+", upstreams, conf)
            conf = re.sub(r"listen 127\.0\.0\.1:\d+ http2;", f"listen 127.0.0.1:{port} http2;", conf)
            conf = conf.replace("/tmp/indexer-nginx", os.path.join(work, "t"))
            self.assertEqual(conf.count(" max_fails=1"), 3)
            path = os.path.join(work, "nginx.conf")
            with open(path, "w") as f:
                f.write(conf)
            proxy = subprocess.Popen([nginx, "-c", path, "-p", work, "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            client = IndexerClient(f"127.0.0.1:{port}", timeout=5)
            for _ in range(100):
                try:
                    client.server_info()
                    break
                except IndexerError:
                    self.assertIsNone(proxy.poll(), "nginx exited")
                    time.sleep(0.1)
            lost = self.run_and_kill(client, servers, victim_index=2)
            self.assertGreater(lost, 0)
            client.close()
        finally:
            if proxy is not None:
                proxy.send_signal(signal.SIGQUIT)
                try:
                    proxy.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proxy.kill()
            stop_servers(servers)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
