"""The names and numbers of the wire contract that server and client must agree on.

Read from the generated descriptor where ``cache.proto`` has them (the service's full
name, its methods, the API version in the package name), so no second copy can drift;
the rest (the default port, the key size) is written here once.
"""

from __future__ import annotations

from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import KEY_BYTES

__all__ = ["API_VERSION", "DEFAULT_PORT", "KEY_BYTES", "METHODS", "SERVICE_NAME", "method_path"]

_SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"]
SERVICE_NAME: str = _SERVICE.full_name
"""``nopecache.v1.KVCache``."""
METHODS: tuple[str, ...] = tuple(m.name for m in _SERVICE.methods)
"""The service's RPC names, in cache.proto order."""
API_VERSION: int = int(pb.DESCRIPTOR.package.rsplit(".v", 1)[1])
"""The wire API version (1 for ``nopecache.v1``)."""
DEFAULT_PORT = 50551
"""The gRPC port a server listens on and a client dials when none is given."""


def method_path(method: str) -> str:
    """The gRPC path of one RPC: ``/nopecache.v1.KVCache/<method>``."""
    return f"/{SERVICE_NAME}/{method}"
