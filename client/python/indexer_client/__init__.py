"""Python client of the indexer service (sparse-attention block selection, proto/indexer/v1).

The generated stubs are not part of this package: put <build>/python (or the output of
generate_stubs.sh) on PYTHONPATH, e.g. PYTHONPATH=<build>/python:client/python.
"""
from indexer_client.bf16 import (from_bf16_bits, from_bf16_bytes, round_to_bf16, to_bf16_bits,
                                 to_bf16_bytes)
from indexer_client.client import BatchStream, IndexerClient, IndexerError, Step, append_request
from indexer_client.hash_ring import HashRing, shard_key
from indexer_client.reference import reference_select
from indexer_client.selection import Selection
from indexer_client.sharded_client import ShardedClient

__all__ = [
    "BatchStream", "HashRing", "IndexerClient", "IndexerError", "Selection", "ShardedClient", "Step",
    "append_request", "from_bf16_bits", "from_bf16_bytes", "reference_select", "round_to_bf16",
    "shard_key", "to_bf16_bits", "to_bf16_bytes",
]
