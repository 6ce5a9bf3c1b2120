#!/usr/bin/python3
"""Tests tensors by reference (shared-memory regions) through both clients against the real
indexer-server (CPU backend): registering, listing and unregistering regions; keys, queries and
outputs by reference answering exactly as inline bytes do; bounds, unknown regions, duplicate
names, regions unlinked after registering; and a Batch item whose reference is bad failing alone.
Also SystemRegion itself: its views, its bf16 and fp32 writes, and that Python's resource tracker
neither unlinks nor reports regions their creator keeps.

Keys and queries are small integers, so every dot product is exact and answers must match the
numpy reference exactly. Output areas are filled with a sentinel first, so an output the server
did not write is seen. Needs INDEXER_SERVER_BIN and the installed package on PYTHONPATH
(ctest -R python_regions).
"""
import asyncio
import os
import subprocess
import sys
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from indexer_client import (AsyncIndexerClient, IndexerClient, IndexerError, OutputRefs,  # noqa: E402
                            RegionRef, RegionStatus, Step, SystemRegion, TensorRef,
                            reference_select, round_to_bf16)
from client_checks import ClientChecks, small_ints  # noqa: E402
from server_process import HEAD_DIM, LAYERS, ModuleServer  # noqa: E402

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
SENTINEL = -7  # what output areas hold before a call writes them
rng = np.random.default_rng(4321)
server = ModuleServer()
setUpModule, tearDownModule = server.start, server.stop_checked


def ints(*shape, low=-8, high=8):
    return small_ints(rng, *shape, low=low, high=high)


def aligned(offset: int) -> int:
    return (offset + 63) // 64 * 64


def fill_outputs(region: SystemRegion, outputs: OutputRefs) -> None:
    for ref in (outputs.block_ids, outputs.page_table, outputs.context_lens):
        if ref is not None:
            region.array(ref.byte_size // 4, np.int32, ref.offset)[...] = SENTINEL


class SystemRegionTest(unittest.TestCase):
    """The client's shared memory, without a server."""

    def test_writes_reads_and_views(self):
        with SystemRegion.create("local", 4096) as region:
            self.assertTrue(region.key.startswith("/") and region.owner)
            self.assertEqual(region.byte_size, 4096)
            x = rng.standard_normal((3, 5)).astype(np.float32)
            bf16 = region.write(x, 8)
            self.assertEqual((bf16.shape, bf16.dtype, bf16.byte_size), ((3, 5), "bf16", 30))
            np.testing.assert_array_equal(region.read(bf16), round_to_bf16(x))
            fp32 = region.write(x, bf16.end, dtype="fp32")
            np.testing.assert_array_equal(region.read(fp32), x)
            view = region.array((3, 5), "<f4", fp32.offset)
            view[0, 0] = 42.0
            self.assertEqual(region.read(fp32)[0, 0], 42.0, "views write the shared memory")
            del view
            with SystemRegion.attach("local", region.key) as other:  # the same memory
                self.assertFalse(other.owner)
                self.assertEqual(other.read(fp32)[0, 0], 42.0)
            for call in (lambda: region.write(np.zeros(2049), 0),
                         lambda: region.array(8, np.int32, 4090),
                         lambda: region.ref(-1, 4),
                         lambda: region.output_refs(2, 1, 1, 1),
                         lambda: region.read(TensorRef("elsewhere", 0, (1,), "int32")),
                         lambda: region.write(x, 0, dtype="int32")):
                with self.assertRaises(ValueError):
                    call()
            out = region.output_refs(1024, 3, 2, 4, pages_per_block=2)
            self.assertEqual([(r.offset, r.byte_size) for r in
                              (out.block_ids, out.page_table, out.context_lens)],
                             [(1024, 96), (1120, 192), (1312, 24)])
            self.assertEqual(out.end, 1336)
            self.assertEqual(region.output_refs(0, 3, 2, 4), OutputRefs(RegionRef("local", 0, 96)))
        with self.assertRaises(FileNotFoundError):
            SystemRegion.attach("local", region.key)  # leaving the block unlinked it

    def run_python(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ), timeout=60)

    def test_the_creator_owns_unlink(self):
        # A process that creates a region and exits without unlinking leaves it in place, and
        # Python's resource tracker says nothing (it would unlink it and warn of a leak).
        run = self.run_python("from indexer_client import SystemRegion\n"
                              "r = SystemRegion.create('kept', 64)\n"
                              "r.array(4, 'u1')[...] = 9\n"
                              "r.close()\n"
                              "print(r.key)")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual(run.stderr, "", "no resource tracker warning")
        key = run.stdout.strip()
        with SystemRegion.attach("kept", key) as kept:
            self.assertEqual(kept.array(4, "u1").tolist(), [9] * 4)
        # Attaching, unlinking and creating-then-unlinking leave nothing for the tracker either.
        run = self.run_python("from indexer_client import SystemRegion\n"
                              f"a = SystemRegion.attach('kept', {key!r})\n"
                              "a.unlink()\n"
                              "a.close()\n"
                              "with SystemRegion.create('tmp', 64) as r:\n"
                              "    pass\n")
        self.assertEqual((run.returncode, run.stderr), (0, ""))
        with self.assertRaises(FileNotFoundError):
            SystemRegion.attach("kept", key)


class RegionTest(ClientChecks, unittest.TestCase):
    def setUp(self):
        self.client = IndexerClient(server.target, timeout=20)
        self.addCleanup(self.client.close)
        self.client.wait_until_serving()
        self.addCleanup(self.client.unregister_region)
        self.info = self.client.server_info()

    def region(self, name: str, byte_size: int = 1 << 18, register: bool = True) -> SystemRegion:
        """A new region, registered whole unless told not to, removed after the test."""
        region = SystemRegion.create(name, byte_size)
        self.addCleanup(region.__exit__)
        if register:
            self.client.register_system_region(name, region.key, byte_size)
        return region

    def assertSame(self, got, want, what=""):
        for name in ("block_ids", "page_table", "context_lens"):
            if getattr(want, name) is None:
                self.assertIsNone(getattr(got, name), f"{name} {what}")
            else:
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name),
                                              err_msg=f"{name} {what}")
        self.assertEqual(got.start_position, want.start_position, what)

    def lengths(self, sid):
        return self.client.get_sequence(sid).lengths.tolist()

    def test_register_list_unregister(self):
        self.assertGreater(self.info.max_regions, 0)
        a = self.region("reg-a", 4096, register=False)
        b = self.region("reg-b", 8192, register=False)
        c = self.client
        self.assertEqual(c.list_regions(), [])
        c.register_system_region("reg-b", b.key, 4096, offset=4096)
        c.register_system_region("reg-a", a.key, 4096)
        self.assertEqual(c.list_regions(), [RegionStatus("reg-a", "system", a.key, 0, 4096),
                                            RegionStatus("reg-b", "system", b.key, 4096, 4096)])
        self.assertEqual(c.list_regions("reg-b"),
                         [RegionStatus("reg-b", "system", b.key, 4096, 4096)])
        self.assertCode(NOT_FOUND, c.list_regions, "reg-none")
        self.assertCode(grpc.StatusCode.ALREADY_EXISTS, c.register_system_region, "reg-a", b.key,
                        16)
        self.assertCode(NOT_FOUND, c.register_system_region, "reg-c", "/indexer-test-no-such", 16)
        for key, size, offset in ((a.key, 4097, 0), (a.key, 1, 4096), (a.key, 0, 0),
                                  (b.key, 2**64 - 1, 2)):
            self.assertCode(INVALID, c.register_system_region, "reg-c", key, size, offset)
        for name, key in (("", a.key), ("x" * 129, a.key), ("reg-c", "no-slash"),
                          ("reg-c", "/a/b")):
            self.assertCode(INVALID, c.register_system_region, name, key, 16)
        self.assertEqual([r.name for r in c.list_regions()], ["reg-a", "reg-b"])

        # Offsets of references count from the registered offset: reg-b's 0 is b's byte 4096.
        keys = ints(3, HEAD_DIM)
        ref = b.write(keys, 4096)
        sid = self.new_sequence("reg-offset")
        c.append_keys(sid, TensorRef("reg-b", 0, ref.shape))
        q = ints(1, 1, HEAD_DIM)
        self.assertSame(c.select_blocks(sid, q), reference_select(keys, q, 2, 16, 0, 1))

        self.assertEqual(c.unregister_region("reg-a"), 1)
        self.assertCode(NOT_FOUND, c.unregister_region, "reg-a")
        self.assertCode(NOT_FOUND, c.append_keys, sid, TensorRef("reg-a", 0, (1, HEAD_DIM)))
        self.assertEqual([r.name for r in c.list_regions()], ["reg-b"])
        c.register_system_region("reg-a", a.key, 64)  # the name is free again
        self.assertEqual(c.unregister_region(), 2)
        self.assertEqual((c.list_regions(), c.unregister_region()), ([], 0))

    def test_a_cpu_server_takes_no_cuda_regions(self):
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.register_cuda_region,
                        "gpu", bytes(64), 0, 64)
        self.assertEqual(self.client.list_regions(), [])

    def test_keys_and_queries_by_reference_answer_as_inline(self):
        io = self.region("io")
        c = self.client
        inline, byref = self.new_sequence("ref-inline"), self.new_sequence("ref-region")
        one_layer, every_layer = ints(300, HEAD_DIM), ints(130, LAYERS, HEAD_DIM)
        c.append_keys(inline, every_layer)
        c.append_keys(inline, one_layer)
        k1 = io.write(every_layer, 0, dtype="fp32")
        k2 = io.write(one_layer, k1.end)
        self.assertEqual(c.append_keys(byref, k1).lengths.tolist(), [130, 130])
        self.assertEqual(c.append_keys(byref, k2).lengths.tolist(), [430, 130])
        self.assertEqual(self.lengths(byref), self.lengths(inline))
        keys = np.concatenate([every_layer[:, 0], one_layer])

        offset = aligned(k2.end)
        for step, (n, heads, topk, layer) in enumerate([(1, 4, 3, 0), (5, 2, 2, 1), (2, 16, 4, 0)]):
            q, new = ints(n, heads, HEAD_DIM), ints(1, HEAD_DIM)
            want = c.select_blocks(inline, q, keys=new, layer=layer, topk=topk, init_blocks=1)
            qref = io.write(q, offset, dtype="fp32" if step == 1 else "bf16")
            kref = io.write(new, qref.end)
            got = c.select_blocks(byref, qref, keys=kref, layer=layer, topk=topk, init_blocks=1)
            self.assertSame(got, want, f"step {step}")
            self.assertEqual(got.written, {})
            self.assertEqual(got.lengths.tolist(), want.lengths.tolist())
            offset = aligned(kref.end)
            if layer == 0:
                keys = np.concatenate([keys, new])
                self.assertSame(got, reference_select(keys, q, len(keys) - n, topk, 1, 1))

    def test_outputs_by_reference_answer_as_inline(self):
        io = self.region("out")
        c, ppb, stride = self.client, self.info.pages_per_block, self.info.block_page_stride
        plain, paged = self.new_sequence("out-plain"), self.new_sequence("out-paged")
        keys = ints(260, HEAD_DIM)
        c.append_keys(plain, keys)
        c.append_keys(paged, keys, attention_pages=[5, 9, 2])
        q = ints(3, 4, HEAD_DIM)
        for sid in (plain, paged):
            want = c.select_blocks(sid, q, topk=3, start_position=250)
            if sid == paged:
                self.assertSame(want, reference_select(keys, q, 250, 3, 0, 1, attn_pages=[5, 9, 2],
                                                       pages_per_block=ppb,
                                                       block_page_stride=stride))
            # Every output to the region, then only block_ids (the attention outputs inline).
            every = io.output_refs(0, 3, 4, 3, pages_per_block=ppb)
            only_ids = io.output_refs(aligned(every.end), 3, 4, 3)
            for outputs in (every, only_ids):
                fill_outputs(io, outputs)
                got = c.select_blocks(sid, q, topk=3, start_position=250, outputs=outputs)
                self.assertIsNone(got.block_ids)
                self.assertEqual((got.num_tokens, got.num_heads, got.topk), (3, 4, 3))
                written = {"block_ids"} if sid == plain or outputs is only_ids else \
                    {"block_ids", "page_table", "context_lens"}
                self.assertEqual(set(got.written), written, f"{sid}")
                self.assertSame(got.read(io), want, f"{sid} {sorted(written)}")
            # A sequence without attention pages leaves those outputs unwritten.
            untouched = io.array(every.page_table.byte_size // 4, np.int32, every.page_table.offset)
            self.assertEqual(bool((untouched == SENTINEL).all()), sid == plain)
            del untouched

    def test_bad_references_fail_the_call_and_apply_nothing(self):
        small = self.region("small", 4096)
        c = self.client
        sid = self.new_sequence("bad-refs")
        c.append_keys(sid, ints(10, HEAD_DIM))
        key = small.write(ints(1, HEAD_DIM), 0)
        q = small.write(ints(1, 2, HEAD_DIM), 256)
        ok = small.output_refs(512, 1, 2, 4)
        past_end = [TensorRef("small", 4096 - 64, (1, HEAD_DIM)),       # 128 bytes, 64 left
                    TensorRef("small", 2**64 - 64, (1, HEAD_DIM))]      # offset + size overflows
        for bad in past_end:
            for call in (lambda: c.append_keys(sid, bad),
                         lambda: c.select_blocks(sid, bad.reshape((1, 1, HEAD_DIM)), keys=key),
                         lambda: c.select_blocks(sid, q, keys=key, topk=4,
                                                 outputs=OutputRefs(bad.ref))):
                e = self.assertCode(INVALID, call)
                self.assertIn("is not within region", e.message)
        unknown = TensorRef("nowhere", 0, (1, HEAD_DIM))
        self.assertCode(NOT_FOUND, c.append_keys, sid, unknown)
        self.assertCode(NOT_FOUND, c.select_blocks, sid, unknown.reshape((1, 1, HEAD_DIM)),
                        keys=key)
        self.assertCode(NOT_FOUND, c.select_blocks, sid, q, keys=key,
                        outputs=OutputRefs(RegionRef("nowhere", 0, 32)))
        for outputs, words in [
                (OutputRefs(RegionRef("small", 512, 28)), "holds 28 bytes"),        # needs 32
                (OutputRefs(RegionRef("small", 514, 32)), "not a multiple of 4"),
                (OutputRefs(RegionRef("small", 256, 32)), "overlaps"),              # the queries
                (OutputRefs(ok.block_ids, RegionRef("small", 520, 2048)), "overlaps")]:
            e = self.assertCode(INVALID, c.select_blocks, sid, q, keys=key, topk=4,
                                outputs=outputs)
            self.assertIn(words, e.message)
        self.assertEqual(self.lengths(sid), [10, 0], "no failed call appended its keys")
        self.assertIsNone(c.select_blocks(sid, q, keys=key, topk=4, outputs=ok).block_ids)
        self.assertEqual(self.lengths(sid), [11, 0])

    def test_a_region_unlinked_after_registering_still_works(self):
        gone = self.region("gone", 65536)
        c = self.client
        keys, q = ints(200, HEAD_DIM), ints(2, 3, HEAD_DIM)
        kref, qref = gone.write(keys, 0), gone.write(q, 32768)
        outputs = gone.output_refs(40960, 2, 3, 2)
        gone.unlink()
        with self.assertRaises(FileNotFoundError):
            SystemRegion.attach("gone", gone.key)
        self.assertCode(NOT_FOUND, c.register_system_region, "gone-again", gone.key, 64)
        sid = self.new_sequence("unlinked")
        c.append_keys(sid, kref)
        got = c.select_blocks(sid, qref, topk=2, outputs=outputs).read(gone)
        self.assertSame(got, reference_select(keys, q, 198, 2, 0, 1))
        self.assertEqual(c.list_regions("gone")[0].key, gone.key)

    def test_a_bad_reference_fails_only_its_batch_item(self):
        io = self.region("batch-io")
        c = self.client
        a, b = self.new_sequence("batch-ref-a"), self.new_sequence("batch-ref-b")
        ka, kb = ints(140, HEAD_DIM), ints(20, HEAD_DIM)
        c.append_keys(a, ka)
        c.append_keys(b, kb)
        qa, qb, new = ints(1, 2, HEAD_DIM), ints(2, 1, HEAD_DIM), ints(1, HEAD_DIM)
        qa_ref, new_ref, own = io.write(qa, 0), io.write(new, 1024), io.write(new, 2048)
        out_a, out_b = io.output_refs(4096, 1, 2, 2), io.output_refs(8192, 2, 1, 2)
        steps = [
            Step(a, queries=qa_ref, keys=new_ref, topk=2, outputs=out_a),
            Step(b, queries=qb, keys=TensorRef("batch-io", io.byte_size - 8, (1, HEAD_DIM)),
                 topk=2),                                                   # past the end
            Step(b, queries=TensorRef("missing", 0, (1, 1, HEAD_DIM)), keys=new, topk=2),
            Step(b, queries=qb, keys=own, topk=2,                           # output over its keys
                 outputs=OutputRefs(RegionRef("batch-io", own.offset, 16))),
            Step(b, queries=qb, topk=2, outputs=out_b),
        ]
        want_a = reference_select(np.concatenate([ka, new]), qa, 140, 2, 0, 1)
        want_b = reference_select(kb, qb, 18, 2, 0, 1)

        def check(results, what):
            failed = [(e.code, e.index) for e in results[1:4]]
            self.assertEqual(failed, [(INVALID, 1), (NOT_FOUND, 2), (INVALID, 3)], what)
            self.assertSame(results[0].read(io), want_a, what)
            self.assertSame(results[4].read(io), want_b, what)
            self.assertEqual(self.lengths(a), [141, 0], what)
            self.assertEqual(self.lengths(b), [20, 0], f"{what}: failed items appended nothing")
            c.truncate(a, 140)
            for outputs in (out_a, out_b):
                fill_outputs(io, outputs)

        for outputs in (out_a, out_b):
            fill_outputs(io, outputs)
        check(c.batch(steps, return_exceptions=True), "batch")
        with c.open_stream() as stream:
            check(stream.step(steps, return_exceptions=True), "stream")

        async def run():
            async with AsyncIndexerClient(server.target, timeout=20) as ac:
                check(await ac.batch(steps, return_exceptions=True), "aio batch")
                async with ac.open_stream() as stream:
                    check(await stream.step(steps, return_exceptions=True), "aio stream")
        asyncio.run(run())

    def test_the_async_client(self):
        io = self.region("aio", register=False)
        keys, q = ints(150, HEAD_DIM), ints(1, 3, HEAD_DIM)
        kref, qref = io.write(keys, 0), io.write(q, 32768)
        outputs = io.output_refs(40960, 1, 3, 2)

        async def run():
            async with AsyncIndexerClient(server.target, timeout=20) as ac:
                await ac.register_system_region("aio", io.key, io.byte_size)
                self.assertEqual(await ac.list_regions("aio"),
                                 [RegionStatus("aio", "system", io.key, 0, io.byte_size)])
                with self.assertRaises(IndexerError) as caught:
                    await ac.register_system_region("aio", io.key, io.byte_size)
                self.assertEqual(caught.exception.code, grpc.StatusCode.ALREADY_EXISTS)
                await ac.append_keys("aio-seq", kref)
                got = await ac.select_blocks("aio-seq", qref, topk=2, outputs=outputs)
                self.assertSame(got.read(io), reference_select(keys, q, 149, 2, 0, 1))
                await ac.release("aio-seq")
                self.assertEqual(await ac.unregister_region("aio"), 1)
                self.assertEqual(await ac.list_regions(), [])
        asyncio.run(run())


if __name__ == "__main__":
    unittest.main()
