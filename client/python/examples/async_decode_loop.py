#!/usr/bin/env python3
"""An asyncio scheduler's decode loop: two micro-batches in flight on one BatchStream.

While the model runs one micro-batch, the indexer selects blocks for the other: each step sends
both micro-batches' requests before awaiting either answer. Random numbers stand in for the
model's index keys and queries. Run it against a server with
  python3 client/python/examples/async_decode_loop.py --server HOST:PORT   (or unix:/path.sock)
after `pip install ./client/python`.
"""
import argparse
import asyncio

import numpy as np

from indexer_client import AsyncIndexerClient, Step

TOPK = 4


async def main(target: str) -> None:
    rng = np.random.default_rng(0)
    async with AsyncIndexerClient(target) as client:
        await client.wait_until_serving()
        info = await client.server_info()
        dim, heads = info.head_dim, min(2, info.max_index_heads)
        print(f"server {target}: {info.backend}, head_dim {dim}, {info.layers} layers")

        # Prefill: four sequences' keys for every layer, concurrently.
        sequences = [f"async-seq-{i}" for i in range(4)]
        prompts = [300, 500, 129, 1000]
        await asyncio.gather(*(
            client.append_keys(sid, rng.standard_normal((n, info.layers, dim), dtype=np.float32))
            for sid, n in zip(sequences, prompts)))
        micro_batches = [sequences[:2], sequences[2:]]

        def steps(batch, layer):
            return [Step(sid, layer=layer, keys=rng.standard_normal((1, dim), dtype=np.float32),
                         queries=rng.standard_normal((1, heads, dim), dtype=np.float32), topk=TOPK)
                    for sid in batch]

        async with client.open_stream(max_in_flight=2) as stream:
            for step in range(3):
                for layer in range(info.layers):
                    # Both micro-batches go out at once; their answers come back in order.
                    futures = [await stream.submit(steps(batch, layer)) for batch in micro_batches]
                    for batch, future in zip(micro_batches, futures):
                        for sid, sel in zip(batch, await future):
                            # sel.block_ids: int32 [1][heads][TOPK]; sel.lengths: int64 [layers]
                            if layer == 0:
                                print(f"step {step}: {sid} position {sel.start_position}, head 0 "
                                      f"blocks {sel.block_ids[0, 0].tolist()}")

        freed = await asyncio.gather(*(client.release(sid) for sid in sequences))
        print(f"done: released {sum(r.pages_freed for r in freed)} pages")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051",
                        help="indexer-server target: host:port, or unix:/path/to.sock")
    asyncio.run(main(parser.parse_args().server))
