#!/usr/bin/python3
"""Checks what CI can check of the deployment files without a Docker engine or a cluster.

- Every YAML file under docker/ parses and passes yamllint (docker/yamllint.yaml).
- docker/k8s (kustomization, StatefulSet, Service, PodDisruptionBudget, flags from a
  configMapGenerator) and docker/k8s/colocated (the server as a native sidecar of an LLM
  engine's pod, over a Unix socket in a shared volume): every document has its required fields,
  the pods pass the restricted Pod Security Standard, images carry a tag other than latest with
  a matching pull policy, probes use the plaintext health listener, the pods spread over nodes,
  snapshots have a volume, and every variable names a flag indexer-server knows. With kubectl
  on PATH, `kubectl kustomize` renders both (skipped with a message otherwise).
- docker/compose.yaml and docker/compose.colocated.yaml, docker/proxy/envoy.yaml (ring hash on
  x-sequence-id, gRPC health checks on the health port, outlier detection, circuit breakers).
- docker/Dockerfile: repository scripts only, package layer before the sources, base images
  from build arguments, LD_LIBRARY_PATH appended to, non-root, HEALTHCHECK on the health port;
  and those scripts work: scripts/install.sh installs into a prefix from which the server
  starts, answers the image's probe, serves metrics that docs/DEPLOY.md lists, and drains on
  SIGTERM, over TCP and over a Unix socket.
- docker/proxy/nginx.conf passes `nginx -t`.
- README.md names every indexer-cli command.

Environment: INDEXER_BUILD_DIR (the build tree), INDEXER_SOURCE_DIR (the repository).
"""
import glob
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
import urllib.request

try:
    import yaml
except ImportError:
    sys.exit("test_deploy: python3-yaml is missing; run scripts/setup.sh")

SRC = os.environ.get("INDEXER_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("INDEXER_BUILD_DIR", os.path.join(SRC, "build"))
SERVER = os.path.join(BUILD, "server", "indexer-server")
CLI = os.path.join(BUILD, "client", "cpp", "indexer-cli")
HEALTH_SERVICE = "indexer.v1.Indexer"
# The restricted Pod Security Standard's volume types.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def path(*parts):
    return os.path.join(SRC, *parts)


def load(relative):
    with open(path(relative)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def server_flags():
    out = subprocess.run([SERVER, "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z_0-9]+) ", out, re.M))


def env_file(relative):
    """KEY=VALUE lines of a configMapGenerator env file, as kustomize reads them."""
    values = {}
    with open(path(relative)) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, value = line.split("=", 1)
                values[key] = value
    return values


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_containers(pod):
    return pod.get("initContainers", []) + pod["containers"]


class Kustomization:
    """A kustomization folder read as kustomize would: its resources and generated ConfigMaps."""

    def __init__(self, folder):
        self.folder = folder
        (self.k,) = load(os.path.join(folder, "kustomization.yaml"))
        self.docs = []
        for r in self.k["resources"]:
            self.docs += load(os.path.join(folder, r))
        self.generated = {}
        for g in self.k.get("configMapGenerator", []):
            data = {}
            for e in g["envs"]:
                data.update(env_file(os.path.join(folder, e)))
            self.generated[g["name"]] = data

    def one(self, kind):
        (doc,) = [d for d in self.docs if d["kind"] == kind]
        return doc


class Yaml(unittest.TestCase):
    def test_every_file_parses(self):
        files = glob.glob(path("docker", "**", "*.yaml"), recursive=True)
        self.assertGreaterEqual(len(files), 10)
        for f in files:
            with open(f) as stream:
                docs = [d for d in yaml.safe_load_all(stream) if d is not None]
            self.assertTrue(docs, f)

    def test_yamllint(self):
        yamllint = shutil.which("yamllint")
        if yamllint is None:
            self.fail("yamllint is missing; run scripts/setup.sh")
        r = subprocess.run([yamllint, "-f", "parsable", "-c", path("docker", "yamllint.yaml"),
                            path("docker")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


class PodChecks:
    """Assertions shared by the StatefulSet and the co-located Deployment."""

    def check_required_fields(self, docs):
        for d in docs:
            for field in ("apiVersion", "kind", "metadata"):
                self.assertIn(field, d, d)
            self.assertTrue(d["metadata"].get("name"), d)
            if d["kind"] in ("StatefulSet", "Deployment"):
                spec = d["spec"]
                self.assertEqual(spec["selector"]["matchLabels"],
                                 {k: v for k, v in spec["template"]["metadata"]["labels"].items()
                                  if k in spec["selector"]["matchLabels"]})
                for c in all_containers(spec["template"]["spec"]):
                    for field in ("name", "image"):
                        self.assertIn(field, c)

    def check_restricted(self, pod):
        """The restricted Pod Security Standard (Kubernetes' pod-security admission)."""
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            self.assertFalse(pod.get(field, False), field)
        sc = pod["securityContext"]
        self.assertTrue(sc["runAsNonRoot"])
        self.assertNotEqual(sc.get("runAsUser", 1), 0)
        self.assertEqual(sc["seccompProfile"]["type"], "RuntimeDefault")
        for v in pod.get("volumes", []):
            kinds = set(v) - {"name"}
            self.assertTrue(kinds <= RESTRICTED_VOLUMES, v)
        for c in all_containers(pod):
            csc = c["securityContext"]
            self.assertIs(csc["allowPrivilegeEscalation"], False, c["name"])
            self.assertIs(csc["readOnlyRootFilesystem"], True, c["name"])
            self.assertFalse(csc.get("privileged", False), c["name"])
            self.assertEqual(csc["capabilities"]["drop"], ["ALL"], c["name"])
            self.assertNotIn("add", csc["capabilities"], c["name"])
            self.assertTrue(csc.get("runAsNonRoot", sc["runAsNonRoot"]), c["name"])
            for p in c.get("ports", []):
                self.assertNotIn("hostPort", p, c["name"])

    def check_image(self, container, kustomization):
        image = container["image"]
        name, _, tag = image.rpartition(":")
        self.assertTrue(name and tag, f"{image}: give a tag")
        self.assertNotEqual(tag, "latest", image)
        self.assertEqual(container["imagePullPolicy"], "IfNotPresent", image)
        for i in kustomization.k.get("images", []):
            if i["name"] == name:
                self.assertNotEqual(i.get("newTag", tag), "latest")

    def check_probes(self, container, flags):
        health = port_of(flags["INDEXER_HEALTH_LISTEN"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        self.assertEqual(ports["health"], health)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            self.assertEqual(container[probe]["grpc"]["port"], health, probe)
        self.assertEqual(container["readinessProbe"]["grpc"]["service"], HEALTH_SERVICE)

    def check_known_flags(self, flags):
        known = server_flags()
        self.assertIn("capacity", known)
        self.assertIn("health_listen", known)
        for key in flags:
            self.assertTrue(key.startswith("INDEXER_"), key)
            self.assertIn(key[len("INDEXER_"):].lower(), known, key)


class Kubernetes(unittest.TestCase, PodChecks):
    def setUp(self):
        self.kz = Kustomization("docker/k8s")
        self.ss = self.kz.one("StatefulSet")
        self.pod = self.ss["spec"]["template"]["spec"]
        (self.c,) = self.pod["containers"]
        (self.flags_name,) = self.kz.generated
        self.flags = self.kz.generated[self.flags_name]

    def test_every_document_has_its_required_fields(self):
        for r in self.kz.k["resources"]:
            self.assertTrue(os.path.exists(path("docker/k8s", r)), r)
        self.check_required_fields(self.kz.docs)
        kinds = sorted(d["kind"] for d in self.kz.docs)
        self.assertEqual(kinds, ["PodDisruptionBudget", "Service", "StatefulSet"])

    def test_flags_come_from_a_config_map_generator(self):
        # A generated ConfigMap's name carries a hash of its contents: a flag change rolls the pods.
        self.assertFalse([d for d in self.kz.docs if d["kind"] == "ConfigMap"])
        self.assertEqual(self.c["envFrom"][0]["configMapRef"]["name"], self.flags_name)
        self.check_known_flags(self.flags)

    def test_statefulset_service_and_probes(self):
        svc = self.kz.one("Service")
        self.assertEqual(self.ss["spec"]["serviceName"], svc["metadata"]["name"])
        labels = self.ss["spec"]["template"]["metadata"]["labels"]
        self.assertEqual(self.ss["spec"]["selector"]["matchLabels"], labels)
        self.assertEqual(svc["spec"]["selector"], labels)
        self.assertEqual(svc["spec"]["clusterIP"], "None")
        self.assertEqual(self.c["resources"]["limits"]["nvidia.com/gpu"], 1)
        ports = {p["name"]: p["containerPort"] for p in self.c["ports"]}
        self.assertEqual(ports["grpc"], port_of(self.flags["INDEXER_LISTEN"]))
        self.assertEqual(ports["metrics"], port_of(self.flags["INDEXER_METRICS_LISTEN"]))
        self.assertEqual({p["targetPort"] for p in svc["spec"]["ports"]}, set(ports))
        self.check_probes(self.c, self.flags)
        drain = float(self.flags["INDEXER_DRAIN_SECONDS"]) + float(self.flags["INDEXER_NOT_SERVING_SECONDS"])
        self.assertGreaterEqual(self.pod["terminationGracePeriodSeconds"], drain + 5)

    def test_restricted_security_context(self):
        self.check_restricted(self.pod)

    def test_image_tag_and_pull_policy(self):
        self.check_image(self.c, self.kz)

    def test_disruption_budget_and_spread(self):
        pdb = self.kz.one("PodDisruptionBudget")
        self.assertEqual(pdb["apiVersion"], "policy/v1")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], self.ss["spec"]["selector"]["matchLabels"])
        self.assertEqual(pdb["spec"]["maxUnavailable"], 1)
        (spread,) = self.pod["topologySpreadConstraints"]
        self.assertEqual(spread["topologyKey"], "kubernetes.io/hostname")
        self.assertEqual(spread["labelSelector"]["matchLabels"], self.ss["spec"]["selector"]["matchLabels"])

    def test_snapshot_dir_has_a_volume(self):
        folder = self.flags["INDEXER_SNAPSHOT_DIR"]
        (mount,) = [m for m in self.c["volumeMounts"] if m["mountPath"] == folder]
        claims = [t["metadata"]["name"] for t in self.ss["spec"]["volumeClaimTemplates"]]
        self.assertIn(mount["name"], claims)
        # The root filesystem is read-only: /tmp is a volume too.
        self.assertIn("/tmp", [m["mountPath"] for m in self.c["volumeMounts"]])


class Colocated(unittest.TestCase, PodChecks):
    def setUp(self):
        self.kz = Kustomization("docker/k8s/colocated")
        self.d = self.kz.one("Deployment")
        self.pod = self.d["spec"]["template"]["spec"]
        (self.sidecar,) = self.pod["initContainers"]
        (self.engine,) = self.pod["containers"]
        (self.flags_name,) = self.kz.generated
        self.flags = self.kz.generated[self.flags_name]

    def test_required_fields_flags_and_security(self):
        self.check_required_fields(self.kz.docs)
        self.check_known_flags(self.flags)
        self.check_restricted(self.pod)
        self.check_image(self.sidecar, self.kz)
        self.check_image(self.engine, self.kz)
        self.assertEqual(self.sidecar["envFrom"][0]["configMapRef"]["name"], self.flags_name)

    def test_the_indexer_is_a_native_sidecar_on_a_shared_socket(self):
        self.assertEqual(self.sidecar["restartPolicy"], "Always")
        listen = self.flags["INDEXER_LISTEN"]
        self.assertTrue(listen.startswith("unix:/"), listen)
        folder = os.path.dirname(listen[len("unix:"):])
        mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                  for c in (self.sidecar, self.engine)}
        volume = mounts["indexer"][folder]
        self.assertEqual(mounts["engine"][folder], volume, "both containers mount the socket folder")
        (v,) = [v for v in self.pod["volumes"] if v["name"] == volume]
        self.assertIn("emptyDir", v)
        # The socket is group read-write: the pod's fsGroup gives every container that group.
        self.assertIn("fsGroup", self.pod["securityContext"])
        env = {e["name"]: e["value"] for e in self.engine["env"]}
        self.assertEqual(env["INDEXER_SERVER"], listen)
        self.check_probes(self.sidecar, self.flags)


class KubectlKustomize(unittest.TestCase):
    def test_kustomize_renders_both(self):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed: the manifests are checked as files above")
        for folder in ("docker/k8s", "docker/k8s/colocated"):
            r = subprocess.run([kubectl, "kustomize", path(folder)], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            docs = [d for d in yaml.safe_load_all(r.stdout) if d]
            (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
            self.assertRegex(cm["metadata"]["name"], r"-[a-z0-9]{10}$", "a hash-suffixed name")
            rendered = r.stdout
            self.assertIn(f"name: {cm['metadata']['name']}", rendered.split("kind: ConfigMap", 1)[1])
            self.assertIn("image: indexer:0.1.0", rendered)


class Compose(unittest.TestCase):
    def test_compose(self):
        (c,) = load("docker/compose.yaml")
        s = c["services"]["indexer"]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        self.assertEqual(dev["driver"], "nvidia")
        self.assertIn("gpu", dev["capabilities"])
        flags = server_flags()
        for key in s["environment"]:
            self.assertIn(key[len("INDEXER_"):].lower(), flags, key)
        health = port_of(s["environment"]["INDEXER_HEALTH_LISTEN"])
        self.assertIn("health", s["healthcheck"]["test"])
        self.assertIn(f"--server=127.0.0.1:{health}", s["healthcheck"]["test"])
        self.assertIn("bench", c["services"])
        for service in c["services"].values():
            self.assertFalse(service["image"].endswith(":latest"), service["image"])

    def test_colocated_compose_shares_the_socket(self):
        (c,) = load("docker/compose.colocated.yaml")
        indexer, engine = c["services"]["indexer"], c["services"]["engine"]
        listen = indexer["environment"]["INDEXER_LISTEN"]
        self.assertTrue(listen.startswith("unix:/"), listen)
        folder = os.path.dirname(listen[len("unix:"):])
        volumes = lambda s: {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        self.assertEqual(volumes(indexer)[folder], volumes(engine)[folder])
        self.assertIn(volumes(indexer)[folder], c["volumes"])
        self.assertEqual(engine["environment"]["INDEXER_SERVER"], listen)
        self.assertIn(f"--server={listen}", indexer["healthcheck"]["test"])
        self.assertEqual(engine["depends_on"]["indexer"]["condition"], "service_healthy")
        flags = server_flags()
        for key in indexer["environment"]:
            self.assertIn(key[len("INDEXER_"):].lower(), flags, key)


class Envoy(unittest.TestCase):
    def setUp(self):
        (e,) = load("docker/proxy/envoy.yaml")
        (self.cluster,) = e["static_resources"]["clusters"]
        self.hcm = e["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]

    def test_hashes_the_sequence_header(self):
        self.assertEqual(self.cluster["lb_policy"], "RING_HASH")
        route = self.hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        self.assertEqual(route["hash_policy"][0]["header"]["header_name"], "x-sequence-id")
        self.assertNotIn("retry_policy", route, "another server does not hold the sequence")

    def test_health_checks_outlier_detection_and_circuit_breakers(self):
        (hc,) = self.cluster["health_checks"]
        self.assertEqual(hc["grpc_health_check"]["service_name"], HEALTH_SERVICE)
        for key in ("timeout", "interval", "unhealthy_threshold", "healthy_threshold"):
            self.assertIn(key, hc)
        for group in self.cluster["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                self.assertEqual(ep["endpoint"]["health_check_config"]["port_value"], 50052)
                self.assertEqual(ep["endpoint"]["address"]["socket_address"]["port_value"], 50051)
        od = self.cluster["outlier_detection"]
        self.assertGreater(od["consecutive_5xx"], 0)
        self.assertLessEqual(od["max_ejection_percent"], 50)
        (t,) = self.cluster["circuit_breakers"]["thresholds"]
        for key in ("max_connections", "max_pending_requests", "max_requests"):
            self.assertGreater(t[key], 0, key)
        self.assertEqual(t["max_retries"], 0)


class Dockerfile(unittest.TestCase):
    def setUp(self):
        with open(path("docker/Dockerfile")) as f:
            self.text = f.read()

    def test_runs_repository_scripts_as_non_root_with_a_probe(self):
        scripts = set(re.findall(r"scripts/[a-z_]+\.sh", self.text))
        self.assertTrue({"scripts/setup.sh", "scripts/build.sh", "scripts/install.sh"} <= scripts)
        for s in scripts:
            self.assertTrue(os.access(path(s), os.X_OK), s)
        self.assertRegex(self.text, r"\nUSER indexer\n")
        self.assertRegex(self.text, r"EXPOSE 50051 50052 9090")
        self.assertTrue(os.path.exists(path(".dockerignore")))

    def test_healthcheck_uses_the_health_listener(self):
        health = re.search(r"INDEXER_HEALTH_LISTEN=0\.0\.0\.0:(\d+)", self.text).group(1)
        self.assertRegex(self.text, r"HEALTHCHECK [^\n]*\\\n\s*CMD \[\"indexer-cli\", "
                                    rf"\"--server=127\.0\.0\.1:{health}\".*\"health\"\]")

    def test_the_build_stage_installs_only_what_building_needs(self):
        self.assertIn("RUN scripts/setup.sh --build-only\n", self.text)

        def listed(*args):
            r = subprocess.run(["bash", path("scripts/setup.sh"), "--list", *args],
                               capture_output=True, text=True, check=True)
            return set(r.stdout.split())
        build, everything = listed("--build-only"), listed()
        self.assertLess(build, everything)
        for tool in ("chromium", "nginx", "prometheus", "clang", "libgtest-dev", "yamllint"):
            self.assertNotIn(tool, build)
            self.assertIn(tool, everything)
        for need in ("cmake", "libgrpc++-dev", "libabsl-dev", "libspdlog-dev",
                     "prometheus-cpp-dev", "libcivetweb-dev", "protobuf-compiler-grpc"):
            self.assertIn(need, build)

    def test_layers_base_images_and_library_path(self):
        setup = self.text.index("RUN scripts/setup.sh")
        self.assertLess(self.text.index("COPY scripts/setup.sh"), setup)
        self.assertLess(setup, self.text.index("COPY . ."), "packages before the sources")
        self.assertRegex(self.text, r"\nARG BUILD_IMAGE=nvidia/cuda:")
        self.assertRegex(self.text, r"\nARG RUNTIME_IMAGE=nvidia/cuda:")
        self.assertRegex(self.text, r"\nFROM \$\{BUILD_IMAGE\} AS build\n")
        self.assertRegex(self.text, r"\nFROM \$\{RUNTIME_IMAGE\}\n")
        self.assertIn("LD_LIBRARY_PATH=/opt/indexer/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}",
                      self.text)


class Installed(unittest.TestCase):
    """scripts/install.sh into a prefix, then the installed programs as the image runs them."""

    @classmethod
    def setUpClass(cls):
        cls.prefix = tempfile.mkdtemp(prefix="indexer-install-")
        env = dict(os.environ, BUILD_DIR=BUILD)
        subprocess.run([path("scripts/install.sh"), cls.prefix], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        cls.env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(cls.prefix, "lib"),
                       INDEXER_DEVICE="cpu", INDEXER_CAPACITY="256", INDEXER_NOT_SERVING_SECONDS="0")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.prefix)

    def run_server(self, env):
        return subprocess.Popen([os.path.join(self.prefix, "bin/indexer-server")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def probe_until_serving(self, server, target):
        probe = [os.path.join(self.prefix, "bin/indexer-cli"), "--server=" + target,
                 "--timeout=2s", "health"]
        for _ in range(100):
            if subprocess.run(probe, env=self.env, capture_output=True).returncode == 0:
                return
            self.assertIsNone(server.poll(), "the installed server exited")
            time.sleep(0.1)
        self.fail(f"the installed server never answered the health probe on {target}")

    def stop(self, server):
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=30)
        self.assertEqual(server.returncode, 0, out)
        return out

    def test_serves_answers_the_image_probe_and_drains(self):
        health, metrics = free_port(), free_port()
        env = dict(self.env, INDEXER_LISTEN=f"127.0.0.1:{free_port()}",
                   INDEXER_HEALTH_LISTEN=f"127.0.0.1:{health}",
                   INDEXER_METRICS_LISTEN=f"127.0.0.1:{metrics}")
        server = self.run_server(env)
        try:
            self.probe_until_serving(server, f"127.0.0.1:{health}")
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                exposition = r.read().decode()
        finally:
            out = self.stop(server)
        self.assertIn("serving on port", out)
        self.assertIn(f"health checks (grpc.health.v1 only, plaintext) on port {health}", out)
        # Every family the server exposes is documented.
        with open(path("docs/DEPLOY.md")) as f:
            deploy = f.read()
        families = set(re.findall(r"^# TYPE (\S+) ", exposition, re.M))
        self.assertGreater(len(families), 20)
        for family in families:
            self.assertIn(f"`{family}`", deploy, f"docs/DEPLOY.md does not list {family}")

    def test_serves_on_a_unix_socket(self):
        folder = tempfile.mkdtemp(prefix="indexer-run-")
        sock = os.path.join(folder, "indexer.sock")
        server = self.run_server(dict(self.env, INDEXER_LISTEN=f"unix:{sock}"))
        try:
            self.probe_until_serving(server, f"unix:{sock}")
        finally:
            out = self.stop(server)
            shutil.rmtree(folder)
        self.assertIn(f"serving on unix:{sock}:", out)


class Nginx(unittest.TestCase):
    def test_config_is_valid(self):
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(nginx):
            self.fail("nginx is missing; run scripts/setup.sh")
        conf = os.path.join(os.path.abspath(SRC), "docker/proxy/nginx.conf")
        r = subprocess.run([nginx, "-t", "-c", conf, "-p", tempfile.gettempdir()],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)


class Readme(unittest.TestCase):
    def test_lists_every_cli_command(self):
        out = subprocess.run([CLI, "--help"], capture_output=True, text=True).stdout
        section = out.split("Commands:\n", 1)[1].split("\n\n", 1)[0]
        commands = re.findall(r"^  ([a-z]+) ", section, re.M)
        self.assertIn("stats", commands)
        self.assertIn("snapshot", commands)
        with open(path("README.md")) as f:
            readme = f.read()
        (cli_line,) = [p for p in readme.split("\n- ") if p.startswith("CLI:")]
        for c in commands:
            self.assertIn(f"`{c}`", cli_line, f"README's CLI line does not name {c}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
