#!/usr/bin/python3
"""Tests the Python client's TLS, mutual TLS and token options against a real indexer-server.

Certificates are made at test time by tests/security/make_test_certs.sh (the openssl tool).
Needs INDEXER_SERVER_BIN and the installed package on PYTHONPATH, like test_client.py
(ctest -R python_security sets both).
"""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from client_checks import ClientChecks  # noqa: E402
from server_process import Server  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from indexer_client import IndexerClient, IndexerError, Step  # noqa: E402

MAKE_CERTS = os.path.join(os.path.dirname(HERE), "security", "make_test_certs.sh")
HEAD_DIM = 64
BETA_TOKEN = "beta-python-token-0123456789"
OPS_TOKEN = "ops-python-token-0123456789ab"
tmp = None      # tempfile.TemporaryDirectory, set by setUpModule
servers = {}    # name -> Server


def path(name):
    return os.path.join(tmp.name, name)


def pem(name):
    with open(path(os.path.join("pki", name)), "rb") as f:
        return f.read()


def start(name, *flags):
    binary = os.environ.get("INDEXER_SERVER_BIN")
    if not binary or not os.access(binary, os.X_OK):
        raise RuntimeError(f"INDEXER_SERVER_BIN is {binary!r}; set it to the built indexer-server")
    servers[name] = Server(binary, ["--device=cpu", f"--head_dim={HEAD_DIM}",
                                    "--capacity=64", "--cpu_threads=1", "--not_serving_seconds=0",
                                    f"--tls_cert={path('pki/server.pem')}",
                                    f"--tls_key={path('pki/server.key')}"] + list(flags))
    return f"127.0.0.1:{servers[name].port}"


def setUpModule():
    global tmp
    tmp = tempfile.TemporaryDirectory(prefix="indexer-pysec-")
    subprocess.run(["sh", MAKE_CERTS, path("pki")], check=True)
    with open(path("tokens"), "w") as f:
        f.write(f"# tenants of the Python security test\n{BETA_TOKEN} beta\n{OPS_TOKEN} ops admin\n")
    os.chmod(path("tokens"), 0o600)
    start("tls", f"--token_file={path('tokens')}", f"--snapshot_dir={tmp.name}")
    start("mutual", f"--tls_client_ca={path('pki/ca.pem')}")


def tearDownModule():
    for server in servers.values():
        server.stop()
    tmp.cleanup()


class TlsTokenTest(ClientChecks, unittest.TestCase):
    def setUp(self):
        self.target = f"127.0.0.1:{servers['tls'].port}"

    def client(self, **kwargs):
        c = IndexerClient(self.target, timeout=5, **kwargs)
        self.addCleanup(c.close)
        return c

    def test_plain_client_is_refused(self):
        self.assertCode(grpc.StatusCode.UNAVAILABLE, self.client().server_info)

    def test_client_trusting_another_ca_is_refused(self):
        c = self.client(root_certificates=pem("rogue.pem"), token=BETA_TOKEN)
        self.assertCode(grpc.StatusCode.UNAVAILABLE, c.server_info)

    def test_tls_without_a_token_is_unauthenticated_but_health_is_open(self):
        c = self.client(root_certificates=pem("ca.pem"))
        error = self.assertCode(grpc.StatusCode.UNAUTHENTICATED, c.server_info)
        self.assertIn("Bearer", error.message)
        self.assertCode(grpc.StatusCode.UNAUTHENTICATED, c.append_keys, "s", np.ones((3, HEAD_DIM)))
        self.assertEqual(c.health(), "SERVING")
        c.wait_until_serving(5)
        bad = self.client(root_certificates=pem("ca.pem"), token="not-a-token-of-this-server")
        self.assertCode(grpc.StatusCode.UNAUTHENTICATED, bad.server_info)

    def test_reflection_is_open(self):
        # grpc.reflection.v1alpha ServerReflectionInfo with list_services (field 7, empty), sent
        # as raw bytes without a token.
        channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(pem("ca.pem")))
        self.addCleanup(channel.close)
        call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        answer = next(call(iter([b"\x3a\x00"]), timeout=5))
        self.assertIn(b"indexer.v1.Indexer", answer)

    def test_token_over_tls_reaches_the_tenant(self):
        c = self.client(root_certificates=pem("ca.pem"), token=BETA_TOKEN, server_name="localhost")
        info = c.server_info()
        self.assertEqual(info.tenant, "beta")
        keys = np.arange(200 * HEAD_DIM, dtype=np.float32).reshape(200, HEAD_DIM) % 7 - 3
        self.assertTrue(c.append_keys("py", keys).created)
        sel = c.select_blocks("py", np.ones((1, 2, HEAD_DIM)), topk=2)
        self.assertEqual(sel.block_ids.shape, (1, 2, 2))
        results = c.batch([Step("py", queries=np.ones((2, HEAD_DIM)))])
        self.assertEqual(len(results), 1)
        with c.open_stream() as stream:
            self.assertEqual(len(stream.step([Step("py", queries=np.ones((2, HEAD_DIM)))])), 1)
        self.assertEqual(c.server_info().tenant_pages, 2)
        # The admin call needs an admin token.
        self.assertCode(grpc.StatusCode.PERMISSION_DENIED, c.snapshot, "py.snap")
        ops = self.client(root_certificates=pem("ca.pem"), token=OPS_TOKEN)
        snap = ops.snapshot("py.snap")
        self.assertEqual(snap.path, path("py.snap"))
        self.assertTrue(os.path.exists(snap.path))
        self.assertGreaterEqual(snap.sequences, 1)
        # Tenants do not see each other's sequences.
        self.assertCode(grpc.StatusCode.NOT_FOUND, ops.get_sequence, "py")
        c.release("py")


class MutualTlsTest(unittest.TestCase):
    def test_client_certificate_is_required(self):
        target = f"127.0.0.1:{servers['mutual'].port}"
        without = IndexerClient(target, timeout=5, root_certificates=pem("ca.pem"))
        self.addCleanup(without.close)
        with self.assertRaises(IndexerError) as caught:
            without.server_info()
        self.assertEqual(caught.exception.code, grpc.StatusCode.UNAVAILABLE)
        with_cert = IndexerClient(target, timeout=5, root_certificates=pem("ca.pem"),
                                  certificate_chain=pem("client.pem"), private_key=pem("client.key"))
        self.addCleanup(with_cert.close)
        self.assertEqual(with_cert.server_info().head_dim, HEAD_DIM)
        self.assertEqual(with_cert.server_info().tenant, "")
        with self.assertRaises(ValueError):
            IndexerClient(target, certificate_chain=pem("client.pem"))


if __name__ == "__main__":
    unittest.main()
