"""A plain numpy selector written from SPEC.md, to check the server's answers.

It is slow (it scores every key against every query) and meant for tests and spot checks.
Dot products are fp32 with numpy's summation order; SPEC.md lets results differ only where two
blocks' scores differ by rounding, so compare exactly only with inputs whose sums are exact
(for example small integer values).
"""
from typing import Optional, Sequence

import numpy as np

from indexer_client.bf16 import round_to_bf16, round_to_fp4_e2m1, round_to_fp8_e4m3
from indexer_client.selection import Selection

BLOCK_SIZE = 128
INIT_SCORE = np.float32(1e30)
LOCAL_SCORE = np.float32(1e29)
EMPTY_SCORE = np.float32(-1e30)
_NO_LENGTHS = np.zeros(0, np.int64)


def reference_select(keys, queries, p0: int, topk: int, init_blocks: int, local_blocks: int,
                     attn_pages: Optional[Sequence[int]] = None, pages_per_block: int = 8,
                     block_page_stride: int = 8, key_storage: str = "bf16") -> Selection:
    """Selects blocks for queries [n][H][head_dim] at positions p0 .. p0 + n - 1.

    keys: [len][head_dim], one layer of the sequence (values are rounded to bf16 here, then to
    the cache's storage, as the server does). attn_pages: the sequence's attention page per block,
    to build the sparse page table. key_storage: the server's ServerInfo.key_storage ("bf16",
    "fp8_e4m3" or "fp4_e2m1"). Returns a Selection (lengths empty).
    """
    keys = round_to_bf16(np.asarray(keys, dtype=np.float32))
    if key_storage == "fp8_e4m3":
        keys = round_to_fp8_e4m3(keys)
    elif key_storage == "fp4_e2m1":
        keys = round_to_fp4_e2m1(keys)
    elif key_storage != "bf16":
        raise ValueError(f"key_storage {key_storage!r} is not bf16, fp8_e4m3 or fp4_e2m1")
    q = round_to_bf16(np.asarray(queries, dtype=np.float32))
    n, heads, dim = q.shape
    positions = p0 + np.arange(n)
    if p0 < 0 or positions[-1] >= len(keys):
        raise ValueError(f"positions [{p0}, {p0 + n}) are not inside the {len(keys)} keys")
    blocks = int(positions[-1]) // BLOCK_SIZE + 1
    padded = np.zeros((blocks * BLOCK_SIZE, dim), np.float32)
    padded[: min(len(keys), len(padded))] = keys[: len(padded)]

    # Raw scores: max over each block's visible tokens of the fp32 dot product; NaN dots are left
    # out, and a block with nothing left scores EMPTY_SCORE.
    with np.errstate(all="ignore"):
        dots = (q.reshape(n * heads, dim) @ padded.T).reshape(n, heads, blocks, BLOCK_SIZE)
    token = np.arange(blocks * BLOCK_SIZE).reshape(blocks, BLOCK_SIZE)
    valid = (token[None, None] <= positions[:, None, None, None]) & ~np.isnan(dots)
    best = np.where(valid, dots, np.float32(-np.inf)).max(axis=-1)
    raw = np.where(valid.any(axis=-1), best, EMPTY_SCORE).astype(np.float32) + np.float32(0.0)

    block_ids = np.full((n, heads, topk), -1, np.int32)
    for i, p in enumerate(positions):
        visible = int(p) // BLOCK_SIZE + 1
        b = np.arange(visible)
        score = raw[i, :, :visible].copy()
        score[:, b < init_blocks] = INIT_SCORE
        score[:, b >= visible - local_blocks] = LOCAL_SCORE  # local overrides init
        # Descending score, ties to the lower block id.
        order = np.lexsort((np.broadcast_to(b, score.shape), -score), axis=-1)
        k = min(topk, visible)
        block_ids[i, :, :k] = order[:, :k]
    if attn_pages is None:
        return Selection(start_position=p0, lengths=_NO_LENGTHS, block_ids=block_ids)

    page_table = np.zeros((n, heads, topk * pages_per_block), np.int32)
    context_lens = np.zeros((n, heads), np.int32)
    for i, p in enumerate(positions):
        p = int(p)
        self_block = p // BLOCK_SIZE
        for h in range(heads):
            selected = list(block_ids[i, h])
            full = [b for b in selected if 0 <= b < self_block]
            tail = self_block in selected
            for slot, b in enumerate(full + [self_block] * tail):
                base = attn_pages[b] * block_page_stride
                page_table[i, h, slot * pages_per_block:(slot + 1) * pages_per_block] = \
                    base + np.arange(pages_per_block)
            context_lens[i, h] = (len(full) * BLOCK_SIZE + (p + 1 - BLOCK_SIZE * self_block)
                                  if tail else min(len(full) * BLOCK_SIZE, p + 1))
    return Selection(start_position=p0, lengths=_NO_LENGTHS, block_ids=block_ids,
                     page_table=page_table, context_lens=context_lens,
                     pages_per_block=pages_per_block)
