"""IndexerError: a failed call or batch item, with its gRPC status code and the server's text."""
from typing import Optional

import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class IndexerError(Exception):
    """A failed call or batch item: `code` is a grpc.StatusCode, `message` the server's text.

    `index` is the item's position for a failed Batch / BatchStream item, else None.
    Shapes the client refuses before sending raise ValueError instead, and never reach a server.
    """

    def __init__(self, code: grpc.StatusCode, message: str, index: Optional[int] = None):
        where = "" if index is None else f"item {index}: "
        super().__init__(f"{where}{code.name}: {message}")
        self.code = code
        self.message = message
        self.index = index

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "IndexerError":
        """From a failed call of either grpc API (blocking or grpc.aio)."""
        return cls(error.code(), error.details() or "")

    @classmethod
    def from_item(cls, code: int, message: str, index: int) -> "IndexerError":
        """From a BatchItemResult's numeric code."""
        return cls(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, index)
