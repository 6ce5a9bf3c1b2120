#!/usr/bin/env python3
"""The service benchmark: the indexer over gRPC, end to end, against its targets.

Starts servers on free loopback ports and on Unix domain sockets, drives them with indexer-bench,
reads the kernel time from the server's own figures (GetStats: indexer_backend_select_seconds
over the measured window, and every phase of indexer_step_phase_seconds when the server exports
it), and writes three files to --out (the GPU machine's tool brings back at most eight):
service_bench.md (the tables, printed last too), summary.json (every figure, and each case's
whole indexer-bench JSON report under "reports") and logs.txt (server and indexer-bench logs).
Every server it starts is stopped on exit, whatever happens. Python 3 standard library only.

Cases (--cases takes group or case names, comma-separated; default: every group but multigpu,
which --devices=0,1 adds):

  transport  the service path's decode cases against indexer-echo-server in one run: each case
             over TCP and over a Unix socket, with unary Batch and with BatchStream, against
             the echo server and the indexer side by side (one caller, closed loop). Per case:
             indexer p50 - echo p50 next to the server's kernel time. Targets, on the GPU
             (B=1 L=4K H=1, B=32 L=32K H=4, B=256 L=8K H=1): the difference <= kernel + 15 /
             40 / 120 us over a Unix socket with BatchStream, and within 1.5x of that over TCP
             or with unary Batch; on the CPU (B=1 L=1K H=1): indexer p50 <= 2x echo p50 over a
             Unix socket (3x over TCP). Then the server's own breakdown of a step: each phase of
             indexer_step_phase_seconds, in microseconds per call.
  shm        the transport group's shapes over a Unix socket with BatchStream, with tensors
             inline and by reference in system shared memory and (on the GPU) in CUDA regions
             (indexer-bench --shared_memory), against indexer-echo-server answering the same
             messages (by reference: its control messages alone). Per case: indexer p50 - echo
             p50 next to the kernel time, and the indexer's p50 by reference against its p50
             inline. Targets (the GPU's): the difference <= kernel + 120 us for B=256 L=8K H=1 in
             system regions; in CUDA regions <= kernel + 60 us for it and + 15 us for B=1 L=4K.
  decode     one whole decode step per Batch call (B sequences, each appending one token and
             selecting top-16 blocks of its L tokens for H heads), one caller, closed loop: step
             latency p50/p99 next to the kernel time. Target: p50 <= kernel time + 60 us. The
             *_echo cases send the same calls to indexer-echo-server: the gRPC floor.
  unary      256 concurrent clients, each decoding its own sequence of L = 32K tokens with unary
             SelectBlocks calls carrying the new token's key, with the server's --batching on and
             then off (a fresh server). Target: rate with batching >= 5x without.
  small      64 concurrent clients at L = 1K against the indexer and against indexer-echo-server
             (the same calls answered by gRPC alone), in the same run. Target: >= 80% of echo.
  multigpu   the large Batch workload on --devices=FIRST and then on every device of --devices.
             Target: >= 1.8x one GPU's rate. Skipped when fewer than two GPUs are visible.

--rounds N runs the transport and shm cases N times in turn and reports each case's median round
(one caller's p50 moves by tens of microseconds between runs on a shared host), with every
round's indexer p50 - echo p50 beside it.

Sequences are rewound to their prefill length every 128 steps (indexer-bench --rewind), so L
stays within one block of what the case says however long it runs.

  scripts/service_bench.py --device cuda --bin .device/bundle --out gpu-out/service
  scripts/service_bench.py --device cuda --bin .device/bundle --cases transport   # ~3 min
  scripts/service_bench.py --device cuda --bin .device/bundle --cases transport --rounds 3
  scripts/service_bench.py --device cpu --quick --bin build            # about 30 s, for CI
  scripts/service_bench.py --device cuda --cases multigpu --devices 0,1

Exit status: 0 every case ran (targets met or not: the table says), 1 a case failed or a server
would not start, 2 bad arguments.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

KERNEL_SLACK_US = 60.0      # decode: p50 <= kernel + 60 us
BATCHING_SPEEDUP = 5.0      # unary: on >= 5x off
ECHO_SHARE = 0.8            # small: >= 80% of echo
TWO_GPU_SPEEDUP = 1.8       # multigpu: >= 1.8x one GPU
REWIND = 128                # steps between rewinds to the prefill length
GROUPS = ("transport", "shm", "decode", "unary", "small", "multigpu")
SHM_MODES = {"cpu": ("none", "system"), "cuda": ("none", "system", "cuda")}
SHM_CPU_BATCH = [("b64_l1k_h1", 64, 1024, 1, "ratio")]
# shm: per placement and shape, indexer - echo <= kernel + this many us.
SHM_SLACK_US = {"system": {"b256_l8k_h1": 120.0},
                "cuda": {"b256_l8k_h1": 60.0, "b1_l4k_h1": 15.0}}

# transport: (shape, B, L, H, target). A number: indexer p50 - echo p50 <= kernel + that many us
# (the GPU cases); "ratio": indexer p50 <= CPU_ECHO_RATIO x echo p50 (the CPU case). The strict
# target holds over a Unix socket with BatchStream (the CPU's: over a Unix socket); over TCP or
# with unary Batch the allowance is SECONDARY_SLACK times as large.
TRANSPORT_GPU = [("b1_l4k_h1", 1, 4096, 1, 15.0),
                 ("b32_l32k_h4", 32, 32768, 4, 40.0),
                 ("b256_l8k_h1", 256, 8192, 1, 120.0)]
TRANSPORT_CPU = [("b1_l1k_h1", 1, 1024, 1, "ratio")]
CPU_ECHO_RATIO = 2.0
SECONDARY_SLACK = 1.5
TRANSPORTS = ("unix", "tcp")
DECODE_RPC = {"stream": "BatchStream", "batch": "Batch", "unary": "SelectBlocks"}
STYLES = (("stream", "BatchStream"), ("batch", "unary Batch"))


def die(message):
    print("service_bench: %s" % message, file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="The indexer's service benchmark (see the module docstring).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the server's backend (default cuda)")
    p.add_argument("--bin", default=None,
                   help="folder with indexer-server, indexer-bench, indexer-echo-server (a bundle) "
                        "or a build folder (server/, client/bench/); default .device/bundle, "
                        "else build")
    p.add_argument("--out", default=None,
                   help="where the reports go (default $OUT/service, else ./service-bench-out)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and short stages (about 12 s on 2 CPU cores), for CI")
    p.add_argument("--cases", default="",
                   help="comma-separated groups (%s) or case names; default every group but "
                        "multigpu (added by --devices with two or more ids)" % ", ".join(GROUPS))
    p.add_argument("--devices", default="",
                   help="GPU ids for the multigpu group, e.g. 0,1: runs the large Batch case on "
                        "the first and then on all (the server's --devices)")
    p.add_argument("--duration", type=float, default=None,
                   help="measured seconds per case (default 4, quick 1)")
    p.add_argument("--warmup", type=float, default=None,
                   help="warm-up seconds per case (default 1, quick 0.3)")
    p.add_argument("--capacity", default=None,
                   help="the server's --capacity (default: what the largest selected case "
                        "holds, with a quarter more; at least 8GiB on cuda, 1GiB on cpu)")
    p.add_argument("--multigpu-callers", type=int, default=32,
                   help="concurrent callers of the multigpu cases (default 32; each holds 16 "
                        "sequences of 128K tokens, 512 MiB of bf16 keys)")
    p.add_argument("--multigpu-connections", type=int, default=None,
                   help="HTTP/2 connections the multigpu callers share (default: one per 4 callers)")
    p.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                   help="an extra flag for every indexer-server started, e.g. "
                        "--server-flag=--batch_max_tasks=64 (repeatable)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the transport and shm cases this many times, in turn with one "
                        "another (the echo server and the indexer alternating within each "
                        "round), and report each case's median round by p50, with every "
                        "round's p50 and difference beside it (default 1): one caller's p50 "
                        "moves by tens of us between runs on a shared host")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Cases


def transport_cases(shapes):
    """Per shape, transport and call style: the echo server's run, then the indexer's."""
    cases = []
    for shape, b, length, heads, target in shapes:
        for transport in TRANSPORTS:
            for style, style_name in STYLES:
                for server in ("echo", "indexer"):
                    key = ("echo" if server == "echo" else "main") + (
                        "_unix" if transport == "unix" else "")
                    cases.append({
                        "name": "t_%s_%s_%s_%s" % (shape, transport, style, server),
                        "group": "transport", "server": key, "style": style, "batch": b,
                        "concurrency": 1, "prefill": length, "heads": heads,
                        "shape": shape, "transport": transport, "target_kind": target,
                        "what": "B=%d L=%s H=%d, %s over %s, %s" % (
                            b, kib(length), heads, style_name,
                            "a Unix socket" if transport == "unix" else "TCP",
                            "echo server" if server == "echo" else "indexer")})
    return cases


def shm_cases(shapes, device):
    """Per shape and tensor placement, over a Unix socket with BatchStream: echo, then indexer."""
    cases = []
    for shape, b, length, heads, _target in shapes:
        for mode in SHM_MODES[device]:
            for server in ("echo", "indexer"):
                cases.append({
                    "name": "s_%s_%s_%s" % (shape, mode, server), "group": "shm",
                    "server": ("echo" if server == "echo" else "main") + "_unix",
                    "style": "stream", "batch": b, "concurrency": 1, "prefill": length,
                    "heads": heads, "shape": shape, "shared_memory": mode,
                    "what": "B=%d L=%s H=%d, BatchStream over a Unix socket, tensors %s, %s" % (
                        b, kib(length), heads,
                        {"none": "inline", "system": "in system shared memory",
                         "cuda": "in CUDA regions"}[mode],
                        "echo server" if server == "echo" else "indexer")})
    return cases


def decode_case(name, b, length, heads, server="main"):
    return {"name": name, "group": "decode", "server": server, "style": "batch",
            "batch": b, "concurrency": 1, "prefill": length, "heads": heads,
            "what": "B=%d L=%s H=%d, Batch per step%s" % (
                b, kib(length), heads, ", echo server (gRPC floor)" if server == "echo" else "")}


def unary_case(name, clients, length, batching):
    return {"name": name, "group": "unary", "server": "main" if batching else "nobatch",
            "style": "unary", "batch": 1, "concurrency": clients, "prefill": length, "heads": 1,
            "connections": max(1, clients // 16),
            "what": "%d clients L=%s unary, batching %s" % (clients, kib(length),
                                                           "on" if batching else "off")}


def small_case(name, clients, length, server):
    return {"name": name, "group": "small", "server": server, "style": "unary", "batch": 1,
            "concurrency": clients, "prefill": length, "heads": 1,
            "connections": max(1, clients // 8),
            "what": "%d clients L=%s unary, %s" % (clients, kib(length),
                                                   "echo server" if server == "echo" else "indexer")}


def multigpu_case(name, server, workers, b, length, connections):
    return {"name": name, "group": "multigpu", "server": server, "style": "batch", "batch": b,
            "concurrency": workers, "prefill": length, "heads": 1, "connections": connections,
            "what": "%d x B=%d L=%s Batch, %s" % (workers, b, kib(length),
                                                 "one GPU" if server == "gpu1" else "all GPUs")}


def all_cases(quick, multigpu_callers=32, multigpu_connections=None, device="cuda"):
    # The multigpu callers share this many HTTP/2 connections (default one per 4 callers: on one
    # connection gRPC's per-connection work caps the rate below what two GPUs serve).
    conns = multigpu_connections or max(1, multigpu_callers // 4)
    shapes = TRANSPORT_CPU if quick or device == "cpu" else TRANSPORT_GPU
    # On the CPU a batched step too, where the tensors are most of the message.
    shm_shapes = shapes + (SHM_CPU_BATCH if device == "cpu" and not quick else [])
    transport = transport_cases(shapes) + shm_cases(shm_shapes, device)
    if quick:
        return transport + [
            decode_case("decode_b1_l1k_h1", 1, 1024, 1),
            decode_case("decode_b1_l1k_h1_echo", 1, 1024, 1, "echo"),
            decode_case("decode_b8_l2k_h1", 8, 2048, 1),
            decode_case("decode_b4_l2k_h4", 4, 2048, 4),
            unary_case("unary_16_l2k_on", 16, 2048, True),
            unary_case("unary_16_l2k_off", 16, 2048, False),
            small_case("small_8_l512_indexer", 8, 512, "main"),
            small_case("small_8_l512_echo", 8, 512, "echo"),
            multigpu_case("multigpu_1", "gpu1", 2, 4, 2048, 1),
            multigpu_case("multigpu_all", "gpuall", 2, 4, 2048, 1),
        ]
    return transport + [
        decode_case("decode_b1_l4k_h1", 1, 4096, 1),
        decode_case("decode_b1_l4k_h1_echo", 1, 4096, 1, "echo"),
        decode_case("decode_b1_l128k_h1", 1, 131072, 1),
        decode_case("decode_b1_l128k_h4", 1, 131072, 4),
        decode_case("decode_b16_l32k_h1", 16, 32768, 1),
        decode_case("decode_b64_l32k_h1", 64, 32768, 1),
        decode_case("decode_b64_l32k_h4", 64, 32768, 4),
        decode_case("decode_b256_l8k_h1", 256, 8192, 1),
        decode_case("decode_b256_l8k_h1_echo", 256, 8192, 1, "echo"),
        unary_case("unary_256_l32k_on", 256, 32768, True),
        unary_case("unary_256_l32k_off", 256, 32768, False),
        small_case("small_64_l1k_indexer", 64, 1024, "main"),
        small_case("small_64_l1k_echo", 64, 1024, "echo"),
        # Long contexts and 32 callers, so that the GPUs, not the server's per-item work, bound
        # the rate (about 8 us of key streaming per item at 128K on one H200).
        multigpu_case("multigpu_1", "gpu1", multigpu_callers, 16, 131072, conns),
        multigpu_case("multigpu_all", "gpuall", multigpu_callers, 16, 131072, conns),
    ]


def kib(tokens):
    return "%dK" % (tokens // 1024) if tokens % 1024 == 0 else str(tokens)


def select_cases(cases, spec, multi_gpu):
    if not spec:
        return [c for c in cases if c["group"] != "multigpu" or multi_gpu]
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    names = {c["name"] for c in cases}
    for w in wanted:
        if w not in GROUPS and w not in names:
            die("unknown case or group '%s' (groups: %s; cases: %s)"
                % (w, ", ".join(GROUPS), ", ".join(sorted(names))))
    return [c for c in cases if c["group"] in wanted or c["name"] in wanted]


# --------------------------------------------------------------------------------------------
# Binaries and servers


def find_binaries(folder):
    candidates = {
        "indexer-server": ["indexer-server", "server/indexer-server"],
        "indexer-bench": ["indexer-bench", "client/bench/indexer-bench"],
        "indexer-echo-server": ["indexer-echo-server", "client/bench/indexer-echo-server"],
    }
    found = {}
    for name, paths in candidates.items():
        for rel in paths:
            path = os.path.join(folder, rel)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                found[name] = os.path.abspath(path)
                break
        else:
            die("no %s under %s" % (name, folder))
    return found


class Servers:
    """Servers this script started; every one is stopped by stop_all (called on any exit).

    A key ending in "_unix" listens on a Unix domain socket in the log folder (its target is
    unix:PATH), any other on a free loopback port (127.0.0.1:PORT)."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.running = {}  # key -> (Popen, target, log path)
        self.started = []  # every server started: key, pid, target (for summary.json)

    def start(self, key, argv, timeout=60.0):
        log = os.path.join(self.log_dir, "%s.log" % key)
        socket_path = os.path.join(self.log_dir, "%s.sock" % key) if key.endswith("_unix") else None
        if socket_path and os.path.exists(socket_path):
            os.unlink(socket_path)
        listen = "unix:%s" % socket_path if socket_path else "127.0.0.1:0"
        with open(log, "w") as f:
            proc = subprocess.Popen(argv + ["--listen=%s" % listen], stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.running[key] = (proc, None, log)
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = read(log)
            target = None
            if socket_path:
                if "serving on" in text and os.path.exists(socket_path):
                    target = listen
            else:
                m = re.search(r"serving on port (\d+)", text)
                if m:
                    target = "127.0.0.1:%d" % int(m.group(1))
            if target:
                self.running[key] = (proc, target, log)
                self.started.append({"server": key, "pid": proc.pid, "target": target})
                return target
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop(key)
        tail = "\n".join(read(log).splitlines()[-5:])
        raise RuntimeError("%s did not start (exit %s): %s" % (key, proc.poll(), tail))

    def alive(self, key):
        entry = self.running.get(key)
        return entry is not None and entry[0].poll() is None

    def target(self, key):
        return self.running[key][1]

    def stop(self, key):
        entry = self.running.pop(key, None)
        if entry is None:
            return
        proc = entry[0]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self):
        for key in list(self.running):
            self.stop(key)


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def visible_gpus():
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])


def server_flags(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"--(\w+)", out.stdout + out.stderr))


def default_capacity(cases, device):
    """The server's --capacity when none is given: what the largest case holds at once (every
    caller's sequences at their prefill length plus the rewind window, in whole 128-token pages
    of bf16 keys of head_dim 128, one layer), with a quarter more, and at least 8GiB on cuda
    (1GiB on cpu). A pool too small for a case would refuse prefills inside the measured window,
    and the case would measure the retries."""
    floor_gib = 8 if device == "cuda" else 1
    need = 0
    for c in cases:
        pages = -(-(c["prefill"] + REWIND + 1) // 128)
        need = max(need, c["concurrency"] * c["batch"] * pages * 128 * 128 * 2)
    gib = max(floor_gib, -(-need * 5 // 4 // (1 << 30)))
    return "%dGiB" % gib


def indexer_argv(bins, args, flags, batching=None, devices=None, handler_threads=None):
    argv = [bins["indexer-server"], "--device=%s" % args.device, "--capacity=%s" % args.capacity,
            "--layers=1", "--head_dim=128", "--drain_seconds=2", "--not_serving_seconds=0"]
    if handler_threads:
        argv.append("--handler_threads=%d" % handler_threads)
    if batching is not None and "batching" in flags:
        argv.append("--batching=%s" % ("true" if batching else "false"))
    if devices is not None:
        argv.append("--devices=%s" % devices)
    return argv + list(args.server_flag)


# --------------------------------------------------------------------------------------------
# Running a case


def run_case(case, target, bins, args, work_dir, reports, round_=1):
    """Runs one case (its round `round_`); returns its row and puts its indexer-bench report in
    reports[(case, round_)]."""
    stem = case["name"] if round_ == 1 else "%s.round%d" % (case["name"], round_)
    report = os.path.join(work_dir, "%s.json" % stem)
    argv = [bins["indexer-bench"], "--servers=%s" % target,
            "--style=%s" % case["style"], "--batch=%d" % case["batch"],
            "--concurrency=%d" % case["concurrency"],
            "--connections=%d" % case.get("connections", 1),
            "--prefill=%d" % case["prefill"], "--prefill_chunk=8192",
            "--decode_steps=1000000000", "--rewind=%d" % REWIND,
            "--heads=%d" % case["heads"], "--topk=16", "--init_blocks=0", "--local_blocks=1",
            "--layers=1", "--warmup=%gs" % args.warmup, "--duration=%gs" % args.duration,
            "--timeout=60s", "--wait=30s", "--server_stats", "--progress=off", "--summary=full",
            "--json=%s" % report]
    if case.get("shared_memory", "none") != "none":
        argv.append("--shared_memory=%s" % case["shared_memory"])
    log = os.path.join(work_dir, "%s.bench.log" % stem)
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n\n")
        f.flush()
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.warmup + args.duration + 240).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    row = {"case": case["name"], "group": case["group"], "what": case["what"], "wall_s": wall,
           "round": round_}
    row["style"] = case["style"]
    for key in ("shape", "transport", "target_kind", "shared_memory"):
        if key in case:
            row[key] = case[key]
    if rc != 0 or not os.path.exists(report):
        tail = " / ".join(l for l in read(log).splitlines()[-4:] if l.strip())
        row.update(status="failed", note="indexer-bench exit %s: %s" % (rc, tail[-300:]))
        return row
    with open(report) as f:
        rep = json.load(f)
    reports[(case["name"], round_)] = rep
    st = rep["stages"][0]
    lat = st["latency_ms"]
    row.update(status="ok",
               backend=rep["servers"][0]["backend"], device=rep["servers"][0]["device"],
               requests=st["requests"]["ok"], errors=st["requests"]["errors"],
               measured_s=st["measured_s"],
               prefill_s=max(0.0, st["wall_s"] - st["warmup_s"] - st["measured_s"]),
               rate=st["throughput_rps"], selections_per_s=st["selections_per_s"],
               p50_us=lat["p50"] * 1e3, p99_us=lat["p99"] * 1e3, mean_us=lat["mean"] * 1e3,
               stable=(st.get("stability") or {}).get("stable", True))
    ss = st.get("server_stats") or {}
    if ss.get("available"):
        launches = ss["backend_selections"]
        row.update(kernel_us=ss["backend_select_us_per_request"],
                   kernel_launch_us=ss["backend_select_mean_us"],
                   launches_per_request=launches / max(1, row["requests"]),
                   spans_per_launch=ss["spans_per_selection"],
                   queue_us=ss["queue_mean_us"],
                   calls_per_launch=ss.get("calls_per_launch", 0.0),
                   batch_queue_us=ss.get("batch_queue_mean_us", 0.0),
                   server_rpc_us={rpc: v["mean_us"] for rpc, v in ss.get("requests", {}).items()},
                   phases_available=bool(ss.get("phases_available")),
                   phases_us={phase: v["us_per_request"]
                              for phase, v in (ss.get("phases") or {}).items()},
                   backend_counts=dict(ss.get("backend_counts") or {}))
    else:
        row["kernel_note"] = ss.get("note", "")
    return row


def median_rounds(rows):
    """One row per case, in the order the cases first ran: a case run in several rounds gives
    its median round by p50 (the lower middle of an even count), with every round's p50 in
    p50_rounds_us; a round that failed fails the case."""
    by, order = {}, []
    for r in rows:
        if r["case"] not in by:
            order.append(r["case"])
            by[r["case"]] = []
        by[r["case"]].append(r)
    out = []
    for name in order:
        runs = sorted(by[name], key=lambda r: r.get("round", 1))
        failed = [r for r in runs if r.get("status") != "ok"]
        if len(runs) == 1 or failed:
            out.append(failed[0] if failed else runs[0])
            continue
        pick = dict(sorted(runs, key=lambda r: r["p50_us"])[(len(runs) - 1) // 2])
        pick["p50_rounds_us"] = [r["p50_us"] for r in runs]
        out.append(pick)
    return out


def apply_targets(rows):
    by = {r["case"]: r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok":
            continue
        if r["group"] == "decode" and "kernel_us" in r:
            echo = by.get(r["case"] + "_echo")
            if echo:
                r["echo_p50_us"] = echo["p50_us"]  # the same calls answered by gRPC alone
            r["overhead_us"] = r["p50_us"] - r["kernel_us"]
            r["target"] = "p50 <= kernel + %g us" % KERNEL_SLACK_US
            r["vs_target"] = (r["kernel_us"] + KERNEL_SLACK_US) / r["p50_us"]
        elif r["group"] == "unary" and r["case"].endswith("_on"):
            off = by.get(r["case"][:-3] + "_off")
            if off and off["rate"] > 0:
                r["target"] = ">= %gx batching off (%.2fx)" % (BATCHING_SPEEDUP,
                                                              r["rate"] / off["rate"])
                r["vs_target"] = r["rate"] / off["rate"] / BATCHING_SPEEDUP
        elif r["group"] == "small" and r["case"].endswith("_indexer"):
            echo = by.get(r["case"][:-len("_indexer")] + "_echo")
            if echo and echo["rate"] > 0:
                r["target"] = ">= %d%% of echo (%.0f%%)" % (ECHO_SHARE * 100,
                                                          100 * r["rate"] / echo["rate"])
                r["vs_target"] = r["rate"] / echo["rate"] / ECHO_SHARE
        elif r["group"] == "multigpu" and r["case"] == "multigpu_all":
            one = by.get("multigpu_1")
            if one and one["selections_per_s"] > 0:
                x = r["selections_per_s"] / one["selections_per_s"]
                r["target"] = ">= %gx one GPU (%.2fx)" % (TWO_GPU_SPEEDUP, x)
                r["vs_target"] = x / TWO_GPU_SPEEDUP
        if "vs_target" in r:
            r["met"] = r["vs_target"] >= 1.0


def round_diffs(r, echo):
    """Each round's indexer p50 - echo p50, when both ran in rounds."""
    ours, theirs = r.get("p50_rounds_us"), echo.get("p50_rounds_us")
    if ours and theirs and len(ours) == len(theirs):
        r["diff_rounds_us"] = [a - b for a, b in zip(ours, theirs)]


def rounds_cell(r):
    """Every round's difference, for the tables' last column."""
    return " / ".join(fmt(d) for d in r["diff_rounds_us"]) if "diff_rounds_us" in r else "-"


def transport_targets(rows):
    """The transport group: each indexer run against the echo run of the same case."""
    by = {r["case"]: r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("group") != "transport" or r.get("status") != "ok" \
                or not r["case"].endswith("_indexer"):
            continue
        echo = by.get(r["case"][:-len("_indexer")] + "_echo")
        if not echo or echo["p50_us"] <= 0:
            continue
        kind = r["target_kind"]
        r["echo_p50_us"] = echo["p50_us"]
        r["echo_p99_us"] = echo["p99_us"]
        r["diff_us"] = r["p50_us"] - echo["p50_us"]
        round_diffs(r, echo)
        r["x_echo"] = r["p50_us"] / echo["p50_us"]
        primary = r["transport"] == "unix" and (kind == "ratio" or r["style"] == "stream")
        factor = 1.0 if primary else SECONDARY_SLACK
        if kind == "ratio":
            limit = CPU_ECHO_RATIO * factor
            r["target"] = "p50 <= %gx echo" % limit
            r["vs_target"] = limit / r["x_echo"]
        elif "kernel_us" in r:
            r["allowed_us"] = factor * (r["kernel_us"] + kind)
            r["target"] = ("diff <= kernel + %g us" % kind if primary
                           else "diff <= %g x (kernel + %g us)" % (SECONDARY_SLACK, kind))
            r["vs_target"] = r["allowed_us"] / r["diff_us"] if r["diff_us"] > 0 else 99.0
        else:
            continue
        r["met"] = r["vs_target"] >= 1.0


def shm_targets(rows):
    """The shm group: each indexer run against the echo run of the same messages, and by
    reference against inline."""
    by = {r["case"]: r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("group") != "shm" or r.get("status") != "ok" or not r["case"].endswith("_indexer"):
            continue
        echo = by.get(r["case"][:-len("_indexer")] + "_echo")
        inline = by.get("s_%s_none_indexer" % r["shape"])
        if inline and inline["p50_us"] > 0:
            r["x_inline"] = r["p50_us"] / inline["p50_us"]
        if not echo or echo["p50_us"] <= 0:
            continue
        r["echo_p50_us"] = echo["p50_us"]
        r["diff_us"] = r["p50_us"] - echo["p50_us"]
        round_diffs(r, echo)
        r["x_echo"] = r["p50_us"] / echo["p50_us"]
        slack = SHM_SLACK_US.get(r["shared_memory"], {}).get(r["shape"])
        if slack is not None and "kernel_us" in r:
            r["allowed_us"] = r["kernel_us"] + slack
            r["target"] = "diff <= kernel + %g us" % slack
            r["vs_target"] = r["allowed_us"] / r["diff_us"] if r["diff_us"] > 0 else 99.0
            r["met"] = r["vs_target"] >= 1.0


def shm_table(rows):
    head = ["case", "tensors", "echo p50 us", "indexer p50 us", "indexer - echo us", "x echo",
            "kernel us", "x inline", "allowed us", "met", "stable", "indexer - echo by round us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("group") != "shm" or not r["case"].endswith("_indexer"):
            continue
        if r.get("status") != "ok" or "echo_p50_us" not in r:
            note = r.get("note") or "the echo run of this case failed"
            cells = [r.get("shape", r["case"]), r.get("shared_memory", "?")] + ["-"] * 7 + [
                r.get("status", "?"), note.replace("|", "/")[:160], "-"]
        else:
            cells = [r["shape"], r["shared_memory"], fmt(r["echo_p50_us"]), fmt(r["p50_us"]),
                     fmt(r["diff_us"]), fmt(r["x_echo"], 2), fmt(r.get("kernel_us")),
                     fmt(r.get("x_inline"), 2), fmt(r.get("allowed_us")), yes_no(r.get("met")),
                     "yes" if r.get("stable", True) else "no", rounds_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def fmt(v, digits=1):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return "{:,.0f}".format(v)
    return "%.*f" % (digits, v)


def yes_no(v):
    return {True: "yes", False: "**no**"}.get(v, "")


def transport_table(rows):
    head = ["case", "transport", "call", "echo p50 us", "indexer p50 us", "indexer - echo us",
            "x echo", "kernel us", "allowed us", "target", "ratio to target", "met", "stable",
            "indexer - echo by round us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("group") != "transport" or not r["case"].endswith("_indexer"):
            continue
        call = dict(STYLES).get(r.get("style"), r.get("style", "?"))
        if r.get("status") != "ok" or "echo_p50_us" not in r:
            note = r.get("note") or "the echo run of this case failed"
            cells = [r.get("shape", r["case"]), r.get("transport", "?"), call] + ["-"] * 8 + [
                r.get("status", "?") if r.get("status") != "ok" else "-",
                note.replace("|", "/")[:160], "-"]
        else:
            cells = [r["shape"], r["transport"], call, fmt(r["echo_p50_us"]), fmt(r["p50_us"]),
                     fmt(r["diff_us"]), fmt(r["x_echo"], 2), fmt(r.get("kernel_us")),
                     fmt(r.get("allowed_us")), r.get("target", ""), fmt(r.get("vs_target"), 2),
                     yes_no(r.get("met")), "yes" if r.get("stable", True) else "no",
                     rounds_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def breakdown_table(rows):
    """The server's own account of a call, per indexer case: queue, backend and every phase of
    indexer_step_phase_seconds found over the measured window, in us per call."""
    measured = [r for r in rows if r.get("status") == "ok" and "kernel_us" in r]
    if not measured:
        return "No server figures (no indexer case ran).\n"
    phases = sorted({p for r in measured for p in r.get("phases_us", {})})
    note = ""
    if not any(r.get("phases_available") for r in measured):
        note = ("\nThe server exports no indexer_step_phase_seconds through GetStats: no phase "
                "breakdown, only its queue and backend time.\n")
    head = ["case", "p50 us", "server us", "handler queue us",
            "backend us"] + ["%s us" % (p or "(none)") for p in phases] + (
                ["phases us"] if phases else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in measured:
        # The server's own latency of the call that carries a decode request.
        rpc = DECODE_RPC.get(r.get("style"), "")
        server = r.get("server_rpc_us", {}).get(rpc)
        cells = [r["case"], fmt(r["p50_us"]), "%s %s" % (rpc, fmt(server)) if server else "-",
                 fmt(r.get("queue_us")), fmt(r.get("kernel_us"))]
        got = r.get("phases_us", {})
        cells += [fmt(got[p]) if p in got else "-" for p in phases]
        if phases:
            cells.append(fmt(sum(got.values())))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + note + backend_counts_table(measured)


def backend_counts_table(measured):
    """The backends' own counters over each case's measured window (indexer_backend_*_total:
    steps, graph launches and builds, buffer growths), where the server exports them."""
    names = sorted({n for r in measured for n in r.get("backend_counts", {})})
    if not names:
        return ""
    head = ["case", "requests"] + names
    lines = ["", "The backend's own counts over each measured window:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in measured:
        got = r.get("backend_counts", {})
        cells = [r["case"], str(r.get("requests", "-"))] + [
            "%d" % got[n] if n in got else "0" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table(rows):
    head = ["case", "what", "p50 us", "p99 us", "kernel us", "overhead us", "req/s",
            "spans/launch", "target", "ratio to target", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("group") == "transport":
            continue
        if r.get("status") != "ok":
            cells = [r["case"], r["what"]] + ["-"] * 6 + [r.get("status", "?"), "-",
                                                           r.get("note", "").replace("|", "/")[:160]]
        else:
            cells = [r["case"], r["what"], fmt(r["p50_us"]), fmt(r["p99_us"]),
                     fmt(r.get("kernel_us")), fmt(r.get("overhead_us")), fmt(r["rate"]),
                     fmt(r.get("spans_per_launch")), r.get("target", ""),
                     fmt(r.get("vs_target"), 2),
                     {True: "yes", False: "**no**"}.get(r.get("met"), "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------


def main(argv):
    args = parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.quick:
        args.duration = 1.0 if args.duration is None else args.duration
        args.warmup = 0.3 if args.warmup is None else args.warmup
    else:
        args.duration = 4.0 if args.duration is None else args.duration
        args.warmup = 1.0 if args.warmup is None else args.warmup
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if args.multigpu_callers < 1:
        die("--multigpu-callers must be at least 1")
    if args.rounds < 1:
        die("--rounds must be at least 1")
    if args.multigpu_connections is not None and args.multigpu_connections < 1:
        die("--multigpu-connections must be at least 1")
    cases = select_cases(all_cases(args.quick, args.multigpu_callers, args.multigpu_connections,
                                   args.device),
                         args.cases, len(devices) >= 2)
    if args.capacity is None:
        args.capacity = default_capacity(cases, args.device)
    if args.list:
        for c in cases:
            print("%-34s %-10s %s" % (c["name"], c["group"], c["what"]))
        print("server --capacity=%s" % args.capacity)
        return 0

    bin_dir = args.bin or next((d for d in (os.path.join(root, ".device/bundle"),
                                            os.path.join(root, "build"))
                                if os.path.isdir(d)), None)
    if bin_dir is None:
        die("give --bin (a bundle or build folder)")
    bins = find_binaries(bin_dir)
    out_dir = args.out or os.path.join(os.environ.get("OUT", "."), "service" if
                                       os.environ.get("OUT") else "service-bench-out")
    os.makedirs(out_dir, exist_ok=True)
    # Reports and logs are written here while the cases run and gathered into three files at the
    # end: the GPU machine's tool brings back only a few files.
    work_dir = tempfile.mkdtemp(prefix="service_bench.")
    reports = {}

    flags = server_flags(bins["indexer-server"])
    servers = Servers(work_dir)

    def on_signal(signum, _frame):
        servers.stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # A call waiting for its batch holds a handler thread: twice the clients, at least 64.
    handler_threads = max([c["concurrency"] * 2 for c in cases if c["style"] == "unary"] + [64])
    gpus = visible_gpus() if args.device == "cuda" else 0
    server_argv = {
        "main": indexer_argv(bins, args, flags, batching=True, handler_threads=handler_threads),
        "nobatch": indexer_argv(bins, args, flags, batching=False,
                                handler_threads=handler_threads),
        "echo": [bins["indexer-echo-server"], "--head_dim=128", "--layers=1"],
    }
    server_argv["main_unix"] = server_argv["main"]
    server_argv["echo_unix"] = server_argv["echo"]
    if len(devices) >= 1:
        server_argv["gpu1"] = indexer_argv(bins, args, flags, devices=devices[0])
        server_argv["gpuall"] = indexer_argv(bins, args, flags, devices=",".join(devices))

    def skip_reason(case):
        if case["server"] == "nobatch" and "batching" not in flags:
            return "this indexer-server has no --batching flag"
        if case["group"] == "multigpu":
            if "devices" not in flags:
                return "this indexer-server has no --devices flag"
            # The one-GPU rate alone is the service's rate at saturation: one GPU suffices.
            if case["server"] == "gpu1" and devices:
                return None
            if len(devices) < 2:
                return "give --devices with two or more GPU ids"
            if args.device != "cuda" or gpus < 2:
                return "%d GPU(s) visible; the multigpu cases need two" % gpus
        return None

    print("service_bench: %d case(s), %s backend, %gs warm-up + %gs each; binaries from %s; "
          "reports in %s" % (len(cases), args.device, args.warmup, args.duration, bin_dir, out_dir),
          file=sys.stderr, flush=True)
    rows = []
    failed = False
    started = time.time()
    # Cases run grouped by the servers they need (each started once: an indexer server with its
    # echo server beside it, over TCP and then over Unix sockets), in the listed order within a
    # group (so the echo server and the indexer take turns), and are reported in the listed
    # order. A server is stopped once no later case needs it; two indexer servers never run at
    # once.
    pair = {"main": 0, "echo": 0, "nobatch": 1, "main_unix": 2, "echo_unix": 2, "gpu1": 3,
            "gpuall": 4}
    # Later rounds of the transport and shm cases come after the first within their servers'
    # group (the sort keeps the listed order), so every round takes its turn with the others.
    runs = [(c, 1) for c in cases] + [
        (c, k) for k in range(2, args.rounds + 1) for c in cases if c["group"] in ("transport", "shm")]
    run_order = sorted(runs, key=lambda cr: pair[cr[0]["server"]])
    try:
        for i, (case, round_) in enumerate(run_order):
            reason = skip_reason(case)
            if reason:
                rows.append({"case": case["name"], "group": case["group"], "what": case["what"],
                             "status": "skipped", "note": reason})
                print("  %-34s skipped: %s" % (case["name"], reason), file=sys.stderr, flush=True)
                continue
            key = case["server"]
            for other in list(servers.running):
                if pair[other] != pair[key]:
                    servers.stop(other)
            if not servers.alive(key):
                servers.stop(key)
                try:
                    servers.start(key, server_argv[key])
                except RuntimeError as e:
                    rows.append({"case": case["name"], "group": case["group"],
                                 "what": case["what"], "status": "failed", "note": str(e)})
                    print("  %-34s FAILED: %s" % (case["name"], e), file=sys.stderr, flush=True)
                    failed = True
                    continue
            row = run_case(case, servers.target(key), bins, args, work_dir, reports, round_)
            rows.append(row)
            if row["status"] != "ok":
                failed = True
                print("  %-34s FAILED: %s" % (case["name"], row["note"]), file=sys.stderr, flush=True)
            else:
                print("  %-34s p50 %s us, p99 %s us, kernel %s us, %s req/s (%.1f s)" % (
                    case["name"], fmt(row["p50_us"]), fmt(row["p99_us"]),
                    fmt(row.get("kernel_us")), fmt(row["rate"]), row["wall_s"]), file=sys.stderr, flush=True)
            later = {c["server"] for c, _ in run_order[i + 1:]}
            if key not in later:
                servers.stop(key)
    finally:
        servers.stop_all()

    rows = median_rounds(rows)
    rows.sort(key=lambda r: [c["name"] for c in cases].index(r["case"]))
    reports = {r["case"]: reports[(r["case"], r.get("round", 1))] for r in rows
               if (r["case"], r.get("round", 1)) in reports}
    apply_targets(rows)
    transport_targets(rows)
    shm_targets(rows)
    md = ""
    if any(r["group"] == "transport" for r in rows):
        md += ("## The service path against the gRPC floor\n\n"
               "One caller in closed loop; echo = indexer-echo-server answering the same calls "
               "(gRPC alone); kernel = the indexer's backend selection time per call (GetStats "
               "over the measured window); allowed = the target for indexer p50 - echo p50; "
               "ratio to target >= 1 is met; stable = indexer-bench's stability check.\n\n")
        md += transport_table(rows) + "\n"
    if any(r["group"] == "shm" for r in rows):
        md += ("## Tensors inline and by reference\n\n"
               "BatchStream over a Unix socket, one caller in closed loop; tensors in system "
               "shared memory are named by reference (keys, queries and outputs), and the echo "
               "server answers the same messages; x inline = indexer p50 by reference over "
               "indexer p50 inline.\n\n")
        md += shm_table(rows) + "\n"
    if any(r["group"] not in ("transport", "shm") for r in rows):
        md += "## Cases\n\n" + table(rows) + "\n"
    md += ("## The server's breakdown of a call\n\n"
           "Microseconds per decode request, from the server's GetStats over the measured "
           "window.\n\n" + breakdown_table(rows))
    header = ("Service benchmark: %s backend%s, %gs warm-up + %gs measured per case, %s.\n"
              "Latencies of one decode request (a Batch call or BatchStream message holding a "
              "whole step, or one unary SelectBlocks); kernel = the server's backend selection "
              "time per request (GetStats, measured window); overhead = p50 - kernel.\n%s\n"
              % (args.device, " (quick)" if args.quick else "", args.warmup, args.duration,
                 time.strftime("%Y-%m-%d %H:%M:%S"),
                 "The transport and shm cases ran in %d rounds, in turn with one another: each "
                 "gives its median round by p50, and every round's difference is beside it.\n"
                 % args.rounds if args.rounds > 1 else ""))
    with open(os.path.join(out_dir, "service_bench.md"), "w") as f:
        f.write(header + md)
    summary = {"device": args.device, "quick": args.quick, "rounds": args.rounds,
               "warmup_s": args.warmup,
               "duration_s": args.duration, "total_s": time.time() - started,
               "server_flags_batching": "batching" in flags, "gpus_visible": gpus,
               "servers": servers.started, "cases": rows}
    summary["reports"] = reports
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out_dir, "logs.txt"), "w") as f:
        for name in sorted(os.listdir(work_dir)):
            if name.endswith(".log"):
                f.write("==== %s ====\n%s\n" % (name, read(os.path.join(work_dir, name))))
    shutil.rmtree(work_dir, ignore_errors=True)
    print(header + md, end="")
    for r in rows:
        if r.get("group") == "transport" and "x_echo" in r:
            print("service_bench: %s over %s, %s: indexer p50 %s us = %.2fx echo p50 %s us; "
                  "indexer - echo %s us (kernel %s us); target %s: %s" % (
                      r["shape"], r["transport"], dict(STYLES)[r["style"]], fmt(r["p50_us"]),
                      r["x_echo"], fmt(r["echo_p50_us"]), fmt(r["diff_us"]),
                      fmt(r.get("kernel_us")), r.get("target", "-"),
                      {True: "met", False: "missed"}.get(r.get("met"), "-")),
                  file=sys.stderr, flush=True)
    print("service_bench: %.0f s in all; wrote %s" % (time.time() - started, out_dir),
          file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
