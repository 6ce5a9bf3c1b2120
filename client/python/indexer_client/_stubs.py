"""The generated protobuf and gRPC modules, which the package build writes into
indexer_client/_proto (build_stubs.py); they are never committed.

Health checks use grpcio-health-checking's modules when that package is installed (so that a
process holding both registers the health messages once), else the package's own.
"""
__all__ = ["pb", "pb_grpc", "health_modules"]

_HINT = (
    "indexer_client's generated stubs are missing ({missing}). They are made when the package "
    "is built: install it with `pip install ./client/python` (offline, with Debian's packages: "
    "add --no-deps --no-build-isolation), which needs protoc and grpc_python_plugin (Debian: "
    "protobuf-compiler, protobuf-compiler-grpc). A source checkout without installing is not "
    "importable; the CMake build installs the package into <build>/python for the tests."
)

try:
    from indexer_client._proto import indexer_pb2 as pb
    from indexer_client._proto import indexer_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - depends on how the package was built
    raise ImportError(_HINT.format(missing=e)) from e


def health_modules():
    """Returns (health_pb2, health_pb2_grpc) of grpc.health.v1; ImportError when neither
    grpcio-health-checking's nor the package's own (built from grpc/health/v1/health.proto)
    exist."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        return health_pb2, health_pb2_grpc
    except ImportError:
        pass
    try:
        from indexer_client._proto import health_pb2, health_pb2_grpc
        return health_pb2, health_pb2_grpc
    except ImportError:
        raise ImportError("no health stubs: the package was built without "
                          "grpc/health/v1/health.proto (Debian: grpc-proto) and "
                          "grpcio-health-checking is not installed") from None
