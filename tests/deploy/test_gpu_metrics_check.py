"""scripts/check_gpu_metrics.py, the GPU machine's check of a CUDA server's /metrics, against
expositions written here: a well-formed one passes, and each thing it must catch is caught."""
import importlib.util
import os
import unittest

SOURCE = os.environ.get("INDEXER_SOURCE_DIR",
                        os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "check_gpu_metrics", os.path.join(SOURCE, "scripts", "check_gpu_metrics.py"))
checker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checker)


def exposition(skip=(), values=None):
    """A CUDA server's exposition for devices 0 and 1, without the families in `skip`."""
    values = values or {}
    default = {"indexer_gpu_memory_total_bytes": 150e9, "indexer_gpu_memory_used_bytes": 20e9,
               "indexer_gpu_utilization_ratio": 0.4, "indexer_gpu_memory_utilization_ratio": 0.3,
               "indexer_backend_lanes": 4, "indexer_backend_steps_total": 512,
               "indexer_backend_graph_launches_total": 500, "indexer_backend_graph_builds_total": 3}
    lines = []
    for name, v in default.items():
        if name in skip:
            continue
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} something", f"# TYPE {name} {kind}"]
        for device in ("0", "1"):
            lines.append(f'{name}{{device="{device}"}} {values.get(name, v)}')
    return "\n".join(lines) + "\n"


def problems(text):
    samples, found = checker.parse(text)
    return found + checker.check(samples)


class CheckGpuMetrics(unittest.TestCase):
    def test_a_cuda_servers_exposition_passes(self):
        self.assertEqual(problems(exposition()), [])

    def test_missing_nvml_gauges_are_caught(self):
        found = problems(exposition(skip=("indexer_gpu_memory_total_bytes",)))
        self.assertTrue(any("indexer_gpu_memory_total_bytes is missing" in p for p in found), found)

    def test_a_cpu_backend_is_caught(self):
        found = problems(exposition(skip=checker.BACKEND_SERIES))
        self.assertTrue(any("indexer_backend_lanes is missing" in p for p in found), found)

    def test_values_out_of_range_are_caught(self):
        found = problems(exposition(values={"indexer_gpu_utilization_ratio": 1.5}))
        self.assertTrue(any("outside [0, 1]" in p for p in found), found)
        found = problems(exposition(values={"indexer_gpu_memory_used_bytes": 200e9}))
        self.assertTrue(any("memory used" in p for p in found), found)
        found = problems(exposition(values={"indexer_backend_steps_total": 0}))
        self.assertTrue(any("is 0 after a workload" in p for p in found), found)

    def test_malformed_expositions_are_caught(self):
        text = exposition()
        found = problems(text + 'indexer_backend_lanes{device="0"} 4\n')
        self.assertTrue(any("sample twice" in p for p in found), found)
        found = problems(text + "indexer_undescribed 1\n")
        self.assertTrue(any("no TYPE line" in p for p in found), found)
        found = problems(text.replace('indexer_gpu_utilization_ratio{device="0"}',
                                      "indexer_gpu_utilization_ratio"))
        self.assertTrue(any("without a device label" in p for p in found), found)


if __name__ == "__main__":
    unittest.main()
