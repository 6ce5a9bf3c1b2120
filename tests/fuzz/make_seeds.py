#!/usr/bin/env python3
"""Writes the hand-made seeds of the service fuzzer's corpus (tests/fuzz/corpus/seed-*).

Each seed is a script in the format service_fuzzer.cc reads: a configuration byte, then
operations. The helpers below mirror its readers one for one (ScriptReader, PickId, FillAppend,
FillSelect, RunScript), so a seed says in words what it does. Inputs that fuzzing found
interesting are added to the corpus by scripts/fuzz.sh (merged, minimized), not here.

Usage: tests/fuzz/make_seeds.py [corpus folder]   (default: the corpus/ folder beside this file)
"""
import os
import struct
import sys

# Configuration bits (Harness): 1 two layers, 2 fp8 storage, 4 small answer and score budgets,
# 8 max_sequences 4, 16 a CPU worker thread, 32 init_blocks 1, 64 local_blocks 0,
# 128 block_page_stride 4.
TWO_LAYERS, FP8, SMALL_BUDGET, FEW_SEQUENCES, THREADS = 1, 2, 4, 8, 16

# Operation kinds (RunScript: kind % 12).
# GET and INFO share kind 9; bit 4 picks GetSequence (21 % 12 == 9).
APPEND, SELECT, BATCH, RELEASE, TRUNCATE, FORK, GET, INFO, RAW, FAULT = 0, 2, 4, 6, 7, 8, 21, 9, 10, 11

BF16, FP32 = 0, 120  # PickDtype
INTS, REALS = 0, 2   # Values styles: small integers, reals


def u32(v):
    return struct.pack('<I', v & 0xffffffff)


def seq(i):
    """PickId: 's<i>' for i < 6."""
    return bytes([i])


def rows(n):
    """PickRows: 1..16 rows exactly, or a multiple of 23 (b - 199) * 23 for larger ones."""
    if 1 <= n <= 16:
        return bytes([n - 1])
    assert n % 23 == 0 and 1 <= n // 23 <= 50
    return bytes([199 + n // 23])


def values(style=INTS, seed=1):
    return bytes([style]) + u32(seed)


def append(layer=0, n=8, all_layers=False, attn=None, dtype=BF16, style=INTS, seed=1):
    flags = (1 if all_layers else 0) | (2 if attn is not None else 0)
    out = bytes([flags, layer, dtype]) + rows(n) + values(style, seed)
    if attn is not None:
        out += bytes([len(attn)]) + bytes(attn)
    return out


def select(layer=0, heads=1, tokens=1, with_append=None, start=None, topk=None, dtype=BF16,
           seed=2):
    """FillSelect. tokens: 1 or 2 use the short form, else PickRows."""
    flags = 0
    if with_append is not None:
        flags |= 1
    if start is not None:
        flags |= 2
    long_form = tokens > 2
    if long_form:
        flags |= 32
    if topk is not None:
        flags |= 4
    body = bytes([layer])
    if with_append is not None:
        body += bytes([0]) + with_append  # which < 200: the append names the same sequence
    if start is not None:
        body += bytes([start])
    body += bytes([heads, dtype])
    body += rows(tokens) if long_form else bytes([tokens - 1])
    body += values(INTS, seed)
    if topk is not None:
        body += bytes([topk])
    return bytes([flags]) + body


def op_append(i, **kw):
    return bytes([APPEND]) + seq(i) + append(**kw)


def op_select(i, **kw):
    return bytes([SELECT]) + seq(i) + select(**kw)


def op_batch(items, request_id=7):
    out = bytes([BATCH, len(items) - 1])
    for i, kw in items:
        out += seq(i) + select(**kw)
    return out + struct.pack('<Q', request_id)


def op_release(i):
    return bytes([RELEASE]) + seq(i)


def op_truncate(i, length):
    assert length % 3 == 0 and length // 3 < 250
    return bytes([TRUNCATE]) + seq(i) + bytes([length // 3])


def op_fork(src, dst, length=None):
    if length is None:
        b = 200
    else:
        assert length % 3 == 0 and length // 3 < 128
        b = length // 3
    return bytes([FORK]) + seq(src) + seq(dst) + bytes([b])


def op_fault(nth=1):
    return bytes([FAULT, nth - 1])


def varint(v):
    out = b''
    while True:
        b = v & 0x7f
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_bytes(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def op_raw(kind, wire):
    assert len(wire) < 256
    return bytes([RAW, kind]) + bytes([len(wire)]) + wire


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), 'corpus')
    os.makedirs(folder, exist_ok=True)
    bf16_ones = struct.pack('<H', 0x3f80) * 64  # one token of head_dim 64, all 1.0
    seeds = {
        # Append, decode steps, a span, a batch, fork, truncate, get, info, release.
        'basic': bytes([0]) + op_append(0, n=16) + op_select(0) + op_select(0, heads=2, tokens=4)
        + op_batch([(0, dict(tokens=1)), (1, dict(with_append=append(n=3)))])
        + op_fork(0, 2, 9) + op_truncate(0, 6) + bytes([GET]) + seq(2) + bytes([INFO])
        + op_release(0) + op_release(2),
        # Two layers, all-layer appends with attention pages, multi-block sequences.
        'layers_attn': bytes([TWO_LAYERS | THREADS]) + op_append(1, n=138, all_layers=True,
                                                                  attn=[10, 11])
        + op_select(1, layer=1, heads=3, tokens=5, topk=3)
        + op_append(1, n=2, layer=0) + op_select(1, layer=0, start=100)
        + op_fork(1, 3) + op_append(3, n=23 * 6, all_layers=True, attn=[12, 13])
        + op_select(3, with_append=append(n=1, all_layers=True)),
        # fp8 storage, fp32 wire values, real-valued keys.
        'fp8_fp32': bytes([FP8]) + op_append(2, n=46, dtype=FP32, style=REALS)
        + op_select(2, dtype=FP32, heads=2) + op_append(2, n=5, style=REALS, seed=9)
        + op_select(2, tokens=3, start=10, topk=11),
        # Faults: a write, a page copy (after a fork) and a selection that fail; nothing changes.
        'faults': bytes([TWO_LAYERS]) + op_append(0, n=138) + op_fork(0, 1)
        + op_fault(1) + op_append(1, n=5) + op_fault(2) + op_append(1, n=5)
        + op_fault(3) + op_select(1, with_append=append(n=4))
        + op_fault(1) + op_batch([(0, dict(with_append=append(n=1))), (1, dict())])
        + op_select(1) + op_release(0) + op_select(1),
        # Limits: four sequences at most, a small answer budget, pool exhaustion, big requests.
        'limits': bytes([FEW_SEQUENCES | SMALL_BUDGET]) + op_append(0, n=23 * 20)
        + op_append(1, n=23 * 20) + op_append(2, n=23 * 20) + op_append(3, n=4)
        + op_append(4, n=4) + op_fork(3, 5, 0) + op_release(3) + op_fork(2, 5, 0)
        + op_select(0, heads=3, tokens=16, topk=12) + op_append(0, n=23 * 40)
        + op_batch([(i % 3, dict(tokens=2)) for i in range(7)]),
        # Whole wire messages, as a client could send them.
        'raw': bytes([0])
        + op_raw(0, field_bytes(1, b's4') + field_varint(4, 1) + field_bytes(5, bf16_ones))
        + op_raw(1, field_bytes(1, b's4') + field_varint(5, 1) + field_varint(6, 1)
                 + field_bytes(7, bf16_ones[:64]) + field_bytes(7, bf16_ones[64:]))
        + op_raw(3, field_bytes(1, b's4') + field_bytes(2, b's5') + field_varint(3, 0))
        + op_raw(4, field_bytes(1, b's4') + field_varint(2, 0))
        + op_raw(5, field_bytes(1, b's5')) + op_raw(5, b'\xff\xff\xff'),
    }
    for name, data in seeds.items():
        with open(os.path.join(folder, 'seed-' + name), 'wb') as f:
            f.write(data)
        print(f'{name}: {len(data)} bytes')


if __name__ == '__main__':
    main()
