"""One server's Admin service, reached with the client's URL, TLS and token rules.

The URL is a client URL (``nopecache://host:port?token=...``, ``nopecaches://`` for TLS,
``tls_ca_file=`` and friends; see ``nopecache.client.config``). ``nopecache-admin`` acts
on one server: a URL listing several needs ``--server`` to choose. Every call carries
``authorization: Bearer <token>`` when a token is configured, and a deadline.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from nopecache.admin.errors import AdminError, ExitCode, exit_code_of
from nopecache.client.config import ClientConfig, normalize_server
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.transport import channel_credentials
from nopecache.proto import cache_pb2_grpc

__all__ = ["AdminConnection", "load_config"]

R = TypeVar("R", bound=Message)

# Why an address may answer UNIMPLEMENTED to Admin calls (cache_server/admin_exposure.py).
_NO_ADMIN_HERE = (
    "no Admin service at this address: a server without tokens serves it on loopback "
    "only, or where its --admin-listen says"
)


def load_config(url: str, server: str | None, token: str | None) -> ClientConfig:
    """The client config of ``url`` aimed at one server, with ``token`` if given."""
    try:
        config = ClientConfig.from_url(url)
        if server is not None:
            config = replace(config, servers=(normalize_server(server),))
        if token is not None:
            config = replace(config, token=token)
    except InvalidArgumentError as e:
        raise AdminError(ExitCode.USAGE, f"url: {e}") from e
    if len(config.servers) != 1 or config.discover != "off":
        raise AdminError(
            ExitCode.USAGE,
            f"url: names {len(config.servers)} server(s)"
            + (" by DNS discovery" if config.discover != "off" else "")
            + "; nopecache-admin acts on one: choose it with --server HOST:PORT",
        )
    return config


class AdminConnection:
    """A channel to one server and the Admin stub on it."""

    def __init__(self, config: ClientConfig, timeout_s: float) -> None:
        self.address = config.servers[0]
        self.timeout_s = timeout_s
        if config.use_tls:
            try:
                credentials = channel_credentials(config)
            except InvalidArgumentError as e:
                raise AdminError(ExitCode.USAGE, str(e)) from e
            self._channel = grpc.secure_channel(self.address, credentials)
        else:
            self._channel = grpc.insecure_channel(self.address)
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()
        self.stub = cache_pb2_grpc.AdminStub(self._channel)
        self.kv = cache_pb2_grpc.KVCacheStub(self._channel)

    def call(self, method: str, request: Message, service: str = "admin") -> Any:
        """Call ``method`` with ``request``; AdminError with the matching exit code on failure."""
        stub: Any = self.stub if service == "admin" else self.kv
        try:
            return getattr(stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code()
            details = err.details() or code.name
            if code == grpc.StatusCode.UNIMPLEMENTED and service == "admin":
                details += f" ({_NO_ADMIN_HERE})"
            raise AdminError(
                exit_code_of(code), f"{self.address}: {method}: {code.name}: {details}"
            ) from None

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
