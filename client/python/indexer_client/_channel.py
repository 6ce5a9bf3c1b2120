"""What the blocking and the asyncio client share about their channel: options, credentials,
per-call metadata and deadlines.

Targets are gRPC names: "host:port", "dns:///host:port", or a Unix domain socket,
"unix:relative/or/absolute/path" or "unix:///absolute/path" (a server started with
--listen=unix:/run/indexer/indexer.sock). TLS works over any of them.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import grpc


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()
"""A method's `timeout=` left out: the client's own timeout applies (None: no deadline)."""


@dataclass(frozen=True)
class ChannelSettings:
    """Everything needed to open a channel to `target` and to make calls on it."""

    target: str
    options: Tuple[Tuple[str, object], ...]
    credentials: Optional[grpc.ChannelCredentials]
    metadata: Optional[Tuple[Tuple[str, str], ...]]
    timeout: Optional[float]

    def deadline(self, timeout) -> Optional[float]:
        """The seconds a call may take: `timeout`, or the client's when it is DEFAULT."""
        return self.timeout if timeout is DEFAULT else timeout

    def call_metadata(self, request) -> Optional[Tuple[Tuple[str, str], ...]]:
        """The token, plus `x-sequence-id` for calls about one sequence, so that a proxy can
        route every call of a sequence to the server holding it (docs/DEPLOY.md). Only
        printable ASCII ids go into the header."""
        key = getattr(request, "sequence_id", "") or getattr(request, "source_id", "")
        if not key and getattr(request, "items", None):
            ids = {item.sequence_id for item in request.items}
            key = ids.pop() if len(ids) == 1 else ""
        if key and key.isascii() and key.isprintable():
            return (self.metadata or ()) + (("x-sequence-id", key),)
        return self.metadata


def channel_settings(target: str, timeout: Optional[float], max_message_bytes: int, tls: bool,
                     root_certificates: Optional[bytes], certificate_chain: Optional[bytes],
                     private_key: Optional[bytes], server_name: Optional[str],
                     token: Optional[str]) -> ChannelSettings:
    """The settings of the clients' constructors (see IndexerClient); ValueError when the
    certificate and key are not given together."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    credentials = None
    if tls or root_certificates or certificate_chain or private_key:
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together: give both or neither")
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                   certificate_chain)
    # Plain metadata rather than call credentials, which gRPC sends over TLS only: a token must
    # also work over loopback, a Unix socket, or behind a TLS-terminating proxy.
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    return ChannelSettings(target, tuple(options), credentials, metadata, timeout)
