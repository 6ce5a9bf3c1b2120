"""Assertions the Python client tests share: sequences released after each test, and calls that
must fail with a given gRPC code. A mixin for unittest.TestCase classes that set `self.client`."""
import grpc

from indexer_client import IndexerError


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
