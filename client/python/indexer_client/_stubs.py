"""Loads the generated protobuf/gRPC stubs, which live in the build tree, not in this package.

The CMake build writes them to <build>/python (target indexer_python_stubs); generate_stubs.sh
writes the same files anywhere. Either way that directory must be on sys.path, e.g.
PYTHONPATH=<build>/python:client/python.
"""
import importlib
import os
import sys

__all__ = ["pb", "pb_grpc", "health_modules"]

_HINT = (
    "The indexer's generated Python stubs were not found on sys.path ({missing}).\n"
    "Generate them, then put their directory on PYTHONPATH before client/python:\n"
    "  * with the CMake build: `ninja indexer_python_stubs` (built by default) writes <build>/python;\n"
    "    run with PYTHONPATH=<build>/python:client/python\n"
    "  * without it: client/python/generate_stubs.sh OUT_DIR (protoc + grpc_python_plugin, from\n"
    "    Debian's protobuf-compiler and protobuf-compiler-grpc); run with PYTHONPATH=OUT_DIR:client/python"
)

try:
    from indexer.v1 import indexer_pb2 as pb
    from indexer.v1 import indexer_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(_HINT.format(missing=e)) from e


def health_modules():
    """Returns (health_pb2, health_pb2_grpc), generated from grpc/health/v1/health.proto.

    The stubs sit in <stubs>/grpc/health/v1, but the installed `grpc` package is a regular
    package whose __path__ hides that folder; so the folder is added to grpc.__path__.
    """
    import grpc

    try:
        return _import_health()
    except ImportError:
        pass
    for entry in sys.path:
        folder = os.path.join(entry or ".", "grpc")
        if os.path.isfile(os.path.join(folder, "health", "v1", "health_pb2.py")):
            if folder not in grpc.__path__:
                grpc.__path__.append(folder)
            importlib.invalidate_caches()
            return _import_health()
    raise ImportError(_HINT.format(missing="grpc/health/v1/health_pb2.py, from "
                                   "/usr/share/grpc-proto/grpc/health/v1/health.proto"))


def _import_health():
    from grpc.health.v1 import health_pb2, health_pb2_grpc
    return health_pb2, health_pb2_grpc
