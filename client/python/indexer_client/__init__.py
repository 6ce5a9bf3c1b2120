"""Python client of the indexer service (sparse-attention block selection, proto/indexer/v1).

IndexerClient (blocking) and AsyncIndexerClient (asyncio, grpc.aio) have the same methods;
answers are dataclasses of numpy arrays; tensors may be numpy arrays, torch tensors, or
references into registered shared-memory regions (SystemRegion; CudaRegion for GPU memory;
TensorRef, OutputRefs). The gRPC
stubs are generated into the package when it is built (pip install ./client/python).
"""
from indexer_client._version import __version__
from indexer_client.aio import AsyncBatchStream, AsyncIndexerClient
from indexer_client.bf16 import (from_bf16_bits, from_bf16_bytes, round_to_bf16, to_bf16_bits,
                                 to_bf16_bytes)
from indexer_client.client import IndexerClient
from indexer_client.cuda_region import CudaRegion
from indexer_client.errors import IndexerError
from indexer_client.hash_ring import HashRing, shard_key
from indexer_client.reference import reference_select
from indexer_client.refs import OutputRefs, RegionRef, TensorRef
from indexer_client.results import (AppendResult, ForkResult, RegionStatus, ReleaseResult,
                                    SequenceInfo, ServerInfo, SnapshotResult, TruncateResult)
from indexer_client.selection import Selection
from indexer_client.shared_memory import SystemRegion
from indexer_client.sharded_client import ShardedClient
from indexer_client.steps import Shapes, Step, append_request
from indexer_client.stream import BatchStream

__all__ = [
    "AppendResult", "AsyncBatchStream", "AsyncIndexerClient", "BatchStream", "CudaRegion",
    "ForkResult",
    "HashRing", "IndexerClient", "IndexerError", "OutputRefs", "RegionRef", "RegionStatus",
    "ReleaseResult", "Selection", "SequenceInfo", "ServerInfo", "Shapes", "ShardedClient",
    "SnapshotResult", "Step", "SystemRegion", "TensorRef", "TruncateResult", "__version__",
    "append_request", "from_bf16_bits", "from_bf16_bytes", "reference_select", "round_to_bf16",
    "shard_key", "to_bf16_bits", "to_bf16_bytes",
]
