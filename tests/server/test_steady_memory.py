#!/usr/bin/env python3
"""indexer-server reuses its memory from one decode step to the next (KeepFreedMemory).

A step of 256 items frees hundreds of KB of request bytes and per-call state when it ends; with
glibc's default settings the server handed much of it back to the kernel and faulted it in again
on the next call (tens of page faults per call). This runs the real server (CPU backend, Unix
socket) under indexer-bench's BatchStream decode steps of 256 sequences, once to warm it up and
once measured, and checks the server's minor page faults (/proc/PID/stat) over the measured run:
fewer than one per call on average. A count, not a timing: it does not depend on the machine's
speed.

Environment (set by tests/server/CMakeLists.txt): INDEXER_SERVER_BINARY, INDEXER_BENCH_BINARY,
INDEXER_TEST_OUT (a scratch folder), INDEXER_SANITIZED=1 in sanitizer builds, whose allocator
quarantines freed memory and ignores the server's settings: the test skips there.
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

SERVER = os.environ.get("INDEXER_SERVER_BINARY", "build/server/indexer-server")
BENCH = os.environ.get("INDEXER_BENCH_BINARY", "build/client/bench/indexer-bench")
OUT = os.environ.get("INDEXER_TEST_OUT", "/tmp/steady_memory_test")


def minor_faults(pid):
    """The process's minor page faults so far: field 10 of /proc/PID/stat (after the command,
    which is in parentheses and may hold spaces)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7])


@unittest.skipIf(os.environ.get("INDEXER_SANITIZED") == "1",
                 "sanitizer build: its allocator, not glibc's, serves the server's memory")
@unittest.skipUnless(os.path.exists("/proc/self/stat"), "no /proc to read page faults from")
class SteadyMemoryTest(unittest.TestCase):
    def setUp(self):
        shutil.rmtree(OUT, ignore_errors=True)
        os.makedirs(OUT)
        self.dir = tempfile.mkdtemp(prefix="indexer-mem-")
        self.socket = os.path.join(self.dir, "indexer.sock")
        self.log = open(os.path.join(OUT, "server.log"), "w")
        self.server = subprocess.Popen(
            [SERVER, "--device=cpu", "--listen=unix:" + self.socket, "--capacity=256MiB"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def tearDown(self):
        self.server.terminate()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def bench(self, name, seconds):
        report = os.path.join(OUT, name + ".json")
        argv = [BENCH, "--servers=unix:" + self.socket, "--style=stream", "--batch=256",
                "--concurrency=1", "--prefill=16", "--decode_steps=1000000000", "--rewind=128",
                "--heads=1", "--topk=16", "--layers=1", "--warmup=0s",
                "--duration=%ds" % seconds, "--wait=30s", "--progress=off", "--json=" + report]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stdout[-2000:] + done.stderr[-2000:])
        with open(report) as f:
            stage = json.load(f)["stages"][0]
        return stage["requests"]["ok"]

    def test_decode_steps_fault_in_no_new_memory(self):
        self.bench("warmup", 2)
        before = minor_faults(self.server.pid)
        calls = self.bench("measured", 3)
        faults = minor_faults(self.server.pid) - before
        print("indexer-server: %d minor page faults over %d BatchStream calls of 256 items "
              "(%.2f per call)" % (faults, calls, faults / max(1, calls)))
        self.assertGreater(calls, 20)
        self.assertLess(faults, calls, "the server faults memory in on every call")


if __name__ == "__main__":
    unittest.main(verbosity=2)
