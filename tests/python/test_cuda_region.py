#!/usr/bin/python3
"""Tests CudaRegion, torch CUDA memory shared by its IPC handle, against a real indexer-server on
the CUDA backend: registering and listing it, and keys, queries and every output in GPU memory
answering exactly what inline tensors answer and what the numpy reference selects. Skips where
torch has no CUDA device (CI); scripts/gpu_check.sh runs it on the GPU machine. Needs
INDEXER_SERVER_BIN and the installed package on PYTHONPATH.
"""
import os
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from indexer_client import CudaRegion, IndexerClient, reference_select  # noqa: E402
from server_process import Server  # noqa: E402

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    HAVE_CUDA = False

HEAD_DIM, LAYERS = 64, 2


@unittest.skipUnless(HAVE_CUDA, "no torch with a CUDA device")
class CudaRegionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(flags=["--device=cuda", "--devices=0", f"--head_dim={HEAD_DIM}",
                                   f"--layers={LAYERS}", "--capacity=256"])

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def setUp(self):
        self.client = IndexerClient(self.server.target, timeout=20)
        self.addCleanup(self.client.close)
        self.client.wait_until_serving()
        self.addCleanup(self.client.unregister_region)
        self.rng = np.random.default_rng(99)

    def ints(self, *shape):
        return self.rng.integers(-6, 7, size=shape).astype(np.float32)

    def test_tensors_in_gpu_memory_answer_as_inline(self):
        c, info = self.client, self.client.server_info()
        region = CudaRegion.create("gpu-io", 1 << 20)
        c.register_cuda_region(region.name, region.raw_handle, region.device, region.byte_size,
                               region.offset)
        (status,) = c.list_regions()
        self.assertEqual((status.kind, status.device_id, status.byte_size),
                         ("cuda", 0, 1 << 20))
        keys = self.ints(300, HEAD_DIM)
        c.append_keys("inline", keys, attention_pages=[3, 1, 4])
        kref = region.write(torch.from_numpy(keys).cuda(), 0)
        self.assertEqual(c.append_keys("gpu", kref, attention_pages=[3, 1, 4]).lengths.tolist(),
                         [300, 0])
        q = self.ints(2, 4, HEAD_DIM)
        want = c.select_blocks("inline", q, topk=3)
        np.testing.assert_array_equal(
            want.block_ids,
            reference_select(keys, q, 298, 3, 0, 1, attn_pages=[3, 1, 4],
                             pages_per_block=info.pages_per_block,
                             block_page_stride=info.block_page_stride).block_ids)
        qref = region.write(torch.from_numpy(q).cuda(), (kref.end + 255) // 256 * 256)
        outputs = region.output_refs((qref.end + 255) // 256 * 256, 2, 4, 3, info.pages_per_block)
        got = c.select_blocks("gpu", qref, topk=3, outputs=outputs)
        self.assertIsNone(got.block_ids)
        got = got.read(region)
        for name in ("block_ids", "page_table", "context_lens"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        self.assertEqual(c.unregister_region(region.name), 1)


if __name__ == "__main__":
    unittest.main()
