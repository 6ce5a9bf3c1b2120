#!/usr/bin/python3
"""Tests client/python against the real indexer-server (CPU backend) and the numpy reference.

Needs INDEXER_SERVER_BIN (the indexer-server binary) and the installed package on PYTHONPATH:
  PYTHONPATH=<build>/python INDEXER_SERVER_BIN=<build>/server/indexer-server \
      /usr/bin/python3 tests/python/test_client.py
(ctest -R python_client sets both; the build installs the package into <build>/python). Keys and queries are small integers, so every fp32 dot
product is exact and the server must match the reference exactly.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python", "examples")
sys.path.insert(0, HERE)

try:
    import grpc
    import numpy as np
except ImportError as e:
    sys.exit(f"test_client.py: {sys.executable} cannot import {e.name!r} ({e}). Run scripts/setup.sh, "
             "which installs Debian's python3-grpcio, python3-numpy and python3-protobuf.")
try:
    from indexer_client import (AppendResult, ForkResult, IndexerClient,
                                ReleaseResult, Selection, SequenceInfo, ServerInfo, Step,
                                TruncateResult, from_bf16_bytes, reference_select, round_to_bf16,
                                to_bf16_bits, to_bf16_bytes)
except ImportError as e:
    sys.exit(f"test_client.py: {e}\n(PYTHONPATH must hold the installed package: ctest sets "
             "PYTHONPATH=<build>/python, where the build installs it)")
from client_checks import ClientChecks, small_ints  # noqa: E402
from server_process import CAPACITY, HEAD_DIM, LAYERS, ModuleServer, Server, server_binary  # noqa: E402

rng = np.random.default_rng(1234)
server = ModuleServer()
setUpModule, tearDownModule = server.start, server.stop_checked


def ints(*shape, low=-8, high=8):
    return small_ints(rng, *shape, low=low, high=high)


class IndexerClientTest(ClientChecks, unittest.TestCase):
    def setUp(self):
        self.client = IndexerClient(server.target, timeout=20)
        self.addCleanup(self.client.close)
        self.client.wait_until_serving()

    def assertSame(self, got, want, what=""):
        np.testing.assert_array_equal(got.block_ids, want.block_ids, err_msg=f"block_ids {what}")
        if want.page_table is not None:
            np.testing.assert_array_equal(got.page_table, want.page_table, err_msg=f"page_table {what}")
            np.testing.assert_array_equal(got.context_lens, want.context_lens,
                                          err_msg=f"context_lens {what}")
        self.assertEqual(got.start_position, want.start_position, what)

    # --- numpy helpers, no server -------------------------------------------------------------

    def test_bf16_rounding_matches_exact_rounding(self):
        bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
        bits = bits[(bits & 0x7F800000) != 0x7F800000]  # finite
        values = bits.view(np.float32)
        got = to_bf16_bits(values)

        def value(b):  # exact value of bf16 bits, with the all-ones exponent as 2^128
            sign = -1.0 if b & 0x8000 else 1.0
            if (b & 0x7F80) == 0x7F80:
                return sign * 2.0**128
            return float(np.array([b << 16], np.uint32).view(np.float32)[0])

        for x, b, g in zip(values.astype(np.float64), bits, got):
            lo = int(b) >> 16
            hi = lo + 1
            dlo, dhi = abs(x - value(lo)), abs(value(hi) - x)
            want = lo if dlo < dhi or (dlo == dhi and lo % 2 == 0) else hi
            self.assertEqual(int(g), want, f"{x!r}")

        cases = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-20), -0.0, 3.4e38,
                          -3.4e38, np.inf, -np.inf], np.float32)
        self.assertEqual(to_bf16_bits(cases).tolist(),
                         [0x3F80, 0x3F80, 0x3F82, 0xBF81, 0x8000, 0x7F80, 0xFF80, 0x7F80, 0xFF80])
        nan = to_bf16_bits(np.array([np.nan, -np.nan, np.float32(np.uint32(0x7FFFFFFF).view(np.float32))]))
        self.assertTrue(np.isnan(from_bf16_bytes(nan.tobytes())).all())
        x = rng.standard_normal((3, 5, 7)).astype(np.float32)
        back = from_bf16_bytes(to_bf16_bytes(x), x.shape)
        np.testing.assert_array_equal(back, round_to_bf16(x))
        self.assertLessEqual(np.abs(back - x).max(), np.abs(x).max() * 2**-8)

    def test_reference_worked_example_from_spec(self):
        keys, queries = worked_example_inputs()
        s = reference_select(keys, queries, 600, 3, 1, 1, attn_pages=[10, 11, 12, 13, 14],
                             pages_per_block=2, block_page_stride=2)
        self.assertEqual(s.block_ids.tolist(), [[[0, 4, 1]]])
        self.assertEqual(s.page_table.tolist(), [[[20, 21, 22, 23, 28, 29]]])
        self.assertEqual(s.context_lens.tolist(), [[345]])

    # --- the server ---------------------------------------------------------------------------

    def test_server_info_and_health(self):
        self.assertEqual(self.client.health(), "SERVING")
        info = self.client.server_info()
        self.assertIsInstance(info, ServerInfo)
        self.assertEqual((info.backend, info.head_dim, info.layers, info.total_pages),
                         ("cpu", HEAD_DIM, LAYERS, CAPACITY))
        self.assertEqual((info.block_size, info.default_topk, info.default_local_blocks), (128, 16, 1))
        self.assertEqual((info.key_storage, info.tenant), ("bf16", ""))
        self.assertGreater(info.max_query_tokens, 0)
        self.assertGreater(info.max_batch_items, 0)
        self.assertEqual(info.tenant_max_sequences, 0)
        import grpc as grpc_module
        self.assertEqual(len(grpc_module.__path__), 1, "health checks must not extend grpc.__path__")

    def test_results_are_typed_numpy(self):
        sid = self.new_sequence("typed")
        r = self.client.append_keys(sid, ints(300, LAYERS, HEAD_DIM), attention_pages=[4, 5, 6])
        self.assertIsInstance(r, AppendResult)
        self.assertEqual((r.lengths.dtype, r.lengths.shape, r.num_blocks, r.created),
                         (np.int64, (LAYERS,), 3, True))
        sel = self.client.select_blocks(sid, ints(3, 2, HEAD_DIM), topk=4)
        self.assertIsInstance(sel, Selection)
        info = self.client.server_info()
        ppb = info.pages_per_block
        for name, dtype, shape in [("block_ids", np.int32, (3, 2, 4)),
                                   ("page_table", np.int32, (3, 2, 4 * ppb)),
                                   ("context_lens", np.int32, (3, 2)),
                                   ("lengths", np.int64, (LAYERS,)), ("positions", np.int64, (3,))]:
            value = getattr(sel, name)
            self.assertEqual((value.dtype, value.shape), (dtype, shape), name)
        self.assertEqual((sel.num_tokens, sel.num_heads, sel.topk, sel.pages_per_block), (3, 2, 4, ppb))
        self.assertTrue(sel.block_ids.flags.writeable)
        seq = self.client.get_sequence(sid)
        self.assertIsInstance(seq, SequenceInfo)
        self.assertEqual((seq.pages.dtype, seq.pages.shape, seq.attention_pages.tolist()),
                         (np.int32, (3,), [4, 5, 6]))
        fork = self.client.fork(sid, self.new_sequence("typed-fork"), length=129)
        self.assertIsInstance(fork, ForkResult)
        self.assertEqual((fork.lengths.tolist(), fork.num_blocks, fork.pages_shared),
                         ([129, 129], 2, 2))
        cut = self.client.truncate(sid, 10)
        self.assertIsInstance(cut, TruncateResult)
        self.assertEqual((cut.lengths.tolist(), cut.num_blocks), ([10, 10], 1))
        gone = self.client.release(sid)
        self.assertIsInstance(gone, ReleaseResult)
        self.assertEqual(gone.pages_freed, 0, "block 0 is still shared with the fork")

    def test_every_method_takes_a_timeout(self):
        sid = self.new_sequence("timeouts")
        c, t = self.client, 10.0
        c.append_keys(sid, ints(130, HEAD_DIM), timeout=t)
        c.select_blocks(sid, ints(1, 2, HEAD_DIM), timeout=t)
        c.batch([Step(sid, queries=ints(1, 1, HEAD_DIM))], timeout=t)
        c.fork(sid, self.new_sequence("timeouts-fork"), timeout=t)
        c.truncate(sid, 129, timeout=t)
        c.get_sequence(sid, timeout=t)
        c.server_info(timeout=t)
        c.get_stats(timeout=t)
        self.assertEqual(c.health(timeout=t), "SERVING")
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, c.snapshot, "t.snap", timeout=t)
        with c.open_stream(timeout=t) as stream:
            stream.step([Step(sid, queries=ints(1, 1, HEAD_DIM))], timeout=t)
        c.release(sid, timeout=t)
        # That each deadline reaches the server, and an unmet one fails the call: test_wire.py.

    def test_wrong_shapes_are_refused_before_sending(self):
        sid = self.new_sequence("shapes")
        c = self.client
        cases = [
            (lambda: c.select_blocks(sid, ints(2, 4, HEAD_DIM // 2)),
             ["queries", f"(2, 4, {HEAD_DIM // 2})", f"head_dim {HEAD_DIM}", server.target]),
            (lambda: c.append_keys(sid, ints(2, HEAD_DIM // 2)),
             ["keys", f"(2, {HEAD_DIM // 2})", f"head_dim {HEAD_DIM}"]),
            (lambda: c.append_keys(sid, ints(2, LAYERS + 1, HEAD_DIM)),
             ["keys", f"{LAYERS} layers", f"[n][{LAYERS}][{HEAD_DIM}]"]),
            (lambda: c.append_keys(sid, ints(2, HEAD_DIM), all_layers=True),
             ["all-layer", "[n][layers][head_dim]"]),
            (lambda: c.append_keys(sid, ints(0, HEAD_DIM)), ["at least one token"]),
            (lambda: c.select_blocks(sid, ints(4, HEAD_DIM), keys=ints(1, HEAD_DIM * 2)),
             ["keys", f"head_dim {HEAD_DIM}"]),
            (lambda: c.select_blocks(sid, ints(HEAD_DIM)), ["[n][H][head_dim]"]),
            (lambda: c.batch([Step(sid, keys=ints(1, HEAD_DIM)),
                              Step(sid, queries=ints(1, 2, 3 * HEAD_DIM))]),
             ["step 1", f"head_dim {HEAD_DIM}"]),
        ]
        for call, words in cases:
            with self.assertRaises(ValueError) as caught:
                call()
            for word in words:
                self.assertIn(word, str(caught.exception))
        # Nothing of any of them reached the server: not even the good first step of the batch.
        self.assertCode(grpc.StatusCode.NOT_FOUND, c.get_sequence, sid)
        # The right shapes go through, and the answers have the shapes sent (num_tokens n).
        self.assertEqual(c.append_keys(sid, ints(5, HEAD_DIM)).lengths.tolist(), [5, 0])
        self.assertEqual(c.append_keys(sid, ints(HEAD_DIM)).lengths.tolist(), [6, 0])
        self.assertEqual(c.append_keys(sid, ints(2, LAYERS, HEAD_DIM)).lengths.tolist(), [8, 2])
        self.assertEqual(c.select_blocks(sid, ints(2, 4, HEAD_DIM)).block_ids.shape, (2, 4, 16))
        self.assertEqual(c.select_blocks(sid, ints(4, HEAD_DIM)).block_ids.shape, (1, 4, 16))

    def test_fp8_and_fp4_servers_match_the_reference_on_their_storage(self):
        # Small integer keys are not exact in fp4, but every stored value is a short binary
        # fraction: dot products with integer queries stay exact, so answers must be identical.
        for storage, flag in (("fp8_e4m3", "fp8"), ("fp4_e2m1", "fp4")):
            local = Server(flags=["--device=cpu", f"--head_dim={HEAD_DIM}", "--capacity=8",
                                  "--cpu_threads=1", f"--key_dtype={flag}"])
            try:
                with IndexerClient(local.target, timeout=10) as client:
                    client.wait_until_serving()
                    self.assertEqual(client.server_info().key_storage, storage)
                    keys = ints(700, HEAD_DIM) * rng.choice([1, 0.25, 3], (700, HEAD_DIM))
                    client.append_keys("s", keys)
                    for p0, n, topk in ((699, 1, 4), (300, 9, 8), (0, 1, 1)):
                        q = ints(n, 2, HEAD_DIM)
                        got = client.select_blocks("s", q, start_position=p0, topk=topk,
                                                   init_blocks=0, local_blocks=1)
                        want = reference_select(keys, q, p0, topk, 0, 1, key_storage=storage)
                        self.assertSame(got, want, f"{storage} span {p0}+{n}")
            finally:
                self.assertEqual(local.stop(), 0)

    def test_unix_socket_targets(self):
        folder = tempfile.mkdtemp(prefix="ixpy-", dir="/tmp")
        path = os.path.join(folder, "indexer.sock")
        local = Server(flags=["--device=cpu", f"--head_dim={HEAD_DIM}", "--capacity=8",
                              "--cpu_threads=1", "--not_serving_seconds=0"], listen=f"unix:{path}")
        try:
            self.assertTrue(os.path.exists(path), "".join(local.log))
            keys = ints(200, HEAD_DIM)
            for i, target in enumerate([f"unix:{path}", f"unix://{path}"]):
                with IndexerClient(target, timeout=10) as client:
                    client.wait_until_serving()
                    sid = f"unix-{i}"
                    self.assertTrue(client.append_keys(sid, keys).created)
                    q = ints(1, 2, HEAD_DIM)
                    self.assertSame(client.select_blocks(sid, q, topk=2),
                                    reference_select(keys, q, 199, 2, 0, 1), target)
                    with client.open_stream() as stream:
                        k = ints(1, HEAD_DIM)
                        got = stream.step([Step(sid, keys=k, queries=q, topk=2)])[0]
                    self.assertSame(got, reference_select(np.concatenate([keys, k]), q, 200, 2, 0, 1))
                    self.assertEqual(client.release(sid).pages_freed, 2)
        finally:
            status = local.stop()
            shutil.rmtree(folder, ignore_errors=True)
        self.assertEqual(status, 0, "".join(local.log[-5:]))

    def test_get_stats_counts_calls(self):
        before = self.client.get_stats()
        ok = [v for labels, v in before.get("indexer_requests_total", [])
              if labels == {"rpc": "ServerInfo", "code": "OK"}]
        self.client.server_info()
        after = self.client.get_stats()
        now = [v for labels, v in after["indexer_requests_total"]
               if labels == {"rpc": "ServerInfo", "code": "OK"}]
        self.assertEqual(now[0], (ok[0] if ok else 0) + 1)
        (_, total), = after["indexer_pages_capacity"]
        self.assertEqual(total, CAPACITY)
        self.assertIn("indexer_backend_select_seconds", after)

    def test_append_and_get_sequence(self):
        sid = self.new_sequence("append")
        r = self.client.append_keys(sid, ints(130, HEAD_DIM), layer=0)
        self.assertEqual((list(r.lengths), r.num_blocks, r.created), ([130, 0], 2, True))
        r = self.client.append_keys(sid, ints(5, HEAD_DIM), layer=1)
        self.assertEqual((list(r.lengths), r.num_blocks, r.created), ([130, 5], 2, False))
        r = self.client.append_keys(sid, ints(200, LAYERS, HEAD_DIM))  # every layer at once
        self.assertEqual((list(r.lengths), r.num_blocks), ([330, 205], 3))
        r = self.client.append_keys(sid, ints(3, HEAD_DIM), layer=1, wire_dtype="fp32")
        self.assertEqual(list(r.lengths), [330, 208])
        info = self.client.get_sequence(sid)
        self.assertEqual((info.sequence_id, list(info.lengths), len(info.pages), list(info.attention_pages)),
                         (sid, [330, 208], 3, []))

    def test_select_blocks_matches_reference(self):
        sid = self.new_sequence("select")
        keys = ints(700, LAYERS, HEAD_DIM)
        self.client.append_keys(sid, keys[:300])
        self.client.append_keys(sid, keys[300:])
        spans = [(0, 1), (127, 2), (128, 1), (300, 7), (650, 50)]
        params = [(1, 0, 1), (4, 1, 1), (5, 2, 0), (16, 0, 2)]
        for layer in range(LAYERS):
            for (p0, n), (topk, init, local) in zip(spans * 2, params * 3):
                heads = 1 + (p0 + n) % 4
                q = ints(n, heads, HEAD_DIM)
                got = self.client.select_blocks(sid, q, layer=layer, start_position=p0, topk=topk,
                                                init_blocks=init, local_blocks=local)
                want = reference_select(keys[:, layer], q, p0, topk, init, local)
                self.assertSame(got, want, f"layer {layer} span {p0}+{n} params {topk, init, local}")
                self.assertEqual(got.lengths.tolist(), [700, 700])
                self.assertIsNone(got.page_table)
        # Defaults: the span ends at the last token; the server's topk 16, init 0, local 1.
        q = ints(3, 4, HEAD_DIM)
        got = self.client.select_blocks(sid, q, layer=1)
        self.assertSame(got, reference_select(keys[:, 1], q, 697, 16, 0, 1))
        self.assertEqual(got.block_ids[0, 0, 6:].tolist(), [-1] * 10)
        # fp32 queries are rounded to bf16 by the server: x + 2^-10 rounds to x when |x| >= 2.
        q = ints(2, 4, HEAD_DIM, low=2, high=8) * rng.choice([-1, 1], (2, 4, HEAD_DIM))
        fp32 = (q + np.sign(q) * 2**-10).astype(np.float32)
        got = self.client.select_blocks(sid, fp32, topk=4, wire_dtype="fp32")
        self.assertSame(got, reference_select(keys[:, 0], q, 698, 4, 0, 1))

    def test_select_with_append_is_one_decode_step(self):
        sid = self.new_sequence("decode")
        keys = ints(255, HEAD_DIM)
        self.client.append_keys(sid, keys, layer=1)
        for _ in range(3):  # crosses into block 2 at position 256
            k, q = ints(1, HEAD_DIM), ints(4, HEAD_DIM)
            got = self.client.select_blocks(sid, q, layer=1, keys=k, topk=2, init_blocks=1)
            keys = np.concatenate([keys, k])
            self.assertEqual(got.lengths.tolist(), [0, len(keys)])
            self.assertSame(got, reference_select(keys, q[None], len(keys) - 1, 2, 1, 1))
        # Speculative decoding: 3 draft tokens appended and selected together end at the last one.
        k, q = ints(3, HEAD_DIM), ints(3, 2, HEAD_DIM)
        got = self.client.select_blocks(sid, q, layer=1, keys=k, topk=3)
        keys = np.concatenate([keys, k])
        self.assertSame(got, reference_select(keys, q, len(keys) - 3, 3, 0, 1))
        self.assertEqual(got.positions.tolist(), [258, 259, 260])
        # Rejected drafts are rolled back; the next step continues from the kept length.
        self.assertEqual(list(self.client.truncate(sid, 259).lengths), [0, 259])
        k, q = ints(1, HEAD_DIM), ints(1, 1, HEAD_DIM)
        got = self.client.select_blocks(sid, q, layer=1, keys=k, topk=3)
        keys = np.concatenate([keys[:259], k])
        self.assertSame(got, reference_select(keys, q, 259, 3, 0, 1))

    def test_special_scores(self):
        # -0.0 equals +0.0 (ties go to the lower block); NaN dot products (inf - inf) are left
        # out of a block's max, a block with nothing left scores -1e30; +inf beats init's 1e30.
        sid = self.new_sequence("special")
        big = 2.0**127  # finite in bf16; big * big overflows fp32
        q = np.zeros((1, 1, HEAD_DIM), np.float32)
        q[0, 0, :2] = [-big, -big]
        keys = np.zeros((640, HEAD_DIM), np.float32)
        keys[0:128, :2] = [1.0, -1.0]               # b0: 0.0, forced to 1e30 by init_blocks
        keys[128:192, :2] = [big, -big]             # b1: NaN for 64 tokens ...
        keys[192:256, :2] = [2.0**-100, 0.0]        # ... then -2^27
        keys[256:384, :2] = [-1.0, 1.0]             # b2: 0.0 (big - big)
        keys[384:512, :2] = [-big, -big]            # b3: +inf
        keys[512:640, :2] = [-big, big]             # b4: NaN only
        self.client.append_keys(sid, keys)
        want = reference_select(keys, q, 639, 5, 1, 0)
        self.assertEqual(want.block_ids.tolist(), [[[3, 0, 2, 1, 4]]])
        self.assertSame(self.client.select_blocks(sid, q, topk=5, init_blocks=1, local_blocks=0), want)

        zero = self.new_sequence("special-zero")
        keys = np.zeros((256, HEAD_DIM), np.float32)
        keys[128:] = -0.0                           # b0 dots are -0.0, b1 dots are +0.0
        q = np.full((1, 1, HEAD_DIM), -1.0, np.float32)
        self.client.append_keys(zero, keys)
        got = self.client.select_blocks(zero, q, topk=1, init_blocks=0, local_blocks=0)
        self.assertEqual(got.block_ids.tolist(), [[[0]]], "-0.0 must tie with +0.0")
        self.assertSame(got, reference_select(keys, q, 255, 1, 0, 0))

    def test_concurrent_clients(self):
        def decode(worker, errors):
            try:
                sid = self.new_sequence(f"concurrent-{worker}")
                keys = ints(120 + 7 * worker, HEAD_DIM)
                self.client.append_keys(sid, keys)
                for _ in range(12):
                    k, q = ints(1, HEAD_DIM), ints(1, 4, HEAD_DIM)
                    got = self.client.select_blocks(sid, q, keys=k, topk=2, init_blocks=1)
                    keys = np.concatenate([keys, k])
                    want = reference_select(keys, q, len(keys) - 1, 2, 1, 1)
                    if not np.array_equal(got.block_ids, want.block_ids):
                        errors.append(f"{sid} at {len(keys) - 1}: {got.block_ids} != {want.block_ids}")
            except Exception as e:  # reported by the main thread
                errors.append(repr(e))
        errors = []
        threads = [threading.Thread(target=decode, args=(w, errors)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])

    def test_batch(self):
        a, b, c = (self.new_sequence(s) for s in ("batch-a", "batch-b", "batch-c"))
        ka, kb, kc = ints(300, HEAD_DIM), ints(129, HEAD_DIM), ints(10, HEAD_DIM)
        self.client.append_keys(a, ka)
        self.client.append_keys(b, kb)
        k1, k2, qa1, qa2, qb = ints(1, HEAD_DIM), ints(1, HEAD_DIM), ints(1, 2, HEAD_DIM), \
            ints(1, 2, HEAD_DIM), ints(3, 4, HEAD_DIM)
        steps = [
            Step(a, keys=k1, queries=qa1, topk=3),
            Step(b, queries=qb, topk=2, start_position=100),
            Step(c, keys=kc),                                    # append only: creates c
            Step("batch-missing", queries=qb),                  # NOT_FOUND
            Step(a, keys=k2, queries=qa2, topk=3),              # same sequence: applied in order
            Step(b, queries=ints(1, 17, HEAD_DIM)),             # 17 heads > max_index_heads
        ]
        results = self.client.batch(steps, return_exceptions=True)
        ka = np.concatenate([ka, k1])
        self.assertSame(results[0], reference_select(ka, qa1, 300, 3, 0, 1))
        self.assertSame(results[1], reference_select(kb, qb, 100, 2, 0, 1))
        self.assertIsNone(results[2].block_ids)
        self.assertEqual(results[2].lengths.tolist(), [10, 0])
        self.assertEqual((results[3].code, results[3].index), (grpc.StatusCode.NOT_FOUND, 3))
        self.assertSame(results[4], reference_select(np.concatenate([ka, k2]), qa2, 301, 3, 0, 1))
        self.assertEqual(results[5].code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("num_heads", results[5].message)
        self.assertEqual(list(self.client.get_sequence(a).lengths), [302, 0])
        # Without return_exceptions, the first failed item raises, naming its index.
        error = self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.batch,
                                [Step(b, queries=qb), Step("batch-missing", queries=qb)])
        self.assertEqual(error.index, 1)

    def test_stream(self):
        sids = [self.new_sequence(s) for s in ("stream-a", "stream-b")]
        keys = {}  # (sequence, layer) -> that layer's keys so far
        for i, sid in enumerate(sids):
            k = ints(126 + i, LAYERS, HEAD_DIM)
            self.client.append_keys(sid, k)
            keys.update({(sid, layer): k[:, layer] for layer in range(LAYERS)})
        with self.client.open_stream() as stream:
            for step in range(4):  # crosses into block 1 at position 128
                for layer in range(LAYERS):
                    new = {sid: ints(1, HEAD_DIM) for sid in sids}
                    q = {sid: ints(1, 3, HEAD_DIM) for sid in sids}
                    results = stream.step([Step(sid, layer=layer, keys=new[sid], queries=q[sid],
                                                topk=2, init_blocks=1) for sid in sids])
                    for sid, got in zip(sids, results):
                        k = keys[sid, layer] = np.concatenate([keys[sid, layer], new[sid]])
                        self.assertSame(got, reference_select(k, q[sid], len(k) - 1, 2, 1, 1),
                                        f"{sid} step {step} layer {layer}")
            # A failed item is an answer too; the stream stays usable.
            results = stream.step([Step("stream-missing", queries=ints(1, 1, HEAD_DIM))],
                                  return_exceptions=True)
            self.assertEqual(results[0].code, grpc.StatusCode.NOT_FOUND)
            q = ints(1, 1, HEAD_DIM)
            got = stream.step([Step(sids[0], queries=q, topk=1)])
            self.assertSame(got[0], reference_select(keys[sids[0], 0], q, 129, 1, 0, 1))

    def test_attention_page_tables(self):
        info = self.client.server_info()
        ppb, stride = info.pages_per_block, info.block_page_stride
        sid = self.new_sequence("attn")
        keys = ints(250, HEAD_DIM)
        attn = [7, 3]
        self.client.append_keys(sid, keys, layer=0, attention_pages=attn)
        for step in range(10):  # crosses into block 2 at position 256
            k, q = ints(1, HEAD_DIM), ints(1, 4, HEAD_DIM)
            opens = [40 + step] if len(keys) == 256 else []
            attn += opens
            got = self.client.select_blocks(sid, q, keys=k, attention_pages=opens, topk=2,
                                            init_blocks=1)
            keys = np.concatenate([keys, k])
            want = reference_select(keys, q, len(keys) - 1, 2, 1, 1, attn_pages=attn,
                                    pages_per_block=ppb, block_page_stride=stride)
            self.assertSame(got, want, f"step {step}")
            self.assertEqual(got.pages_per_block, ppb)
        self.assertEqual(list(self.client.get_sequence(sid).attention_pages), attn)
        # A span of several tokens, and a full selection (topk > visible blocks).
        q = ints(20, 2, HEAD_DIM)
        got = self.client.select_blocks(sid, q, start_position=200, topk=8, init_blocks=0, local_blocks=2)
        self.assertSame(got, reference_select(keys, q, 200, 8, 0, 2, attn_pages=attn,
                                              pages_per_block=ppb, block_page_stride=stride))
        # local_blocks 0: the tail block may go unselected (context_len min(n_valid * 128, p + 1)).
        got = self.client.select_blocks(sid, q, start_position=240, topk=1, local_blocks=0)
        self.assertSame(got, reference_select(keys, q, 240, 1, 0, 0, attn_pages=attn,
                                              pages_per_block=ppb, block_page_stride=stride))
        # Layer 1 follows the shared block table: no ids, since layer 0 already opened the blocks.
        self.client.append_keys(sid, ints(200, HEAD_DIM), layer=1)
        # Wrong id counts and ids for a sequence without attention pages are refused.
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append_keys, sid,
                        ints(128, HEAD_DIM), attention_pages=[])
        plain = self.new_sequence("attn-none")
        self.client.append_keys(plain, ints(1, HEAD_DIM))
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.append_keys, plain,
                        ints(128, HEAD_DIM), attention_pages=[1])

        # SPEC.md's worked example, through the server.
        ex = self.new_sequence("attn-example")
        keys, queries = worked_example_inputs()
        self.client.append_keys(ex, keys, attention_pages=[10, 11, 12, 13, 14])
        got = self.client.select_blocks(ex, queries, topk=3, init_blocks=1, local_blocks=1)
        self.assertEqual(got.block_ids.tolist(), [[[0, 4, 1]]])
        self.assertEqual(got.context_lens.tolist(), [[345]])
        self.assertEqual(got.page_table[0, 0, :ppb].tolist(), list(range(10 * stride, 10 * stride + ppb)))

    def test_fork_truncate_release(self):
        free = self.client.server_info().free_pages
        src, dst, half = (self.new_sequence(s) for s in ("fork-src", "fork-dst", "fork-half"))
        keys = ints(300, HEAD_DIM)
        self.client.append_keys(src, keys)
        r = self.client.fork(src, dst)
        self.assertEqual((list(r.lengths), r.num_blocks, r.pages_shared), ([300, 0], 3, 3))
        r = self.client.fork(src, half, length=200)
        self.assertEqual((list(r.lengths), r.num_blocks), ([200, 0], 2))
        self.assertEqual(self.client.get_sequence(src).shared_pages, 3)
        self.assertEqual(self.client.server_info().free_pages, free - 3)

        # Writes into shared pages copy them first: each sequence sees only its own keys.
        mine = ints(60, HEAD_DIM)
        self.client.append_keys(half, mine)
        more = ints(5, HEAD_DIM)
        self.client.append_keys(src, more)
        q = ints(1, 4, HEAD_DIM)
        for sid, seq_keys in [(src, np.concatenate([keys, more])), (dst, keys),
                              (half, np.concatenate([keys[:200], mine]))]:
            for p in (199, 255, len(seq_keys) - 1):
                got = self.client.select_blocks(sid, q, start_position=p, topk=3)
                self.assertSame(got, reference_select(seq_keys, q, p, 3, 0, 1), f"{sid} at {p}")

        # Truncate: roll back to 150 tokens, append new ones, select over them.
        r = self.client.truncate(src, 150)
        self.assertEqual((list(r.lengths), r.num_blocks), ([150, 0], 2))
        self.assertEqual(r.pages_freed, 1)  # block 2 was src's own copy
        new = ints(40, HEAD_DIM)
        self.client.append_keys(src, new)
        seq_keys = np.concatenate([keys[:150], new])
        got = self.client.select_blocks(src, ints(2, 4, HEAD_DIM), topk=2)
        self.assertEqual(got.lengths.tolist(), [190, 0])
        q = ints(2, 4, HEAD_DIM)
        self.assertSame(self.client.select_blocks(src, q, topk=2), reference_select(seq_keys, q, 188, 2, 0, 1))
        self.assertSame(self.client.select_blocks(dst, q, start_position=180, topk=2),
                        reference_select(keys, q, 180, 2, 0, 1), "the fork after the source's truncate")

        self.assertCode(grpc.StatusCode.ALREADY_EXISTS, self.client.fork, src, dst)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.fork, "fork-missing", "fork-x")
        freed = sum(self.client.release(s).pages_freed for s in (src, dst, half))
        self.assertEqual(self.client.server_info().free_pages, free)
        self.assertGreater(freed, 0)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.get_sequence, src)
        self.assertTrue(self.client.append_keys(src, keys[:1]).created)  # the id is free again

    def test_errors(self):
        NOT_FOUND, INVALID = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT
        sid = self.new_sequence("errors")
        keys = ints(10, HEAD_DIM)
        self.client.append_keys(sid, keys)
        for bad in (np.nan, np.inf, -np.inf):
            k = ints(2, HEAD_DIM)
            k[1, 5] = bad
            e = self.assertCode(INVALID, self.client.append_keys, sid, k)
            self.assertIn("keys", e.message)
            e = self.assertCode(INVALID, self.client.append_keys, "errors-new", k)
            q = ints(1, 2, HEAD_DIM)
            q[0, 1, 3] = bad
            e = self.assertCode(INVALID, self.client.select_blocks, sid, q, keys=ints(1, HEAD_DIM))
            self.assertIn("queries", e.message)
        big = ints(1, HEAD_DIM)
        big[0, 0] = 3.4e38  # finite in fp32, +Inf in bf16
        self.assertCode(INVALID, self.client.append_keys, sid, big, wire_dtype="fp32")
        # Nothing of a refused request was applied.
        self.assertEqual(list(self.client.get_sequence(sid).lengths), [10, 0])
        self.assertCode(NOT_FOUND, self.client.get_sequence, "errors-new")

        q = ints(1, 2, HEAD_DIM)
        for call in (lambda: self.client.select_blocks("errors-missing", q),
                     lambda: self.client.get_sequence("errors-missing"),
                     lambda: self.client.truncate("errors-missing", 1),
                     lambda: self.client.release("errors-missing")):
            self.assertCode(NOT_FOUND, call)
        self.assertCode(INVALID, self.client.select_blocks, sid, q, topk=0)
        self.assertCode(INVALID, self.client.select_blocks, sid, q, layer=LAYERS)
        self.assertCode(INVALID, self.client.append_keys, "", keys)
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.select_blocks, sid, q,
                        start_position=10)
        # A step whose selection is refused applies nothing, not even the append that created it.
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.select_blocks, "errors-new",
                        q, keys=keys, start_position=10)
        self.assertCode(NOT_FOUND, self.client.get_sequence, "errors-new")
        free = self.client.server_info().free_pages
        self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, self.client.append_keys, sid,
                        np.zeros(((free + 1) * 128, HEAD_DIM), np.float32))
        self.assertEqual(list(self.client.get_sequence(sid).lengths), [10, 0])
        self.assertEqual(self.client.server_info().free_pages, free)

    def test_port_in_use_is_refused(self):
        # A second server on a port that is already served must fail at startup, not share the
        # port with the first one (clients would be spread over two servers' sequences).
        second = subprocess.Popen([server_binary(), "--device=cpu",
                                   f"--listen=127.0.0.1:{server.port}", "--capacity=1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = second.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            second.terminate()
            log, _ = second.communicate()
            self.fail(f"a second indexer-server started on port {server.port}, which the first "
                      f"one serves (gRPC's SO_REUSEPORT); it should refuse:\n{log}")
        self.assertNotEqual(second.returncode, 0, log)
        self.assertIn("cannot listen", log)

    def test_unusable_listen_address_fails_cleanly(self):
        # Startup failure is an error message and exit status 1 (a busy address) or 2 (a value
        # refused: a malformed address), not a crash.
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            for listen, code, message in ((f"127.0.0.1:{taken.getsockname()[1]}", 1, "cannot listen"),
                                          ("not-an-address:port", 2, "--listen is")):
                run = subprocess.run([server_binary(), "--device=cpu",
                                      f"--listen={listen}", "--capacity=1"],
                                     capture_output=True, text=True, timeout=20)
                self.assertEqual(run.returncode, code, f"--listen={listen}: {run.stdout}{run.stderr}")
                self.assertIn(message, run.stdout + run.stderr)

    def test_huge_start_position_is_refused(self):
        # p0 + n must not overflow int64 in the span check. Own server: this one may crash.
        scratch = Server(flags=["--device=cpu", "--head_dim=64", "--capacity=2"])
        try:
            with IndexerClient(scratch.target, timeout=20) as client:
                client.wait_until_serving()
                client.append_keys("huge", ints(10, 64))
                for p0 in (2**63 - 1, 2**63 - 2, 2**62):
                    self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, client.select_blocks,
                                    "huge", ints(2, 1, 64), start_position=p0)
        finally:
            status = scratch.stop()
        self.assertEqual(status, 0, "".join(scratch.log[-5:]))

    def test_example_decode_loop(self):
        example = os.path.join(EXAMPLES, "decode_loop.py")
        run = subprocess.run([sys.executable, example, "--server", server.target],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("done:", run.stdout)


def worked_example_inputs():
    """Keys and a query whose raw block scores at p = 600 are SPEC.md's [0.5, 2, -3, 2, 7]."""
    keys = np.zeros((601, HEAD_DIM), np.float32)
    for b, score in enumerate([0.5, 2.0, -3.0, 2.0, 7.0]):
        keys[128 * b:128 * b + 128, 0] = score
    queries = np.zeros((1, 1, HEAD_DIM), np.float32)
    queries[0, 0, 0] = 1.0
    return keys, queries


if __name__ == "__main__":
    unittest.main()
