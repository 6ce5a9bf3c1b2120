#!/usr/bin/env python3
"""What sharing one GPU between two processes costs a small step: the round trip of a tiny
kernel (launch, then synchronize), p50 and p90 of 4,000,
  - alone;
  - beside a second process that copies 512 bytes to the same GPU every GAP seconds;
  - in turn with it: the other process copies, then hands over (a pipe), then this one
    launches, as a scheduler that writes its tensors to the GPU and then calls indexer-server
    on the same GPU (CUDA regions, docs/DEPLOY.md) does; and the same two steps in one process.
Without MPS the two processes' CUDA contexts take turns on the GPU. Needs torch with CUDA.

    python3 scripts/gpu_share_probe.py [GAP ...]      (default 0.0002 0.001)
"""
import os
import subprocess
import sys
import time

import torch

N = 4000


def copier(seconds: float, gap: float) -> None:
    y = torch.empty(128, device="cuda")
    h = torch.ones(128).pin_memory()
    end = time.time() + seconds
    while time.time() < end:
        y.copy_(h)
        torch.cuda.synchronize()
        time.sleep(gap)


def turn_copier(go: int, done: int) -> None:
    """Copies, then writes a byte to `go`; waits for a byte on `done`; N + 500 times."""
    y = torch.empty(128, device="cuda")
    h = torch.ones(128).pin_memory()
    for _ in range(N + 500):
        y.copy_(h)
        torch.cuda.synchronize()
        os.write(go, b"x")
        os.read(done, 1)


def percentiles(times):
    times = sorted(times)
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6


def round_trip(x) -> float:
    t0 = time.perf_counter()
    x.add_(1)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--copier":
        copier(float(sys.argv[2]), float(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--turn-copier":
        turn_copier(int(sys.argv[2]), int(sys.argv[3]))
        return
    gaps = [float(g) for g in sys.argv[1:]] or [0.0002, 0.001]
    x = torch.zeros(16, device="cuda")
    [round_trip(x) for _ in range(500)]
    print("alone: kernel round trip p50 %.1f us, p90 %.1f us"
          % percentiles([round_trip(x) for _ in range(N)]))
    for gap in gaps:
        other = subprocess.Popen([sys.executable, __file__, "--copier", "8", str(gap)])
        time.sleep(3)  # the copier's CUDA start-up
        print("beside a process copying to the GPU every %g s: p50 %.1f us, p90 %.1f us"
              % ((gap,) + percentiles([round_trip(x) for _ in range(N)])))
        other.wait()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    other = subprocess.Popen([sys.executable, __file__, "--turn-copier", str(go_w), str(done_r)],
                             pass_fds=(go_w, done_r))
    times = []
    for _ in range(N + 500):
        os.read(go_r, 1)
        times.append(round_trip(x))
        os.write(done_w, b"x")
    other.wait()
    print("in turn with a process that copies to the GPU first: p50 %.1f us, p90 %.1f us"
          % percentiles(times[500:]))
    y = torch.empty(128, device="cuda")
    h = torch.ones(128).pin_memory()
    times = []
    for _ in range(N):
        y.copy_(h)
        torch.cuda.synchronize()
        times.append(round_trip(x))
    print("the copy and the kernel in one process: p50 %.1f us, p90 %.1f us" % percentiles(times))


if __name__ == "__main__":
    main()
