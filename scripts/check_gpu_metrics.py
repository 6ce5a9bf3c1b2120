#!/usr/bin/env python3
"""Checks a CUDA indexer-server's Prometheus exposition: what only a real GPU can show.

    scripts/check_gpu_metrics.py http://127.0.0.1:50192/metrics

Scrapes the URL once and requires, for every device the server runs on:
  - NVML's gauges (indexer_gpu_memory_total_bytes and _used_bytes, utilisation ratios) with a
    device label, memory totals above zero and used at most total, ratios within [0, 1];
  - the CUDA backend's own series (indexer_backend_lanes, _steps_total, _graph_launches_total,
    _graph_builds_total), with steps above zero once a workload ran;
  - the exposition well formed: every sample's family has HELP and TYPE lines, no sample twice.
Runs promtool check metrics as well when promtool is on PATH. Prints what it found; exit status
0 when everything holds, 1 otherwise (each problem printed), 2 on a usage error.
Python 3 standard library only (the GPU machine installs nothing).
"""
import re
import shutil
import subprocess
import sys
import urllib.request

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

GPU_GAUGES = ("indexer_gpu_memory_total_bytes", "indexer_gpu_memory_used_bytes",
              "indexer_gpu_utilization_ratio", "indexer_gpu_memory_utilization_ratio")
BACKEND_SERIES = ("indexer_backend_lanes", "indexer_backend_steps_total",
                  "indexer_backend_graph_launches_total", "indexer_backend_graph_builds_total")


def parse(text):
    """(samples, problems): samples as {(name, frozenset(labels)): value}."""
    samples, problems, described, typed = {}, [], set(), set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            described.add(line.split()[2])
        elif line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            if not m:
                problems.append(f"unparsable line: {line}")
                continue
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            key = (name, frozenset(LABEL.findall(labels)))
            if key in samples:
                problems.append(f"sample twice: {line}")
            samples[key] = float(value)
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in typed and family not in typed:
                problems.append(f"{name} has no TYPE line")
            if name not in described and family not in described:
                problems.append(f"{name} has no HELP line")
    return samples, problems


def by_device(samples, name):
    return {dict(labels).get("device"): v for (n, labels), v in samples.items() if n == name}


def check(samples):
    problems = []
    devices = set()
    for name in GPU_GAUGES:
        values = by_device(samples, name)
        if not values:
            problems.append(f"{name} is missing (NVML not loaded?)")
        if None in values:
            problems.append(f"{name} has a sample without a device label")
        devices |= {d for d in values if d is not None}
        for device, v in values.items():
            print(f"{name}{{device={device}}} {v:g}")
            if name.endswith("_ratio") and not 0 <= v <= 1:
                problems.append(f"{name}{{device={device}}} is {v}, outside [0, 1]")
    total = by_device(samples, "indexer_gpu_memory_total_bytes")
    used = by_device(samples, "indexer_gpu_memory_used_bytes")
    for device, t in total.items():
        if t <= 0:
            problems.append(f"device {device}: memory total is {t}")
        if device in used and not 0 < used[device] <= t:
            problems.append(f"device {device}: memory used {used[device]} is not in (0, {t}]")
    for name in BACKEND_SERIES:
        values = by_device(samples, name)
        if not values:
            problems.append(f"{name} is missing (not a CUDA backend?)")
        for device, v in values.items():
            print(f"{name}{{device={device}}} {v:g}")
        if name == "indexer_backend_steps_total" and values and sum(values.values()) <= 0:
            problems.append(f"{name} is 0 after a workload")
    if not devices:
        problems.append("no device label on any GPU gauge")
    return problems


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) == 2 else 2
    with urllib.request.urlopen(argv[1], timeout=10) as r:
        text = r.read().decode()
    samples, problems = parse(text)
    problems += check(samples)
    if shutil.which("promtool"):
        run = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                             text=True)
        print(f"promtool check metrics: exit {run.returncode}")
        if run.returncode != 0:
            problems.append(f"promtool: {run.stdout}{run.stderr}")
    else:
        print("promtool is not installed here: only this script's checks ran")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"{len(samples)} samples, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
