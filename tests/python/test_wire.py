#!/usr/bin/python3
"""What the Python clients put on the wire, recorded by a fake in-process server.

The fake (a grpc.server with the package's generated servicers) records every request with the
deadline it arrived with, answers with shapes taken from the request, and can hold or misnumber
stream answers. So these tests see, independently of the real server's own checks:
  * every request carries num_tokens (appends, selections, batches, streams, both clients);
  * wrong shapes are refused before anything is sent, with a message that says what is wrong;
  * every method's timeout= reaches the server as the call's deadline, and an unmet one fails;
  * stream answers are matched to their requests, in order, with several in flight;
  * tensors convert as promised: numpy dtypes, and torch tensors through a stand-in object
    (torch itself is not installed here; the stand-in implements only the calls tensors.py makes);
  * tensors by reference travel as keys_ref / queries_ref / output_refs with num_tokens, and
    answers say which outputs went to a region.
Needs the installed package on PYTHONPATH (ctest -R python_wire).
"""
import asyncio
import concurrent.futures
import os
import queue
import subprocess
import sys
import threading
import time
import types
import unittest

import grpc
import numpy as np

from indexer_client import (AsyncIndexerClient, IndexerClient, IndexerError, OutputRefs,
                            RegionRef, RegionStatus, Step, SystemRegion, TensorRef, to_bf16_bits,
                            to_bf16_bytes)
from indexer_client._channel import DEFAULT
from indexer_client._proto import health_pb2, health_pb2_grpc
from indexer_client._proto import indexer_pb2 as pb
from indexer_client._proto import indexer_pb2_grpc as pb_grpc
from indexer_client.tensors import wire_values

HEAD_DIM, LAYERS = 128, 3
fake = None  # the FakeServer, set by setUpModule


def selection_for(request, start_position):
    """An answer shaped by the request: n tokens (num_tokens), H heads, topk 1; block_ids left
    empty when the request names a reference for them, as the server does."""
    n, h = request.num_tokens, request.num_heads
    written = request.output_refs.HasField("block_ids")
    block_ids = b"" if written else np.arange(n * h, dtype="<i4").tobytes()
    return pb.SelectBlocksResponse(num_tokens=n, num_heads=h, topk=1, start_position=start_position,
                                   block_ids=block_ids, lengths=[7] * LAYERS)


class FakeIndexer(pb_grpc.IndexerServicer, pb_grpc.IndexerAdminServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.calls = []  # (method, request, seconds left of its deadline or None, metadata)
        self.hold = False          # stream answers wait for `gate`
        self.gate = threading.Semaphore(0)
        self.id_offset = 0         # added to stream answers' request_id

    def record(self, method, request, context):
        with self.lock:
            self.calls.append((method, request, context.time_remaining(),
                               dict(context.invocation_metadata())))

    def requests(self, method):
        with self.lock:
            return [r for m, r, _, _ in self.calls if m == method]

    def stall_if_asked(self, request, context):
        # A sequence named "slow" is answered only once the caller gives up.
        if getattr(request, "sequence_id", "") == "slow":
            while context.is_active():
                time.sleep(0.01)

    def ServerInfo(self, request, context):
        self.record("ServerInfo", request, context)
        return pb.ServerInfoResponse(head_dim=HEAD_DIM, layers=LAYERS, backend="fake",
                                     key_storage=pb.KEY_STORAGE_BF16)

    def AppendKeys(self, request, context):
        self.record("AppendKeys", request, context)
        self.stall_if_asked(request, context)
        return pb.AppendKeysResponse(lengths=[request.num_tokens] * LAYERS, num_blocks=1,
                                     created=True)

    def SelectBlocks(self, request, context):
        self.record("SelectBlocks", request, context)
        self.stall_if_asked(request, context)
        return selection_for(request, 0)

    def _batch_answer(self, request, request_id):
        results = []
        for i, item in enumerate(request.items):
            selects = item.queries or item.HasField("queries_ref")
            answer = selection_for(item, request.request_id * 100 + i) if selects else \
                pb.SelectBlocksResponse(lengths=[item.append.num_tokens] * LAYERS)
            results.append(pb.BatchItemResult(code=0, result=answer))
        return pb.BatchResponse(request_id=request_id, results=results)

    def Batch(self, request, context):
        self.record("Batch", request, context)
        return self._batch_answer(request, request.request_id)

    def BatchStream(self, request_iterator, context):
        # Requests are read (and recorded) as they arrive, while answers wait for the gate.
        arrived = queue.Queue()

        def read():
            try:
                for request in request_iterator:
                    self.record("BatchStream", request, context)
                    arrived.put(request)
            except grpc.RpcError:
                pass  # the client cancelled the stream
            finally:
                arrived.put(None)
        threading.Thread(target=read, daemon=True).start()
        for request in iter(arrived.get, None):
            if self.hold:
                self.gate.acquire(timeout=5)  # bounded, so a failing test cannot hang
            yield self._batch_answer(request, request.request_id + self.id_offset)

    def ReleaseSequence(self, request, context):
        self.record("ReleaseSequence", request, context)
        return pb.ReleaseSequenceResponse(pages_freed=2)

    def TruncateSequence(self, request, context):
        self.record("TruncateSequence", request, context)
        return pb.TruncateSequenceResponse(lengths=[request.length] * LAYERS)

    def ForkSequence(self, request, context):
        self.record("ForkSequence", request, context)
        return pb.ForkSequenceResponse(lengths=[1] * LAYERS, pages_shared=1)

    def GetSequence(self, request, context):
        self.record("GetSequence", request, context)
        self.stall_if_asked(request, context)
        return pb.GetSequenceResponse(sequence_id=request.sequence_id, lengths=[1] * LAYERS,
                                      pages=[3])

    def GetStats(self, request, context):
        self.record("GetStats", request, context)
        return pb.GetStatsResponse()

    def RegisterSystemRegion(self, request, context):
        self.record("RegisterSystemRegion", request, context)
        return pb.RegisterSystemRegionResponse()

    def UnregisterRegion(self, request, context):
        self.record("UnregisterRegion", request, context)
        return pb.UnregisterRegionResponse(unregistered=3 if not request.name else 1)

    def ListRegions(self, request, context):
        self.record("ListRegions", request, context)
        return pb.ListRegionsResponse(regions=[pb.RegionStatus(
            name=request.name or "r", kind="system", key="/k", offset=8, byte_size=64)])

    def Snapshot(self, request, context):
        self.record("Snapshot", request, context)
        return pb.SnapshotResponse(path="/x/" + request.name)


class FakeHealth(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        fake.servicer.record("Check", request, context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class FakeServer:
    def __init__(self):
        self.servicer = FakeIndexer()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_IndexerServicer_to_server(self.servicer, self.server)
        pb_grpc.add_IndexerAdminServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def setUpModule():
    global fake
    fake = FakeServer()


def tearDownModule():
    fake.server.stop(grace=None)


def floats(*shape):
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


class WireTest(unittest.TestCase):
    def setUp(self):
        fake.servicer.reset()
        self.client = IndexerClient(fake.target, timeout=30)
        self.addCleanup(self.client.close)

    def assertNumTokens(self, request, n):
        self.assertTrue(request.HasField("num_tokens"), request)
        self.assertEqual(request.num_tokens, n)

    def test_every_request_carries_num_tokens(self):
        c = self.client
        self.assertEqual(c.append_keys("a", floats(5, HEAD_DIM)).lengths.tolist(), [5] * LAYERS)
        c.append_keys("a", floats(HEAD_DIM))                       # one token, [head_dim]
        c.append_keys("a", floats(4, LAYERS, HEAD_DIM))            # every layer
        appends = fake.servicer.requests("AppendKeys")
        for request, n, all_layers in zip(appends, [5, 1, 4], [False, False, True]):
            self.assertNumTokens(request, n)
            self.assertEqual(request.all_layers, all_layers)
            self.assertEqual(len(request.keys), n * (LAYERS if all_layers else 1) * HEAD_DIM * 2)

        sel = c.select_blocks("a", floats(3, 2, HEAD_DIM), keys=floats(2, HEAD_DIM))
        self.assertEqual(sel.block_ids.shape, (3, 2, 1), "the answer has the shape sent")
        c.select_blocks("a", floats(4, HEAD_DIM))                  # one token, [H][head_dim]
        first, second = fake.servicer.requests("SelectBlocks")
        self.assertNumTokens(first, 3)
        self.assertEqual(first.num_heads, 2)
        self.assertNumTokens(first.append, 2)
        self.assertNumTokens(second, 1)
        self.assertFalse(second.HasField("append"))

        steps = [Step("a", queries=floats(2, 1, HEAD_DIM)), Step("b", keys=floats(6, HEAD_DIM)),
                 Step("c", keys=floats(1, LAYERS, HEAD_DIM), queries=floats(1, 3, HEAD_DIM))]
        results = c.batch(steps)
        self.assertEqual([r.num_tokens for r in results], [2, 0, 1])
        with c.open_stream() as stream:
            stream.step(steps)
        for request in fake.servicer.requests("Batch") + fake.servicer.requests("BatchStream"):
            a, b, cc = request.items
            self.assertNumTokens(a, 2)
            self.assertFalse(a.HasField("append"))
            self.assertFalse(b.HasField("num_tokens"), "an append-only item selects nothing")
            self.assertNumTokens(b.append, 6)
            self.assertNumTokens(cc, 1)
            self.assertNumTokens(cc.append, 1)
            self.assertTrue(cc.append.all_layers)

    def test_wrong_shapes_are_refused_before_sending(self):
        c = self.client
        cases = [
            (lambda: c.select_blocks("w1", floats(2, 4, 64)),
             "queries has shape (2, 4, 64) ([n][H][head_dim]) but the server at "
             f"{fake.target} has head_dim 128: the last dimension must be 128"),
            (lambda: c.append_keys("w1", floats(2, 64)),
             f"keys has shape (2, 64) ([n][head_dim]) but the server at {fake.target} has "
             "head_dim 128"),
            (lambda: c.append_keys("w1", floats(2, 2, HEAD_DIM)),
             f"has {LAYERS} layers: an all-layer append takes [n][{LAYERS}][{HEAD_DIM}]"),
            (lambda: c.select_blocks("w1", floats(1, 1, HEAD_DIM), keys=floats(1, 2, 3, 4)),
             "keys has shape (1, 2, 3, 4); a one-layer append takes [n][head_dim]"),
            (lambda: c.select_blocks("w1", floats(0, 1, HEAD_DIM)), "at least one token"),
            (lambda: c.batch([Step("ok", queries=floats(1, 1, HEAD_DIM)),
                              Step("w1", queries=floats(1, 1, 64))]), "step 1 ('w1'): queries"),
            (lambda: c.append_keys("w1", np.ones((2, HEAD_DIM), bool)), "dtype bool"),
        ]
        for call, words in cases:
            with self.assertRaises((ValueError, TypeError)) as caught:
                call()
            self.assertIn(words, str(caught.exception))
        with c.open_stream() as stream:
            with self.assertRaises(ValueError):
                stream.submit([Step("w1", queries=floats(1, 1, 64))])
            self.assertEqual(stream.in_flight, 0)
        sent = {m for m, _, _, _ in fake.servicer.calls}
        self.assertEqual(sent, {"ServerInfo"}, "nothing but ServerInfo may have been sent")
        self.assertEqual(len(fake.servicer.requests("ServerInfo")), 1, "ServerInfo is asked once")

    def test_without_shape_checks_the_count_is_still_sent(self):
        unchecked = IndexerClient(fake.target, check_shapes=False)
        self.addCleanup(unchecked.close)
        self.assertEqual(unchecked.select_blocks("w1", floats(2, 4, 64)).block_ids.shape, (2, 4, 1))
        (request,) = fake.servicer.requests("SelectBlocks")
        self.assertNumTokens(request, 2)
        self.assertEqual(fake.servicer.requests("ServerInfo"), [])

    def test_routing_header_and_token(self):
        with IndexerClient(fake.target, token="tok-1") as c:
            c.get_sequence("seq-7")
            c.batch([Step("seq-7", queries=floats(1, 1, HEAD_DIM))] * 2)
            c.batch([Step("seq-7", keys=floats(1, HEAD_DIM)), Step("seq-8", keys=floats(1, HEAD_DIM))])
        calls = {m: md for m, _, _, md in fake.servicer.calls}
        self.assertEqual(calls["GetSequence"]["x-sequence-id"], "seq-7")
        self.assertEqual(calls["GetSequence"]["authorization"], "Bearer tok-1")
        batches = [md for m, _, _, md in fake.servicer.calls if m == "Batch"]
        self.assertEqual(batches[0].get("x-sequence-id"), "seq-7")
        self.assertNotIn("x-sequence-id", batches[1], "two sequences: no single route")

    def test_every_method_sends_its_timeout(self):
        c = self.client
        c.server_info(timeout=7)
        calls = timed_calls(c)
        check_deadlines(self, calls)
        self.assertEqual(c.snapshot("s").path, "/x/s")

    def test_unmet_deadline_fails_the_call(self):
        c = self.client
        c.server_info()
        for call in (lambda: c.get_sequence("slow", timeout=0.2),
                     lambda: c.append_keys("slow", floats(1, HEAD_DIM), timeout=0.2),
                     lambda: c.select_blocks("slow", floats(1, 1, HEAD_DIM), timeout=0.2)):
            with self.assertRaises(IndexerError) as caught:
                call()
            self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)


def no_deadline(seconds_left) -> bool:
    # grpc's server reports a call without a deadline as None or as about 2**63 seconds.
    return seconds_left is None or seconds_left > 1e9


def timed_calls(c):
    """One call of every method of client `c` (blocking or asyncio: a lambda returns what the
    method returns), by the gRPC method it makes, each with timeout=t."""
    return {
        "AppendKeys": lambda t: c.append_keys("t", floats(1, HEAD_DIM), timeout=t),
        "SelectBlocks": lambda t: c.select_blocks("t", floats(1, 1, HEAD_DIM), timeout=t),
        "Batch": lambda t: c.batch([Step("t", keys=floats(1, HEAD_DIM))], timeout=t),
        "ReleaseSequence": lambda t: c.release("t", timeout=t),
        "TruncateSequence": lambda t: c.truncate("t", 1, timeout=t),
        "ForkSequence": lambda t: c.fork("t", "u", timeout=t),
        "GetSequence": lambda t: c.get_sequence("t", timeout=t),
        "ServerInfo": lambda t: c.server_info(timeout=t),
        "GetStats": lambda t: c.get_stats(timeout=t),
        "Snapshot": lambda t: c.snapshot("s", timeout=t),
        "Check": lambda t: c.health(timeout=t),
        "RegisterSystemRegion": lambda t: c.register_system_region("r", "/k", 8, timeout=t),
        "UnregisterRegion": lambda t: c.unregister_region("r", timeout=t),
        "ListRegions": lambda t: c.list_regions(timeout=t),
    }


# Each timeout= given, and what the server must see of it (the client's default is 30 s).
DEADLINES = ((7, lambda s: 5 < s <= 7.5), (None, no_deadline),
             (DEFAULT, lambda s: 25 < s <= 30.5))


def check_deadlines(test, calls):
    """Runs each call with every timeout of DEADLINES and checks the deadline it arrived with."""
    for method, call in calls.items():
        for timeout, ok in DEADLINES:
            fake.servicer.reset()
            call(timeout)
            (_, _, left, _), = [c for c in fake.servicer.calls if c[0] == method]
            test.assertTrue(ok(left), f"{method} timeout={timeout}: {left} s left")


class StreamTest(unittest.TestCase):
    """The blocking BatchStream with several batches in flight."""

    def setUp(self):
        fake.servicer.reset()
        self.client = IndexerClient(fake.target, timeout=30)
        self.addCleanup(self.client.close)
        self.addCleanup(lambda: [fake.servicer.gate.release() for _ in range(20)])

    def steps(self, k):
        return [Step(f"s{k}", queries=floats(1, 1, HEAD_DIM))]

    def test_answers_match_requests_in_order(self):
        fake.servicer.hold = True
        with self.client.open_stream() as stream:
            futures = [stream.submit(self.steps(k)) for k in range(4)]
            deadline = time.monotonic() + 10
            while len(fake.servicer.requests("BatchStream")) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertEqual(stream.in_flight, 4, "four batches in flight at once")
            self.assertFalse(any(f.done() for f in futures))
            fake.servicer.gate.release()
            self.assertEqual(futures[0].result(10)[0].start_position, 100)
            self.assertFalse(futures[1].done())
            for _ in range(3):
                fake.servicer.gate.release()
            self.assertEqual([f.result(10)[0].start_position for f in futures],
                             [100, 200, 300, 400])
        self.assertEqual([r.request_id for r in fake.servicer.requests("BatchStream")], [1, 2, 3, 4])

    def test_step_timeout_keeps_the_stream(self):
        fake.servicer.hold = True
        with self.client.open_stream() as stream:
            with self.assertRaises(IndexerError) as caught:
                stream.step(self.steps(0), timeout=0.2)
            self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            fake.servicer.gate.release()
            fake.servicer.gate.release()
            self.assertEqual(stream.step(self.steps(1), timeout=10)[0].start_position, 200)

    def test_max_in_flight_blocks_submit(self):
        fake.servicer.hold = True
        with self.client.open_stream(max_in_flight=1) as stream:
            first = stream.submit(self.steps(0))
            second = []
            thread = threading.Thread(target=lambda: second.append(stream.submit(self.steps(1))))
            thread.start()
            thread.join(0.3)
            self.assertTrue(thread.is_alive(), "a second submit must wait for the first answer")
            fake.servicer.gate.release()
            thread.join(10)
            self.assertEqual(first.result(10)[0].start_position, 100)
            fake.servicer.gate.release()
            self.assertEqual(second[0].result(10)[0].start_position, 200)

    def test_a_submit_waiting_for_a_slot_times_out_sending_nothing(self):
        fake.servicer.hold = True
        with self.client.open_stream(max_in_flight=1) as stream:
            first = stream.submit(self.steps(0))
            start = time.monotonic()
            with self.assertRaises(IndexerError) as caught:
                stream.submit(self.steps(1), timeout=0.2)
            self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            self.assertIn("was not sent", caught.exception.message)
            self.assertLess(time.monotonic() - start, 5)
            with self.assertRaises(IndexerError) as caught:  # step's timeout covers the wait
                stream.step(self.steps(1), timeout=0.2)
            self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            fake.servicer.gate.release()
            self.assertEqual(first.result(10)[0].start_position, 100)
            fake.servicer.gate.release()
            # Nothing of the refused submits was sent: the next batch is the second one.
            self.assertEqual(stream.step(self.steps(1), timeout=10)[0].start_position, 200)

    def test_misnumbered_answer_fails_the_stream(self):
        fake.servicer.id_offset = 5
        stream = self.client.open_stream()
        future = stream.submit(self.steps(0))
        with self.assertRaises(IndexerError) as caught:
            future.result(10)
        self.assertEqual(caught.exception.code, grpc.StatusCode.INTERNAL)
        self.assertIn("answered request 6", caught.exception.message)
        with self.assertRaises(IndexerError):
            stream.submit(self.steps(1))
        stream.close()

    def test_submit_after_close_is_refused(self):
        stream = self.client.open_stream()
        self.assertEqual(len(stream.step(self.steps(0))), 1)
        stream.close()
        with self.assertRaises(IndexerError) as caught:
            stream.submit(self.steps(1))
        self.assertIn("closed", caught.exception.message)


class AsyncWireTest(unittest.TestCase):
    """The asyncio client: the same requests, deadlines and stream matching."""

    def setUp(self):
        fake.servicer.reset()
        self.addCleanup(lambda: [fake.servicer.gate.release() for _ in range(20)])

    def run_async(self, test):
        async def main():
            async with AsyncIndexerClient(fake.target, timeout=30) as client:
                await test(client)
        asyncio.run(main())

    def test_num_tokens_and_refused_shapes(self):
        async def test(c):
            await c.append_keys("a", floats(4, LAYERS, HEAD_DIM))
            await c.select_blocks("a", floats(3, 2, HEAD_DIM), keys=floats(2, HEAD_DIM))
            results = await c.batch([Step("a", queries=floats(2, 1, HEAD_DIM))])
            self.assertEqual(results[0].block_ids.shape, (2, 1, 1))
            with self.assertRaises(ValueError) as caught:
                await c.select_blocks("w1", floats(2, 4, 64))
            self.assertIn("queries has shape (2, 4, 64)", str(caught.exception))
            self.assertIn("head_dim 128", str(caught.exception))
        self.run_async(test)
        (append,) = fake.servicer.requests("AppendKeys")
        self.assertEqual((append.num_tokens, append.all_layers), (4, True))
        (select,) = fake.servicer.requests("SelectBlocks")
        self.assertEqual((select.num_tokens, select.append.num_tokens), (3, 2))
        self.assertEqual(fake.servicer.requests("Batch")[0].items[0].num_tokens, 2)
        self.assertEqual(len(fake.servicer.requests("ServerInfo")), 1)

    def test_every_method_sends_its_timeout(self):
        async def test(c):
            await c.server_info()
            calls = timed_calls(c)
            for method, call in calls.items():
                for timeout, ok in DEADLINES:
                    fake.servicer.reset()
                    await call(timeout)
                    (_, _, left, _), = [x for x in fake.servicer.calls if x[0] == method]
                    self.assertTrue(ok(left), f"{method} timeout={timeout}: {left} s left")
            with self.assertRaises(IndexerError) as caught:
                await c.get_sequence("slow", timeout=0.2)
            self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.run_async(test)

    def test_stream_in_flight_in_order(self):
        steps = [Step("s", queries=floats(1, 1, HEAD_DIM))]

        async def test(c):
            fake.servicer.hold = True
            async with c.open_stream() as stream:
                futures = [await stream.submit(steps) for _ in range(3)]
                self.assertEqual(stream.in_flight, 3)
                with self.assertRaises(IndexerError) as caught:
                    await stream.step(steps, timeout=0.2)
                self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                for _ in range(4):
                    fake.servicer.gate.release()
                got = [(await f)[0].start_position for f in futures]
                self.assertEqual(got, [100, 200, 300])
                fake.servicer.gate.release()
                self.assertEqual((await stream.step(steps, timeout=10))[0].start_position, 500)
            fake.servicer.hold = False
            fake.servicer.id_offset = 1
            stream = c.open_stream()
            with self.assertRaises(IndexerError) as caught:
                await stream.step(steps)
            self.assertEqual(caught.exception.code, grpc.StatusCode.INTERNAL)
            await stream.close()
        self.run_async(test)

    def test_a_submit_waiting_for_a_slot_times_out_sending_nothing(self):
        steps = [Step("s", queries=floats(1, 1, HEAD_DIM))]

        async def test(c):
            fake.servicer.hold = True
            async with c.open_stream(max_in_flight=1) as stream:
                first = await stream.submit(steps)
                with self.assertRaises(IndexerError) as caught:
                    await stream.submit(steps, timeout=0.2)
                self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                self.assertIn("was not sent", caught.exception.message)
                with self.assertRaises(IndexerError) as caught:  # step's timeout covers the wait
                    await stream.step(steps, timeout=0.2)
                self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                fake.servicer.gate.release()
                self.assertEqual((await first)[0].start_position, 100)
                fake.servicer.gate.release()
                self.assertEqual((await stream.step(steps, timeout=10))[0].start_position, 200)
        self.run_async(test)


class ReferenceWireTest(unittest.TestCase):
    """Tensors by reference: what the requests carry, and what the answers say."""

    def setUp(self):
        fake.servicer.reset()
        self.client = IndexerClient(fake.target, timeout=30)
        self.addCleanup(self.client.close)
        self.region = SystemRegion.create("io", 1 << 16)
        self.addCleanup(self.region.__exit__)

    def assertRef(self, proto, ref):
        self.assertEqual((proto.region, proto.offset, proto.byte_size),
                         (ref.region, ref.offset, ref.byte_size))

    def test_references_carry_num_tokens_and_their_dtype(self):
        c, region = self.client, self.region
        keys = region.write(floats(5, HEAD_DIM))
        every_layer = region.write(floats(2, LAYERS, HEAD_DIM), keys.end, dtype="fp32")
        c.append_keys("a", keys)
        c.append_keys("a", every_layer, wire_dtype="bf16")  # the reference's dtype wins
        one, two = fake.servicer.requests("AppendKeys")
        for request, ref, n, dtype in ((one, keys, 5, pb.VALUE_DTYPE_BF16),
                                       (two, every_layer, 2, pb.VALUE_DTYPE_FP32)):
            self.assertEqual(request.keys, b"", "no inline bytes with a reference")
            self.assertRef(request.keys_ref, ref)
            self.assertEqual((request.num_tokens, request.dtype), (n, dtype))
        self.assertEqual((one.all_layers, two.all_layers), (False, True))
        self.assertEqual(two.keys_ref.byte_size, 2 * LAYERS * HEAD_DIM * 4)

        queries = region.write(floats(3, 2, HEAD_DIM), every_layer.end)
        outputs = region.output_refs(queries.end, 3, 2, 1)
        sel = c.select_blocks("a", queries, keys=keys, outputs=outputs)
        (request,) = fake.servicer.requests("SelectBlocks")
        self.assertEqual((request.queries, request.num_tokens, request.num_heads), (b"", 3, 2))
        self.assertRef(request.queries_ref, queries)
        self.assertRef(request.append.keys_ref, keys)
        self.assertRef(request.output_refs.block_ids, outputs.block_ids)
        self.assertFalse(request.output_refs.HasField("page_table"))
        self.assertIsNone(sel.block_ids, "the answer's block_ids went to the region")
        self.assertEqual(sel.written["block_ids"],
                         TensorRef("io", outputs.block_ids.offset, (3, 2, 1), "int32"))
        self.assertEqual((sel.num_tokens, sel.num_heads, sel.topk), (3, 2, 1))
        region.array((3, 2, 1), np.int32, outputs.block_ids.offset)[...] = 5
        read = sel.read(region)
        self.assertEqual((read.block_ids.tolist(), read.written), ([[[5]] * 2] * 3, {}))
        with self.assertRaises(ValueError):
            sel.read()

    def test_batches_and_streams_mark_each_items_outputs(self):
        region = self.region
        queries = region.write(floats(1, 4, HEAD_DIM))
        outputs = OutputRefs(block_ids=RegionRef("io", 4096, 16))
        steps = [Step("a", queries=floats(1, 1, HEAD_DIM)),
                 Step("b", queries=queries, outputs=outputs),
                 Step("c", keys=region.write(floats(1, HEAD_DIM), 8192))]

        def check(results):
            self.assertEqual(results[0].block_ids.shape, (1, 1, 1))
            self.assertEqual(results[0].written, {})
            self.assertIsNone(results[1].block_ids)
            self.assertEqual(results[1].written["block_ids"].shape, (1, 4, 1))
            self.assertEqual(results[2].num_tokens, 0)

        check(self.client.batch(steps))
        with self.client.open_stream() as stream:
            check(stream.step(steps))

        async def run():
            async with AsyncIndexerClient(fake.target, timeout=30) as c:
                check(await c.batch(steps))
                check([await c.select_blocks("a", floats(1, 1, HEAD_DIM))] +
                      [await c.select_blocks("b", queries, outputs=outputs)] +
                      [(await c.batch(steps[2:]))[0]])
                async with c.open_stream() as stream:
                    check(await stream.step(steps))
        asyncio.run(run())
        sent = fake.servicer.requests("Batch") + fake.servicer.requests("BatchStream")
        requests = [r for r in sent if len(r.items) == len(steps)]
        self.assertEqual(len(requests), 4, "two batches and two streams of every step")
        for request in requests:
            a, b, cc = request.items
            self.assertFalse(a.HasField("output_refs"))
            self.assertEqual((b.num_tokens, b.num_heads), (1, 4))
            self.assertEqual(b.output_refs.block_ids.offset, 4096)
            self.assertEqual((cc.append.num_tokens, cc.append.keys_ref.offset), (1, 8192))

    def test_bad_references_are_refused_before_sending(self):
        c = self.client
        cases = [
            (lambda: c.append_keys("w", TensorRef("io", 0, (2, 64))),
             "keys has shape (2, 64) ([n][head_dim]) but the server"),
            (lambda: c.select_blocks("w", TensorRef("io", 0, (1, 2, 64), "fp32")),
             "queries has shape (1, 2, 64)"),
            (lambda: c.append_keys("w", TensorRef("io", 0, (2, 2, HEAD_DIM))),
             f"{LAYERS} layers"),
            (lambda: c.append_keys("w", TensorRef("io", 0, (2, HEAD_DIM), "int32")),
             "keys refers to int32 values"),
            (lambda: c.batch([Step("w", keys=floats(1, HEAD_DIM),
                                   outputs=OutputRefs(RegionRef("io", 0, 4)))]),
             "outputs are given but no queries"),
            (lambda: OutputRefs(block_ids=TensorRef("io", 0, (1,), "int32")),
             "give a RegionRef"),
            (lambda: TensorRef("io", 0, (1,), "fp16"), "dtype is 'fp16'"),
        ]
        for call, words in cases:
            with self.assertRaises((ValueError, TypeError)) as caught:
                call()
            self.assertIn(words, str(caught.exception))
        sent = {m for m, _, _, _ in fake.servicer.calls}
        self.assertEqual(sent, {"ServerInfo"}, "nothing but ServerInfo may have been sent")

    def test_region_calls(self):
        c = self.client
        self.assertIsNone(c.register_system_region("r", "/k", 64, offset=8))
        self.assertEqual(c.unregister_region("r"), 1)
        self.assertEqual(c.unregister_region(), 3)
        self.assertEqual(c.list_regions("q"), [RegionStatus("q", "system", "/k", 8, 64)])
        (register,) = fake.servicer.requests("RegisterSystemRegion")
        self.assertEqual((register.name, register.key, register.offset, register.byte_size),
                         ("r", "/k", 8, 64))
        self.assertEqual([r.name for r in fake.servicer.requests("UnregisterRegion")], ["r", ""])

        async def run():
            async with AsyncIndexerClient(fake.target, timeout=30) as a:
                await a.register_system_region("r2", "/k2", 16)
                self.assertEqual(await a.unregister_region(), 3)
                self.assertEqual(await a.list_regions(),
                                 [RegionStatus("r", "system", "/k", 8, 64)])
        asyncio.run(run())
        self.assertEqual(fake.servicer.requests("RegisterSystemRegion")[1].offset, 0)


class FakeTorch:
    """A stand-in for the torch module with only what tensors.py calls: Tensor.detach, .device,
    .cpu, .dtype, .contiguous, .view(int16), .to(float32), .is_complex, .numpy."""

    def __init__(self):
        self.module = types.ModuleType("torch")
        m = self.module
        m.bfloat16, m.float32, m.float16, m.int16, m.bool = "bfloat16", "float32", "float16", \
            "int16", "bool"
        m.calls = []

        class Tensor:
            def __init__(self, array, dtype, device="cpu"):
                self.array, self.dtype = array, dtype  # bf16: array holds uint16 bits
                self.device = types.SimpleNamespace(type=device)

            def detach(self):
                m.calls.append("detach")
                return self

            def cpu(self):
                m.calls.append("cpu")
                return Tensor(self.array, self.dtype)

            def contiguous(self):
                return Tensor(np.ascontiguousarray(self.array), self.dtype, self.device.type)

            def view(self, dtype):
                assert dtype == m.int16 and self.dtype == m.bfloat16, (dtype, self.dtype)
                return Tensor(self.array.view(np.int16), m.int16, self.device.type)

            def to(self, dtype):
                assert dtype == m.float32
                values = self.array.astype(np.float32)
                return Tensor(values, m.float32, self.device.type)

            def is_complex(self):
                return False

            def numpy(self):
                assert self.device.type == "cpu", "numpy() of a device tensor"
                return self.array

        m.Tensor = Tensor


class TensorTest(unittest.TestCase):
    def test_numpy_dtypes(self):
        x = np.random.default_rng(3).standard_normal((3, 4))
        want = to_bf16_bits(x.astype(np.float32))
        for dtype in (np.float64, np.float32, np.float16):
            got = wire_values(x.astype(dtype), "keys")
            self.assertEqual(got.array.dtype, np.float32)
            np.testing.assert_array_equal(to_bf16_bits(got.array),
                                          to_bf16_bits(x.astype(dtype).astype(np.float32)))
        np.testing.assert_array_equal(
            np.frombuffer(wire_values(x, "keys").bf16_bytes(), "<u2").reshape(3, 4), want)
        ints = np.arange(12, dtype=np.int64).reshape(3, 4)
        self.assertEqual(np.frombuffer(wire_values(ints, "q").fp32_bytes(), "<f4").tolist(),
                         list(range(12)))
        self.assertEqual(wire_values([[1, 2], [3, 4]], "q").shape, (2, 2))
        for bad in (np.ones(3, bool), np.ones(3, complex), np.array(["a"])):
            with self.assertRaises(TypeError):
                wire_values(bad, "keys")

    def test_torch_tensors_through_a_stand_in(self):
        fake_torch = FakeTorch().module
        self.assertNotIn("torch", sys.modules)
        sys.modules["torch"] = fake_torch
        try:
            bits = np.array([[0x3F81, 0xC000], [0x0001, 0x7F7F]], np.uint16)  # not all float32-exact
            t = fake_torch.Tensor(bits, fake_torch.bfloat16, device="cuda")
            got = wire_values(t, "keys")
            self.assertTrue(got.bf16_bits)
            self.assertEqual(got.bf16_bytes(), bits.astype("<u2").tobytes(), "bf16 bits sent as they are")
            self.assertEqual(np.frombuffer(got.fp32_bytes(), "<u4").tolist(),
                             [int(b) << 16 for b in bits.ravel()], "bf16 widens exactly to fp32")
            self.assertEqual(fake_torch.calls, ["detach", "cpu"])
            x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float16)
            got = wire_values(fake_torch.Tensor(x, fake_torch.float16), "queries")
            self.assertFalse(got.bf16_bits)
            self.assertEqual(got.bf16_bytes(), to_bf16_bytes(x.astype(np.float32)))
            # Through a client: the bf16 bits reach the server unchanged, shapes checked.
            with IndexerClient(fake.target) as c:
                keys = np.arange(2 * HEAD_DIM, dtype=np.uint16).reshape(2, HEAD_DIM) + 0x3F00
                c.append_keys("torch", fake_torch.Tensor(keys, fake_torch.bfloat16))
                with self.assertRaises(ValueError):
                    c.append_keys("torch", fake_torch.Tensor(keys[:, :64], fake_torch.bfloat16))
            request = [r for r in fake.servicer.requests("AppendKeys") if r.sequence_id == "torch"][-1]
            self.assertEqual((request.keys, request.num_tokens), (keys.astype("<u2").tobytes(), 2))
        finally:
            del sys.modules["torch"]

    def test_the_package_never_imports_torch(self):
        run = subprocess.run([sys.executable, "-c", "import sys, numpy, indexer_client; "
                              "indexer_client.IndexerClient('127.0.0.1:1'); "
                              "print('torch' in sys.modules)"],
                             capture_output=True, text=True, env=dict(os.environ), timeout=60)
        self.assertEqual((run.returncode, run.stdout.strip()), (0, "False"), run.stderr)


if __name__ == "__main__":
    unittest.main()
