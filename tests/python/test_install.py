#!/usr/bin/python3
"""Installs client/python with pip into a fresh venv and uses the installed package.

As a user would, offline and with Debian's packages: a venv made with --system-site-packages
(python3-grpcio, python3-numpy, python3-protobuf, and pip itself, come from the system), then
  pip install --no-deps --no-build-isolation ./client/python
of a clean copy of the checkout (client/python and proto/). Then, in the venv's python with no
PYTHONPATH, outside the checkout: the package imports from the venv, has its version, py.typed
and generated stubs inside it, and both clients work against a real indexer-server over TCP and
a Unix socket. Environment (ctest -R python_install sets it): INDEXER_SOURCE_DIR,
INDEXER_SERVER_BIN, INDEXER_VERSION (the CMake project version); PROTOC, GRPC_PYTHON_PLUGIN.
"""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from install_package import copy_sources, pip_install  # noqa: E402
from server_process import Server  # noqa: E402

# Run by the venv's python: argv = expected version, then the targets to use.
CHECK = textwrap.dedent('''
    import asyncio, importlib.metadata, os, sys
    import grpc, numpy as np
    import indexer_client
    from indexer_client import AsyncIndexerClient, IndexerClient, Step, reference_select

    version, targets = sys.argv[1], sys.argv[2:]
    package = os.path.dirname(indexer_client.__file__)
    assert package.startswith(sys.prefix), (package, sys.prefix)
    assert indexer_client.__version__ == version, (indexer_client.__version__, version)
    assert importlib.metadata.version("indexer-client") == version
    for name in ("py.typed", "_proto/indexer_pb2.py", "_proto/indexer_pb2_grpc.py",
                 "_proto/indexer_pb2.pyi", "_proto/health_pb2.py", "_proto/health_pb2_grpc.py"):
        assert os.path.isfile(os.path.join(package, name)), name
    paths = len(grpc.__path__)
    keys = np.arange(300 * 64, dtype=np.float32).reshape(300, 64) % 5 - 2
    q = np.ones((1, 2, 64), np.float32)
    want = reference_select(keys, q, 299, 2, 0, 1).block_ids
    for i, target in enumerate(targets):
        with IndexerClient(target, timeout=10) as c:
            c.wait_until_serving()
            assert c.append_keys(f"pip-{i}", keys).lengths.tolist() == [300]
            assert (c.select_blocks(f"pip-{i}", q, topk=2, timeout=5).block_ids == want).all()
            try:
                c.select_blocks(f"pip-{i}", np.ones((2, 4, 32), np.float32))
                raise AssertionError("a head_dim-32 query was sent to a head_dim-64 server")
            except ValueError as e:
                assert "head_dim 64" in str(e), e

        async def use():
            async with AsyncIndexerClient(target, timeout=10) as c:
                await c.wait_until_serving()
                async with c.open_stream() as stream:
                    sel = (await stream.step([Step(f"pip-{i}", queries=q, topk=2)]))[0]
                assert (sel.block_ids == want).all()
                assert (await c.release(f"pip-{i}")).pages_freed == 3
        asyncio.run(use())
    assert len(grpc.__path__) == paths, "grpc.__path__ was changed"
    print("installed package ok:", indexer_client.__version__, package)
''')


class PipInstallTest(unittest.TestCase):
    def test_install_into_a_venv_and_use_it(self):
        source = os.environ.get("INDEXER_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
        version = os.environ.get("INDEXER_VERSION")
        if not version:
            self.fail("INDEXER_VERSION (the CMake project version) is not set; ctest sets it")
        with tempfile.TemporaryDirectory(prefix="indexer-pip-") as tmp:
            package = copy_sources(source, os.path.join(tmp, "src"))
            venv = os.path.join(tmp, "venv")
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                            venv], check=True)
            python = os.path.join(venv, "bin", "python")
            try:
                pip_install(python, package)
            except subprocess.CalledProcessError as e:
                self.fail(f"pip install failed ({e.returncode}):\n{e.stdout}{e.stderr}")
            self.assertFalse(os.path.exists(os.path.join(package, "indexer_client", "_proto")),
                             "the stubs must be generated into the build, not the sources")

            socket_path = os.path.join(tmp, "indexer.sock")
            flags = ["--device=cpu", "--head_dim=64", "--capacity=16", "--cpu_threads=1",
                     "--not_serving_seconds=0"]
            servers = [Server(flags=flags), Server(flags=flags, listen=f"unix:{socket_path}")]
            try:
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                run = subprocess.run([python, "-c", CHECK, version] + [s.target for s in servers],
                                     cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
            finally:
                statuses = [s.stop() for s in servers]
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("installed package ok", run.stdout)
            self.assertEqual(statuses, [0, 0])


if __name__ == "__main__":
    unittest.main()
