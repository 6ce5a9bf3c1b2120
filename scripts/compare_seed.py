#!/usr/bin/env python3
"""Joins indexer-kernel-bench's JSON lines with seed_bench.py's --json output, case by case.

  compare_seed.py kernel_bench.jsonl seed.json

Prints, per decode case, our graph-replayed time per key cache (bf16, fp8, fp4: whichever the
benchmark ran), the seed's, the ratio seed/ours (> 1: we are faster), our effective bandwidth on
bf16 and fp4 (stored bytes), and fp4's time over fp8's; per prefill case, score + top-k (bf16,
and fp4 when it ran).
"""
import json
import sys

NAN = float("nan")


def main():
    ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    seed = json.load(open(sys.argv[2]))["rows"]
    dev = next((o for o in ours if "device" in o), {})
    print(f"device: {dev.get('device', '?')}")
    print(f"{'case':38s} {'seed us':>9s} {'bf16 us':>9s} {'x seed':>7s} {'TB/s':>6s} {'fp8 us':>9s} "
          f"{'x seed':>7s} {'fp4 us':>9s} {'x seed':>7s} {'TB/s':>6s} {'fp4/fp8':>7s}")
    for s in seed:
        if s["kind"] == "decode":
            key = (s["B"], s["L"], s["H"], s["Q"], s["dist"])
            row = {o["storage"]: o for o in ours if o.get("kind") == "decode" and "storage" in o
                   and (o["B"], o["L"], o["H"], o["Q"], o["dist"]) == key}
            b, f, q = row.get("bf16"), row.get("fp8"), row.get("fp4")
            us = {k: (o["graph_us"] if o else NAN) for k, o in (("b", b), ("f", f), ("q", q))}
            name = f"decode B={key[0]} L={key[1]} H={key[2]} Q={key[3]} {key[4]}"
            t = s["seed_graph_us"]
            print(f"{name:38s} {t:9.2f} {us['b']:9.2f} {t / us['b']:7.2f} "
                  f"{b['TBps'] if b else NAN:6.2f} {us['f']:9.2f} {t / us['f']:7.2f} "
                  f"{us['q']:9.2f} {t / us['q']:7.2f} {q['TBps'] if q else NAN:6.2f} "
                  f"{us['q'] / us['f']:7.2f}")
        else:
            key = (s["B"], s["prefix"], s["chunk"], s["H"])
            t = s["seed_total_us"]
            for storage in ("bf16", "fp4"):
                o = next((o for o in ours if o.get("kind") == "prefill" and "total_us" in o
                          and o.get("storage", "bf16") == storage
                          and (o["B"], o["prefix"], o["chunk"], o["H"]) == key), None)
                if o is None and storage != "bf16":
                    continue
                name = f"prefill {storage} B={key[0]} prefix={key[1]} chunk={key[2]} H={key[3]}"
                us = o["total_us"] if o else NAN
                print(f"{name:38s} {t:9.1f} {us:9.1f} {t / us:7.2f}")


if __name__ == "__main__":
    main()
