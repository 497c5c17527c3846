"""The same-host shared-memory segment: its layout, its name rule, and the host identity.

A client creates the segment in /dev/shm and the server maps it (AttachShm, see
proto/cache.proto); both read and write these offsets::

    offset 0       16      32        48           4096                         size
           | magic | nonce | session |  reserved  | windows: Get payloads ...   |
             client  client  server

Blocks in the window area start on ``ALIGN``-byte boundaries so that tensors viewing
them are aligned.
"""

from __future__ import annotations

import re
import socket

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAGIC",
    "NAME_MAX_CHARS",
    "NAME_PREFIX",
    "NAME_RE",
    "NONCE_AT",
    "NONCE_BYTES",
    "SESSION_AT",
    "SESSION_BYTES",
    "align",
    "host_id",
]

MAGIC = b"nopecache-shm-v1"
NONCE_AT = 16
NONCE_BYTES = 16
SESSION_AT = 32
SESSION_BYTES = 16
HEADER_BYTES = 4096
ALIGN = 64
NAME_PREFIX = "nopecache-"
NAME_MAX_CHARS = 200
NAME_RE = re.compile(rf"^nopecache-[A-Za-z0-9_.-]{{1,{NAME_MAX_CHARS}}}$")
"""What AttachShmRequest.name must match: the prefix, then 1-200 of [A-Za-z0-9_.-]."""


def align(offset: int) -> int:
    """``offset`` rounded up to the next ALIGN boundary."""
    return -(-offset // ALIGN) * ALIGN


def host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes that can share /dev/shm
    (what a server reports as ServerInfo.host_id and a client compares with its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
