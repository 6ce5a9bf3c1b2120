#!/usr/bin/env python3
"""Joins indexer-kernel-bench's JSON lines with seed_bench.py's --json output, case by case.

  compare_seed.py kernel_bench.jsonl seed.json

Prints, per decode case, our graph-replayed time (bf16 and fp8 caches), the seed's, the ratio
seed/ours (> 1: we are faster) and our effective bandwidth; per prefill case, score + top-k.
"""
import json
import sys


def main():
    ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    seed = json.load(open(sys.argv[2]))["rows"]
    dev = next((o for o in ours if "device" in o), {})
    print(f"device: {dev.get('device', '?')}")
    print(f"{'case':38s} {'seed us':>9s} {'bf16 us':>9s} {'x seed':>7s} {'TB/s':>6s} {'fp8 us':>9s} {'x seed':>7s}")
    for s in seed:
        if s["kind"] == "decode":
            key = (s["B"], s["L"], s["H"], s["Q"], s["dist"])
            row = {o["storage"]: o for o in ours if o.get("kind") == "decode" and "storage" in o
                   and (o["B"], o["L"], o["H"], o["Q"], o["dist"]) == key}
            b, f = row.get("bf16"), row.get("fp8")
            name = f"decode B={key[0]} L={key[1]} H={key[2]} Q={key[3]} {key[4]}"
            t = s["seed_graph_us"]
            print(f"{name:38s} {t:9.2f} "
                  f"{b['graph_us'] if b else float('nan'):9.2f} {t / b['graph_us'] if b else float('nan'):7.2f} "
                  f"{b['TBps'] if b else float('nan'):6.2f} "
                  f"{f['graph_us'] if f else float('nan'):9.2f} {t / f['graph_us'] if f else float('nan'):7.2f}")
        else:
            key = (s["B"], s["prefix"], s["chunk"], s["H"])
            o = next((o for o in ours if o.get("kind") == "prefill" and "total_us" in o
                      and (o["B"], o["prefix"], o["chunk"], o["H"]) == key), None)
            name = f"prefill B={key[0]} prefix={key[1]} chunk={key[2]} H={key[3]}"
            t = s["seed_total_us"]
            us = o["total_us"] if o else float("nan")
            print(f"{name:38s} {t:9.1f} {us:9.1f} {t / us:7.2f}")


if __name__ == "__main__":
    main()
