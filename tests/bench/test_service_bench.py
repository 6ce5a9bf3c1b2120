#!/usr/bin/env python3
"""scripts/service_bench.py --device cpu --quick, end to end, on the CPU backend.

Runs the real indexer-server, indexer-echo-server and indexer-bench from the build folder and
checks what the script wrote: every quick case ran with sane figures (latencies ordered, rates
positive, the kernel time read from the server and below the step latency, overhead = p50 -
kernel, every target computed), the transport cases ran over TCP and over Unix sockets with
unary Batch and BatchStream against the echo server and the indexer, with their differences,
ratios and verdicts, the server's breakdown table (or the note that it exports no phases), the
per-case JSON reports parse, the markdown tables list every case, and no server it started is
left running. It prints the CPU case's ratio to the echo server (a benchmark: only a case that
fails to run fails the test, never a slow figure). Then the failure paths: a server that refuses
its flags fails the case (exit 1), an unknown case is a usage error (exit 2). --rounds keeps one
row per case, its median round, with every round's p50 and difference.

Environment (set by tests/bench/CMakeLists.txt): INDEXER_SOURCE_DIR, INDEXER_BUILD_DIR,
INDEXER_TEST_OUT (a scratch folder).
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

SOURCE = os.environ.get("INDEXER_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "../.."))
BUILD = os.environ.get("INDEXER_BUILD_DIR", os.path.join(SOURCE, "build"))
OUT = os.environ.get("INDEXER_TEST_OUT", "/tmp/service_bench_quick_test")
SCRIPT = os.path.join(SOURCE, "scripts", "service_bench.py")

TRANSPORT_CASES = ["t_b1_l1k_h1_%s_%s_%s" % (t, style, server)
                   for t in ("unix", "tcp") for style in ("stream", "batch")
                   for server in ("echo", "indexer")]
SHM_CASES = ["s_b1_l1k_h1_%s_%s" % (mode, server)
             for mode in ("none", "system") for server in ("echo", "indexer")]
QUICK_CASES = ["decode_b1_l1k_h1", "decode_b1_l1k_h1_echo", "decode_b8_l2k_h1",
               "decode_b4_l2k_h4", "unary_16_l2k_on", "unary_16_l2k_off", "small_8_l512_indexer",
               "small_8_l512_echo"] + TRANSPORT_CASES + SHM_CASES
INDEXER_DECODE = ["decode_b1_l1k_h1", "decode_b8_l2k_h1", "decode_b4_l2k_h4"]


def run(args, timeout=170):
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--quick", "--bin", BUILD]
                          + args, capture_output=True, text=True, timeout=timeout)


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class ServiceBenchQuick(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        shutil.rmtree(OUT, ignore_errors=True)
        cls.out = os.path.join(OUT, "full")
        cls.result = run(["--out", cls.out])
        with open(os.path.join(cls.out, "summary.json")) as f:
            cls.summary = json.load(f)
        cls.rows = {r["case"]: r for r in cls.summary["cases"]}

    def test_exit_and_table(self):
        r = self.result
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("| case | what | p50 us | p99 us | kernel us | overhead us |", r.stdout)
        with open(os.path.join(self.out, "service_bench.md")) as f:
            md = f.read()
        for case in QUICK_CASES:
            if case.startswith("t_"):
                continue  # in the transport table, by shape, transport and call
            self.assertIn("| %s |" % case, r.stdout)
            self.assertIn("| %s |" % case, md)
        self.assertIn("| case | transport | call | echo p50 us | indexer p50 us | "
                      "indexer - echo us |", md)
        for transport in ("unix", "tcp"):
            for call in ("BatchStream", "unary Batch"):
                self.assertIn("| b1_l1k_h1 | %s | %s |" % (transport, call), md)
        self.assertIn("## The server's breakdown of a call", md)
        # The multigpu cases are not selected without --devices.
        self.assertNotIn("multigpu", md)
        # Few files (the GPU machine's tool brings back at most eight).
        self.assertEqual(sorted(os.listdir(self.out)), ["logs.txt", "service_bench.md",
                                                        "summary.json"])
        logs = open(os.path.join(self.out, "logs.txt")).read()
        self.assertIn("==== main.log ====", logs)
        self.assertIn("==== main_unix.log ====", logs)
        self.assertIn("==== echo_unix.log ====", logs)
        self.assertIn("serving on port", logs)
        self.assertIn("indexer-echo-server serving on unix:", logs)

    def test_every_case_sane(self):
        self.assertEqual(sorted(self.rows), sorted(QUICK_CASES))
        for name, row in self.rows.items():
            with self.subTest(case=name):
                self.assertEqual(row["status"], "ok", row.get("note"))
                self.assertEqual(row["errors"], 0)
                self.assertGreater(row["requests"], 0)
                self.assertGreater(row["p50_us"], 0)
                self.assertLessEqual(row["p50_us"], row["p99_us"])
                self.assertGreater(row["rate"], 0)
                self.assertGreater(row["measured_s"], 0.5)
                # Closed loop: the rate cannot beat concurrency / mean latency (Little's law; a
                # slow or busy machine only lowers it, so there is no lower bound).
                clients = {"decode": 1, "unary": 16, "small": 8, "transport": 1, "shm": 1}[row["group"]]
                self.assertLess(row["rate"], 2.0 * clients / (row["mean_us"] * 1e-6))
                if name.endswith("_echo"):
                    self.assertEqual(row["backend"], "echo")
                    self.assertNotIn("kernel_us", row)
                else:
                    self.assertEqual(row["backend"], "cpu")
                    self.assertGreater(row["kernel_us"], 0)
                    self.assertGreater(row["spans_per_launch"], 0)
                report = self.summary["reports"][name]
                self.assertEqual(report["tool"], "indexer-bench")
                stage = report["stages"][0]
                self.assertEqual(stage["requests"]["ok"], row["requests"])
                self.assertEqual(stage["server_stats"]["available"], not name.endswith("_echo"))

    def test_decode_kernel_time_and_targets(self):
        for name in INDEXER_DECODE:
            with self.subTest(case=name):
                row = self.rows[name]
                # One caller: the kernels of a step take part of its latency, never more. Both
                # are means over the measured window (a mean against the median fails whenever a
                # few slow steps pull the mean up, as under sanitizers); 10% allows for a step
                # the window's edges split between the two counts.
                self.assertLess(row["kernel_us"], row["mean_us"] * 1.1)
                self.assertAlmostEqual(row["overhead_us"], row["p50_us"] - row["kernel_us"])
                self.assertAlmostEqual(row["vs_target"], (row["kernel_us"] + 60) / row["p50_us"])
                self.assertAlmostEqual(row["launches_per_request"], 1.0, delta=0.1)
                self.assertIn(row["met"], (True, False))
        self.assertEqual(self.rows["decode_b1_l1k_h1"]["echo_p50_us"],
                         self.rows["decode_b1_l1k_h1_echo"]["p50_us"])
        on, off = self.rows["unary_16_l2k_on"], self.rows["unary_16_l2k_off"]
        self.assertAlmostEqual(on["vs_target"], on["rate"] / off["rate"] / 5)
        idx, echo = self.rows["small_8_l512_indexer"], self.rows["small_8_l512_echo"]
        self.assertAlmostEqual(idx["vs_target"], idx["rate"] / echo["rate"] / 0.8)
        self.assertIn("of echo", idx["target"])

    def test_shared_memory_against_inline_and_the_echo_server(self):
        for mode in ("none", "system"):
            with self.subTest(mode=mode):
                name = "s_b1_l1k_h1_%s_indexer" % mode
                row = self.rows[name]
                echo = self.rows["s_b1_l1k_h1_%s_echo" % mode]
                inline = self.rows["s_b1_l1k_h1_none_indexer"]
                self.assertEqual(row["shared_memory"], mode)
                self.assertEqual(row["echo_p50_us"], echo["p50_us"])
                self.assertAlmostEqual(row["diff_us"], row["p50_us"] - echo["p50_us"])
                self.assertAlmostEqual(row["x_inline"], row["p50_us"] / inline["p50_us"])
                self.assertEqual(row["errors"], 0)
                self.assertGreater(row["kernel_us"], 0)
                report = self.summary["reports"][name]
                self.assertEqual(report["workload"]["tensors"],
                                 "inline" if mode == "none"
                                 else "by reference (system shared memory)")
                self.assertTrue(report["servers"][0]["target"].startswith("unix:"))
        with open(os.path.join(self.out, "service_bench.md")) as f:
            md = f.read()
        self.assertIn("## Tensors inline and by reference", md)
        self.assertIn("| b1_l1k_h1 | system |", md)

    def test_transport_against_the_echo_server(self):
        for name in TRANSPORT_CASES:
            if not name.endswith("_indexer"):
                continue
            with self.subTest(case=name):
                row = self.rows[name]
                echo = self.rows[name[:-len("_indexer")] + "_echo"]
                self.assertEqual(row["echo_p50_us"], echo["p50_us"])
                self.assertAlmostEqual(row["diff_us"], row["p50_us"] - echo["p50_us"])
                self.assertAlmostEqual(row["x_echo"], row["p50_us"] / echo["p50_us"])
                unix = row["transport"] == "unix"
                limit = 2.0 if unix else 3.0  # over TCP: 1.5x the Unix socket's target
                self.assertEqual(row["target"], "p50 <= %gx echo" % limit)
                self.assertAlmostEqual(row["vs_target"], limit / row["x_echo"])
                self.assertEqual(row["met"], row["vs_target"] >= 1.0)
                self.assertGreater(row["kernel_us"], 0)
                report = self.summary["reports"][name]
                self.assertEqual(report["servers"][0]["target"].startswith("unix:"), unix)
                self.assertEqual(report["workload"]["call style"], row["style"])
                # The server's phases, when it exports them, are read over the window.
                server = report["stages"][0]["server_stats"]
                if server["phases_available"]:
                    self.assertTrue(server["phases"])
                    for phase in server["phases"].values():
                        self.assertGreaterEqual(phase["us_per_request"], 0)
                print("  %s: indexer p50 %.1f us = %.2fx echo p50 %.1f us (target <= %gx: %s)" % (
                    name, row["p50_us"], row["x_echo"], row["echo_p50_us"], limit,
                    "met" if row["met"] else "missed"), flush=True)
        with open(os.path.join(self.out, "service_bench.md")) as f:
            md = f.read()
        if any(r.get("phases_available") for r in self.rows.values()):
            self.assertIn("phases us |", md)
        else:
            self.assertIn("exports no indexer_step_phase_seconds", md)
        self.assertIn("service_bench: b1_l1k_h1 over unix, BatchStream: indexer p50",
                      self.result.stderr)

    def test_servers_stopped(self):
        started = self.summary["servers"]
        want = ["echo", "echo_unix", "main", "main_unix"]
        if self.summary["server_flags_batching"]:
            want.append("nobatch")
        self.assertEqual(sorted(s["server"] for s in started), sorted(want))
        for s in started:
            self.assertTrue(gone(s["pid"]), "server %s (pid %d) still runs" % (s["server"], s["pid"]))

    def test_rounds_report_the_median_round(self):
        out = os.path.join(OUT, "rounds")
        pair = ["t_b1_l1k_h1_unix_stream_echo", "t_b1_l1k_h1_unix_stream_indexer"]
        r = run(["--out", out, "--cases", ",".join(pair), "--rounds", "3"], timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["rounds"], 3)
        rows = {row["case"]: row for row in summary["cases"]}
        self.assertEqual(sorted(rows), sorted(pair))  # one row per case, not per round
        for name, row in rows.items():
            with self.subTest(case=name):
                self.assertEqual(len(row["p50_rounds_us"]), 3)
                self.assertEqual(row["p50_us"], sorted(row["p50_rounds_us"])[1])
                # The report kept is the median round's.
                report = summary["reports"][name]
                self.assertAlmostEqual(report["stages"][0]["latency_ms"]["p50"] * 1e3,
                                       row["p50_us"])
        idx, echo = rows[pair[1]], rows[pair[0]]
        self.assertEqual(idx["diff_rounds_us"],
                         [a - b for a, b in zip(idx["p50_rounds_us"], echo["p50_rounds_us"])])
        self.assertAlmostEqual(idx["diff_us"], idx["p50_us"] - echo["p50_us"])
        with open(os.path.join(out, "service_bench.md")) as f:
            md = f.read()
        self.assertIn("ran in 3 rounds", md)
        # As the tables write figures: one decimal, or thousands separated from 1,000 up.
        shown = ["{:,.0f}".format(d) if abs(d) >= 1000 else "%.1f" % d
                 for d in idx["diff_rounds_us"]]
        self.assertIn(" / ".join(shown), md)
        with open(os.path.join(out, "logs.txt")) as f:
            self.assertIn("t_b1_l1k_h1_unix_stream_indexer.round3.bench.log", f.read())
        r = run(["--out", out, "--cases", pair[0], "--rounds", "0"], timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--rounds must be at least 1", r.stderr)

    def test_failures_are_reported(self):
        out = os.path.join(OUT, "failing")
        r = run(["--out", out, "--cases", "decode_b1_l1k_h1", "--capacity", "0"], timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        with open(os.path.join(out, "summary.json")) as f:
            rows = json.load(f)["cases"]
        self.assertEqual(rows[0]["status"], "failed")
        self.assertIn("did not start", rows[0]["note"])
        self.assertIn("| decode_b1_l1k_h1 |", r.stdout)
        r = run(["--out", out, "--cases", "no_such_case"], timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown case", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
