#!/usr/bin/env python3
"""A scheduler's decode loop against indexer-server: prefill, decode, speculate, release.

Random numbers stand in for the model's index keys and queries. After
`pip install ./client/python`, run it against a server with
  python3 client/python/examples/decode_loop.py --server HOST:PORT   (or unix:/path/to.sock)
Every answer is a dataclass of numpy arrays: AppendResult.lengths is int64 [layers],
Selection.block_ids int32 [n][H][topk], page_table int32 [n][H][topk * pages_per_block],
context_lens int32 [n][H].
"""
import argparse
import itertools

import numpy as np

from indexer_client import IndexerClient, Step

BLOCK = 128  # tokens per block (SPEC.md)
TOPK, INIT_BLOCKS, LOCAL_BLOCKS = 4, 1, 1


def blocks(tokens):
    return -(-tokens // BLOCK)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051",
                        help="indexer-server target: host:port, or unix:/path/to.sock")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    with IndexerClient(args.server) as client:
        client.wait_until_serving()
        info = client.server_info()
        dim, layers, heads = info.head_dim, info.layers, min(4, info.max_index_heads)
        print(f"server {args.server}: {info.backend} ({info.device}), head_dim {dim}, "
              f"{layers} layers, {info.free_pages}/{info.total_pages} pages free")

        # The scheduler's own state per sequence: its length and its attention-cache pages, one
        # per 128-token block (here drawn from a counter; a real engine has an allocator).
        attn_ids = itertools.count(100)
        length, attn = {}, {}

        def opened(sid, n):
            """Attention page ids for the blocks that appending n tokens to `sid` opens."""
            new = [next(attn_ids) for _ in range(blocks(length[sid] + n) - blocks(length[sid]))]
            attn[sid] += new
            return new

        def keys(n):
            return rng.standard_normal((n, dim), dtype=np.float32)

        def queries(n):
            return rng.standard_normal((n, heads, dim), dtype=np.float32)

        # Prefill: every layer's keys of a 512-token chunk arrive together ([n][layers][dim]);
        # the chunk's own queries then select blocks (shown for layer 0 only).
        for sid, prompt in [("seq-0", 1000), ("seq-1", 700), ("seq-2", 1500)]:
            length[sid], attn[sid] = 0, []
            for start in range(0, prompt, 512):
                n = min(512, prompt - start)
                r = client.append_keys(sid, rng.standard_normal((n, layers, dim), dtype=np.float32),
                                       attention_pages=opened(sid, n))
                length[sid] += n
                sel = client.select_blocks(sid, queries(n), topk=TOPK, init_blocks=INIT_BLOCKS,
                                           local_blocks=LOCAL_BLOCKS)
            print(f"prefill {sid}: {r.lengths.tolist()} tokens per layer in {r.num_blocks} blocks; "
                  f"last chunk's block ids {sel.block_ids.dtype} {sel.block_ids.shape}, page "
                  f"table {sel.page_table.shape}")

        # Decode: per step and layer, ONE call over the open stream carries, for every live
        # sequence, the new token's key and its query (append, then select, atomically). A step
        # not answered within 5 s raises IndexerError (DEADLINE_EXCEEDED).
        with client.open_stream() as stream:
            for step in range(4):
                new_attn = {sid: opened(sid, 1) for sid in length}  # opened by layer 0's append
                for layer in range(layers):
                    items = [Step(sid, layer=layer, keys=keys(1), queries=queries(1),
                                  attention_pages=new_attn[sid] if layer == 0 else (),
                                  topk=TOPK, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS)
                             for sid in length]
                    results = stream.step(items, timeout=5.0)
                    # Attention reads results[i].page_table[0][h][:context_lens...] per head.
                    sel = results[0]
                    print(f"decode step {step} layer {layer}: seq-0 position {sel.start_position}, "
                          f"head 0 blocks {sel.block_ids[0, 0].tolist()}, context "
                          f"{sel.context_lens[0, 0]} tokens, pages {sel.page_table[0, 0, :3].tolist()}...")
                for sid in length:
                    length[sid] += 1

        # Speculative decoding: 3 draft tokens per sequence, selected together (n = 3) in one
        # Batch call per layer; then the rejected drafts are rolled back with TruncateSequence.
        drafts = 3
        new_attn = {sid: opened(sid, drafts) for sid in length}
        for layer in range(layers):
            results = client.batch([Step(sid, layer=layer, keys=keys(drafts), queries=queries(drafts),
                                         attention_pages=new_attn[sid] if layer == 0 else (),
                                         topk=TOPK, init_blocks=INIT_BLOCKS,
                                         local_blocks=LOCAL_BLOCKS) for sid in length])
        for sid, sel in zip(length, results):
            accepted = int(rng.integers(0, drafts + 1))
            r = client.truncate(sid, length[sid] + accepted)
            length[sid] += accepted
            del attn[sid][r.num_blocks:]  # blocks past the new length are gone (free their pages)
            print(f"speculate {sid}: positions {sel.positions.tolist()} -> block ids "
                  f"{sel.block_ids.shape}; accepted {accepted}/{drafts}, lengths now "
                  f"{r.lengths.tolist()}")

        for sid in length:
            print(f"release {sid}: {client.release(sid).pages_freed} pages freed")
        print(f"done: {client.server_info().free_pages}/{info.total_pages} pages free")


if __name__ == "__main__":
    main()
