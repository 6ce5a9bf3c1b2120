"""What the Python client tests share: small-integer inputs, and a mixin of assertions for
unittest.TestCase classes that set `self.client` (sequences released after each test, calls that
must fail with a given gRPC code)."""
import grpc
import numpy as np

from indexer_client import IndexerError


def small_ints(rng, *shape, low=-8, high=8):
    """Small integers as float32: exact in bf16, and their dot products are exact in fp32."""
    return rng.integers(low, high + 1, size=shape).astype(np.float32)


class ClientChecks:
    def new_sequence(self, sid):
        """Registers `sid` to be released after the test, whatever happens."""
        def release():
            try:
                self.client.release(sid)
            except IndexerError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
        self.addCleanup(release)
        return sid

    def assertCode(self, code, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` raises IndexerError with `code`; returns the error."""
        with self.assertRaises(IndexerError) as caught:
            fn(*args, **kwargs)
        self.assertEqual(caught.exception.code, code, str(caught.exception))
        return caught.exception
