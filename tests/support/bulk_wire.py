"""The bulk byte stream seen from the wire, for tests: a ticket from a server in process, a
connection past its welcome, exact reads, and the limits the hardening tests serve with.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from nopecache.proto import cache_pb2 as pb
from nopecache.proto.bulk import MAGIC, hello
from nopecache.proto.contract import method_path
from tests.support.server_harness import SMALL, Harness

MiB = 1024 * 1024
# Frames and blocks of megabytes, a per-client share of half the in-flight budget, and a
# short idle timeout: the hardening of the gRPC Get, as the bulk stream must apply it.
BOUNDED = replace(
    SMALL,
    tiers=("cpu://?capacity=64MiB&pinned=no",),
    max_message_bytes=4 * MiB,
    max_block_bytes=4 * MiB,
    max_request_bytes=4 * MiB,
    max_inflight_bytes=16 * MiB,
    max_inflight_bytes_per_client=8 * MiB,
    stream_idle_timeout_s=0.5,
)


async def open_bulk(h: Harness) -> pb.OpenBulkReply:
    """A bulk ticket from the server of ``h`` (OpenBulk over its channel)."""
    call = h.channel.unary_unary(
        method_path("OpenBulk"),
        request_serializer=pb.OpenBulkRequest.SerializeToString,
        response_deserializer=pb.OpenBulkReply.FromString,
    )
    reply: pb.OpenBulkReply = await call(pb.OpenBulkRequest())
    return reply


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``, or fewer when the peer closes first."""
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            break
        out += part
    return out


def welcomed(reply: pb.OpenBulkReply) -> socket.socket:
    """A bulk connection past its welcome, with a small receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", reply.port))
    sock.sendall(hello(reply.ticket))
    assert recv_exact(sock, 16) == MAGIC
    return sock
