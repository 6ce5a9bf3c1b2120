#!/usr/bin/python3
"""Checks what CI can check of the deployment files without a Docker engine or a cluster.

- docker/k8s/*.yaml, docker/compose.yaml and docker/proxy/envoy.yaml parse, and say what they
  must (GPU limits, native gRPC probes, a grace period covering the drain, a headless Service
  matching the StatefulSet, flags that indexer-server knows, ring-hash on x-sequence-id).
- docker/Dockerfile runs only repository scripts that exist, as a non-root user, with a health
  probe; and those scripts work: scripts/install.sh installs into a prefix from which the server
  starts, answers the probe, and drains on SIGTERM.
- docker/proxy/nginx.conf passes `nginx -t`.

Environment: INDEXER_BUILD_DIR (the build tree), INDEXER_SOURCE_DIR (the repository).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

try:
    import yaml
except ImportError:
    sys.exit("test_deploy: python3-yaml is missing; run scripts/setup.sh")

SRC = os.environ.get("INDEXER_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("INDEXER_BUILD_DIR", os.path.join(SRC, "build"))
SERVER = os.path.join(BUILD, "server", "indexer-server")


def load(path):
    with open(os.path.join(SRC, path)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def server_flags():
    out = subprocess.run([SERVER, "--helpfull"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z_0-9]+) ", out, re.M))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kubernetes(unittest.TestCase):
    def setUp(self):
        docs = {}
        for name in ("configmap", "service", "statefulset", "kustomization"):
            (docs[name],) = load(f"docker/k8s/{name}.yaml")
        self.d = docs

    def test_kustomization_lists_every_manifest(self):
        for r in self.d["kustomization"]["resources"]:
            self.assertTrue(os.path.exists(os.path.join(SRC, "docker/k8s", r)), r)

    def test_configmap_sets_only_known_flags(self):
        flags = server_flags()
        self.assertIn("capacity", flags)
        for key in self.d["configmap"]["data"]:
            self.assertTrue(key.startswith("INDEXER_"), key)
            self.assertIn(key[len("INDEXER_"):].lower(), flags, key)

    def test_statefulset(self):
        ss, svc, cm = self.d["statefulset"], self.d["service"], self.d["configmap"]["data"]
        self.assertEqual(ss["kind"], "StatefulSet")
        self.assertEqual(ss["spec"]["serviceName"], svc["metadata"]["name"])
        labels = ss["spec"]["template"]["metadata"]["labels"]
        self.assertEqual(ss["spec"]["selector"]["matchLabels"], labels)
        self.assertEqual(svc["spec"]["selector"], labels)
        self.assertEqual(svc["spec"]["clusterIP"], "None")
        pod = ss["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        self.assertEqual(grpc_port, int(cm["INDEXER_LISTEN"].rsplit(":", 1)[1]))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            self.assertEqual(c[probe]["grpc"]["port"], grpc_port, probe)
        self.assertEqual(c["readinessProbe"]["grpc"]["service"], "indexer.v1.Indexer")
        self.assertEqual(c["envFrom"][0]["configMapRef"]["name"], self.d["configmap"]["metadata"]["name"])
        drain = float(cm["INDEXER_DRAIN_SECONDS"]) + float(cm["INDEXER_NOT_SERVING_SECONDS"])
        self.assertGreaterEqual(pod["terminationGracePeriodSeconds"], drain + 5)
        self.assertTrue(pod["securityContext"]["runAsNonRoot"])


class ComposeAndEnvoy(unittest.TestCase):
    def test_compose(self):
        (c,) = load("docker/compose.yaml")
        s = c["services"]["indexer"]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        self.assertEqual(dev["driver"], "nvidia")
        self.assertIn("gpu", dev["capabilities"])
        self.assertIn("health", s["healthcheck"]["test"])
        flags = server_flags()
        for key in s["environment"]:
            self.assertIn(key[len("INDEXER_"):].lower(), flags, key)
        self.assertIn("bench", c["services"])

    def test_envoy_hashes_the_sequence_header(self):
        (e,) = load("docker/proxy/envoy.yaml")
        (cluster,) = e["static_resources"]["clusters"]
        self.assertEqual(cluster["lb_policy"], "RING_HASH")
        hcm = e["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        self.assertEqual(route["hash_policy"][0]["header"]["header_name"], "x-sequence-id")


class Dockerfile(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(SRC, "docker/Dockerfile")) as f:
            self.text = f.read()

    def test_runs_repository_scripts_as_non_root_with_a_probe(self):
        scripts = set(re.findall(r"scripts/[a-z_]+\.sh", self.text))
        self.assertTrue({"scripts/setup.sh", "scripts/build.sh", "scripts/install.sh"} <= scripts)
        for s in scripts:
            self.assertTrue(os.access(os.path.join(SRC, s), os.X_OK), s)
        self.assertRegex(self.text, r"\nUSER indexer\n")
        self.assertRegex(self.text, r"HEALTHCHECK [^\n]*\\\n\s*CMD \[\"indexer-cli\".*\"health\"\]")
        self.assertRegex(self.text, r"EXPOSE 50051")
        for name in (".dockerignore",):
            self.assertTrue(os.path.exists(os.path.join(SRC, name)))

    def test_installed_programs_serve_and_drain(self):
        prefix = tempfile.mkdtemp(prefix="indexer-install-")
        try:
            env = dict(os.environ, BUILD_DIR=BUILD)
            subprocess.run([os.path.join(SRC, "scripts/install.sh"), prefix], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            run_env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(prefix, "lib"),
                           INDEXER_LISTEN=f"127.0.0.1:{free_port()}", INDEXER_DEVICE="cpu",
                           INDEXER_CAPACITY="256", INDEXER_NOT_SERVING_SECONDS="0")
            server = subprocess.Popen([os.path.join(prefix, "bin/indexer-server")], env=run_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            probe = [os.path.join(prefix, "bin/indexer-cli"), "--server=" + run_env["INDEXER_LISTEN"],
                     "--timeout=2s", "health"]
            try:
                for _ in range(100):
                    if subprocess.run(probe, env=run_env, capture_output=True).returncode == 0:
                        break
                    self.assertIsNone(server.poll(), "the installed server exited")
                    time.sleep(0.1)
                else:
                    self.fail("the installed server never answered the health probe")
            finally:
                server.send_signal(signal.SIGTERM)
                out, _ = server.communicate(timeout=30)
            self.assertEqual(server.returncode, 0, out)
            self.assertIn("serving on port", out)
        finally:
            shutil.rmtree(prefix)


class Nginx(unittest.TestCase):
    def test_config_is_valid(self):
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(nginx):
            self.fail("nginx is missing; run scripts/setup.sh")
        conf = os.path.join(os.path.abspath(SRC), "docker/proxy/nginx.conf")
        r = subprocess.run([nginx, "-t", "-c", conf, "-p", tempfile.gettempdir()],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
