"""Each unary call of the API as a Call: the service and method, the request, and how the answer
becomes a typed result. The blocking and the asyncio client both run these, so the two build
the same requests and return the same results.
"""
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from indexer_client._stubs import health_modules, pb, pb_grpc
from indexer_client.results import (AppendResult, ForkResult, RegionStatus, ReleaseResult,
                                    SequenceInfo, ServerInfo, SnapshotResult, TruncateResult)
from indexer_client.selection import Selection
from indexer_client.steps import (Shapes, Step, append_request, batch_outputs, batch_request,
                                  batch_results, output_refs)

INDEXER, ADMIN, HEALTH = "indexer", "admin", "health"


@dataclass(frozen=True)
class Call:
    service: str  # INDEXER, ADMIN or HEALTH
    method: str
    request: object
    convert: Callable


def append_keys(sequence_id: str, keys, layer: int, all_layers: Optional[bool],
                attention_pages: Sequence[int], wire_dtype: str, shapes: Optional[Shapes]) -> Call:
    request = append_request(sequence_id, keys, layer, all_layers, attention_pages, wire_dtype,
                             shapes)
    return Call(INDEXER, "AppendKeys", request, AppendResult.from_proto)


def select_blocks(sequence_id: str, queries, step: dict, shapes: Optional[Shapes]) -> Call:
    request = Step(sequence_id, queries=queries, **step).to_proto(shapes)
    refs = output_refs(request)
    return Call(INDEXER, "SelectBlocks", request,
                lambda response: Selection.from_proto(response, refs))


def batch(steps: Iterable[Step], request_id: int, return_exceptions: bool,
          shapes: Optional[Shapes]) -> Call:
    request = batch_request(steps, request_id, shapes)
    outputs = batch_outputs(request)
    return Call(INDEXER, "Batch", request,
                lambda response: batch_results(response, return_exceptions, outputs))


def register_system_region(name: str, key: str, byte_size: int, offset: int) -> Call:
    request = pb.RegisterSystemRegionRequest(name=name, key=key, offset=offset,
                                             byte_size=byte_size)
    return Call(INDEXER, "RegisterSystemRegion", request, lambda response: None)


def register_cuda_region(name: str, raw_handle: bytes, device_id: int, byte_size: int,
                         offset: int) -> Call:
    request = pb.RegisterCudaRegionRequest(name=name, raw_handle=raw_handle, device_id=device_id,
                                           offset=offset, byte_size=byte_size)
    return Call(INDEXER, "RegisterCudaRegion", request, lambda response: None)


def unregister_region(name: str) -> Call:
    return Call(INDEXER, "UnregisterRegion", pb.UnregisterRegionRequest(name=name),
                lambda response: response.unregistered)


def list_regions(name: str) -> Call:
    return Call(INDEXER, "ListRegions", pb.ListRegionsRequest(name=name),
                lambda response: [RegionStatus.from_proto(r) for r in response.regions])


def release(sequence_id: str) -> Call:
    return Call(INDEXER, "ReleaseSequence", pb.ReleaseSequenceRequest(sequence_id=sequence_id),
                ReleaseResult.from_proto)


def truncate(sequence_id: str, length: int) -> Call:
    return Call(INDEXER, "TruncateSequence",
                pb.TruncateSequenceRequest(sequence_id=sequence_id, length=length),
                TruncateResult.from_proto)


def fork(source_id: str, target_id: str, length: Optional[int]) -> Call:
    request = pb.ForkSequenceRequest(source_id=source_id, target_id=target_id)
    if length is not None:
        request.length = length
    return Call(INDEXER, "ForkSequence", request, ForkResult.from_proto)


def get_sequence(sequence_id: str) -> Call:
    return Call(INDEXER, "GetSequence", pb.GetSequenceRequest(sequence_id=sequence_id),
                SequenceInfo.from_proto)


def server_info() -> Call:
    return Call(INDEXER, "ServerInfo", pb.ServerInfoRequest(), ServerInfo.from_proto)


def _stats(response) -> dict:
    out = {}
    for family in response.families:
        rows = out.setdefault(family.name, [])
        for m in family.metrics:
            value = (m.count, m.sum) if family.type == "histogram" else m.value
            rows.append((dict(m.labels), value))
    return out


def get_stats() -> Call:
    return Call(INDEXER, "GetStats", pb.GetStatsRequest(), _stats)


def snapshot(name: str) -> Call:
    return Call(ADMIN, "Snapshot", pb.SnapshotRequest(name=name), SnapshotResult.from_proto)


def health(service: str) -> Call:
    health_pb2, _ = health_modules()
    return Call(HEALTH, "Check", health_pb2.HealthCheckRequest(service=service),
                lambda r: health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


def stub(channel, service: str):
    """The generated stub of `service` on `channel` (a blocking or a grpc.aio channel)."""
    if service == INDEXER:
        return pb_grpc.IndexerStub(channel)
    if service == ADMIN:
        return pb_grpc.IndexerAdminStub(channel)
    return health_modules()[1].HealthStub(channel)
