#!/usr/bin/python3
"""Tests the asyncio client (AsyncIndexerClient) and pipelined streams of both clients against the
real indexer-server (CPU backend), checking answers with the numpy reference selector.

Keys and queries are small integers, so dot products are exact and answers must match exactly.
Needs INDEXER_SERVER_BIN and the installed package on PYTHONPATH (ctest -R python_aio).
"""
import asyncio
import os
import shutil
import sys
import tempfile
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from indexer_client import (AppendResult, AsyncIndexerClient, IndexerClient, IndexerError,  # noqa: E402
                            Selection, ServerInfo, Step, reference_select)
from client_checks import small_ints  # noqa: E402
from server_process import HEAD_DIM, LAYERS, ModuleServer, Server  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python", "examples")
rng = np.random.default_rng(99)
server = ModuleServer()
setUpModule, tearDownModule = server.start, server.stop_checked


def ints(*shape, low=-8, high=8):
    return small_ints(rng, *shape, low=low, high=high)


class AsyncClientTest(unittest.TestCase):
    def run_async(self, test, target=None):
        async def main():
            async with AsyncIndexerClient(target or server.target, timeout=20) as client:
                await client.wait_until_serving()
                await test(client)
        asyncio.run(main())

    def assertSame(self, got, want, what=""):
        np.testing.assert_array_equal(got.block_ids, want.block_ids, err_msg=what)
        self.assertEqual(got.start_position, want.start_position, what)

    def test_every_method(self):
        async def test(c):
            info = await c.server_info()
            self.assertIsInstance(info, ServerInfo)
            self.assertEqual((info.head_dim, info.layers), (HEAD_DIM, LAYERS))
            self.assertEqual(await c.health(), "SERVING")
            keys = ints(300, LAYERS, HEAD_DIM)
            r = await c.append_keys("aio", keys)
            self.assertIsInstance(r, AppendResult)
            self.assertEqual((r.lengths.tolist(), r.num_blocks, r.created), ([300, 300], 3, True))
            q = ints(2, 3, HEAD_DIM)
            sel = await c.select_blocks("aio", q, layer=1, topk=3, timeout=10)
            self.assertIsInstance(sel, Selection)
            self.assertSame(sel, reference_select(keys[:, 1], q, 298, 3, 0, 1))
            k = ints(1, HEAD_DIM)
            results = await c.batch([Step("aio", keys=k, queries=q[:1], topk=2),
                                     Step("aio-missing", queries=q)], return_exceptions=True)
            self.assertSame(results[0], reference_select(np.concatenate([keys[:, 0], k]), q[:1],
                                                         300, 2, 0, 1))
            self.assertEqual(results[1].code, grpc.StatusCode.NOT_FOUND)
            fork = await c.fork("aio", "aio-fork", length=200)
            self.assertEqual(fork.lengths.tolist(), [200, 200])
            self.assertEqual((await c.truncate("aio", 250)).lengths.tolist(), [250, 250])
            seq = await c.get_sequence("aio")
            self.assertEqual((seq.lengths.tolist(), seq.pages.shape), ([250, 250], (2,)))
            stats = await c.get_stats()
            self.assertIn("indexer_requests_total", stats)
            with self.assertRaises(IndexerError) as caught:
                await c.snapshot("x.snap")
            self.assertEqual(caught.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            with self.assertRaises(IndexerError) as caught:
                await c.get_sequence("aio-missing")
            self.assertEqual(caught.exception.code, grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(ValueError):
                await c.select_blocks("aio", ints(1, 2, HEAD_DIM + 1))
            self.assertEqual((await c.release("aio-fork")).pages_freed, 0, "both pages shared")
            self.assertEqual((await c.release("aio")).pages_freed, 2)
        self.run_async(test)

    def test_concurrent_decodes_share_one_client(self):
        async def decode(c, worker):
            sid = f"aio-worker-{worker}"
            keys = ints(100 + 20 * worker, HEAD_DIM)
            await c.append_keys(sid, keys)
            for _ in range(6):
                k, q = ints(1, HEAD_DIM), ints(1, 2, HEAD_DIM)
                got = await c.select_blocks(sid, q, keys=k, topk=2, init_blocks=1)
                keys = np.concatenate([keys, k])
                self.assertSame(got, reference_select(keys, q, len(keys) - 1, 2, 1, 1), sid)
            await c.release(sid)
            return len(keys)

        async def test(c):
            lengths = await asyncio.gather(*(decode(c, w) for w in range(8)))
            self.assertEqual(lengths, [106 + 20 * w for w in range(8)])
        self.run_async(test)

    def test_stream_with_two_micro_batches_in_flight(self):
        async def test(c):
            sids = [f"aio-stream-{i}" for i in range(4)]
            keys = {}
            for sid in sids:
                keys[sid] = ints(126, HEAD_DIM)
                await c.append_keys(sid, keys[sid])
            halves = [sids[:2], sids[2:]]
            async with c.open_stream(max_in_flight=2) as stream:
                for step in range(4):  # crosses into block 1 at position 128
                    sent = []
                    for half in halves:  # both micro-batches go out before either is awaited
                        new = {sid: ints(1, HEAD_DIM) for sid in half}
                        q = {sid: ints(1, 2, HEAD_DIM) for sid in half}
                        future = await stream.submit([Step(sid, keys=new[sid], queries=q[sid],
                                                           topk=2, init_blocks=1) for sid in half])
                        sent.append((half, new, q, future))
                    for half, new, q, future in sent:
                        for sid, got in zip(half, await future):
                            keys[sid] = np.concatenate([keys[sid], new[sid]])
                            want = reference_select(keys[sid], q[sid], len(keys[sid]) - 1, 2, 1, 1)
                            self.assertSame(got, want, f"{sid} step {step}")
                results = await stream.step([Step("aio-stream-missing", queries=ints(1, 1, HEAD_DIM))],
                                            return_exceptions=True)
                self.assertEqual(results[0].code, grpc.StatusCode.NOT_FOUND)
            for sid in sids:
                self.assertEqual((await c.get_sequence(sid)).lengths.tolist(), [130, 0])
                await c.release(sid)
        self.run_async(test)

    def test_blocking_stream_keeps_steps_in_flight(self):
        with IndexerClient(server.target, timeout=20) as c:
            sids = ["sync-stream-a", "sync-stream-b"]
            keys = {sid: ints(200, HEAD_DIM) for sid in sids}
            for sid in sids:
                c.append_keys(sid, keys[sid])
            with c.open_stream() as stream:
                pending = []
                for step in range(6):
                    sid = sids[step % 2]
                    k, q = ints(1, HEAD_DIM), ints(1, 1, HEAD_DIM)
                    keys[sid] = np.concatenate([keys[sid], k])
                    want = reference_select(keys[sid], q, len(keys[sid]) - 1, 3, 0, 1)
                    pending.append((stream.submit([Step(sid, keys=k, queries=q, topk=3)]), want))
                for i, (future, want) in enumerate(pending):
                    self.assertSame(future.result(20)[0], want, f"step {i}")
            for sid in sids:
                self.assertEqual(c.release(sid).pages_freed, 2)

    def test_unix_socket(self):
        folder = tempfile.mkdtemp(prefix="ixpy-", dir="/tmp")
        self.addCleanup(shutil.rmtree, folder, True)
        path = os.path.join(folder, "indexer.sock")
        local = Server(flags=["--device=cpu", f"--head_dim={HEAD_DIM}", "--capacity=8",
                              "--cpu_threads=1", "--not_serving_seconds=0"], listen=f"unix:{path}")
        try:
            async def test(c):
                keys = ints(150, HEAD_DIM)
                await c.append_keys("u", keys)
                q = ints(1, 2, HEAD_DIM)
                self.assertSame(await c.select_blocks("u", q, topk=2),
                                reference_select(keys, q, 149, 2, 0, 1))
                async with c.open_stream() as stream:
                    k = ints(1, HEAD_DIM)
                    got = (await stream.step([Step("u", keys=k, queries=q, topk=2)]))[0]
                self.assertSame(got, reference_select(np.concatenate([keys, k]), q, 150, 2, 0, 1))
            self.run_async(test, target=f"unix://{path}")
        finally:
            status = local.stop()
        self.assertEqual(status, 0, "".join(local.log[-5:]))

    def test_example_async_decode_loop(self):
        import subprocess
        run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "async_decode_loop.py"),
                              "--server", server.target], capture_output=True, text=True, timeout=60)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("done:", run.stdout)


if __name__ == "__main__":
    unittest.main()
