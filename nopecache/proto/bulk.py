"""The bulk byte stream's layout (see proto/cache.proto, OpenBulk), shared by both sides.

One TCP connection per ticket, requests answered in order, one at a time::

    client -> server   HELLO     magic "nopecache-bulk-1" (16) | ticket (16)
    server -> client   WELCOME   magic (16)                       (else the server closes)
    client -> server   GET       u32 key count | count x 16-byte keys
    server -> client   per key, in request order:
                       ENTRY     u8 tier code | 7 zero bytes | u64 size   (16 bytes)
                                 then ``size`` block bytes (none for a miss: code 0)
                       or ERROR  code 255 | 7 zero bytes | u64 n, then n bytes of UTF-8
                                 naming the refused field; the server closes after it
    client -> server   PUT       u32 PUT_FLAG | block count, then per block:
                       BLOCK     u64 size | 16-byte key (24 bytes), then ``size`` bytes
    server -> client   once every block is in (and checked and stored as a gRPC Put's):
                       ENTRY     code PUT_REPLY_CODE, size n, then n bytes of a PutReply
                                 (one PutResult per block, in order), or ERROR

Integers are little-endian. A tier code c > 0 names ``ServerInfo.tier_names[c - 1]``;
a size is at most ``Limits.max_block_bytes`` and zero exactly for a miss. A PUT's limits
are a gRPC Put's: at most ``max_keys_per_request`` blocks, each of 1 to
``max_block_bytes`` bytes, together at most ``max_request_bytes``.
"""

from __future__ import annotations

import struct

from nopecache.proto.contract import KEY_BYTES
from nopecache.proto.wire import WireError

__all__ = [
    "BLOCK",
    "COUNT",
    "ENTRY",
    "ERROR_CODE",
    "HASH_PIECE",
    "MAGIC",
    "PUT_FLAG",
    "PUT_REPLY_CODE",
    "TICKET_BYTES",
    "check_entry",
    "encode_get",
    "encode_put",
    "hello",
]

MAGIC = b"nopecache-bulk-1"
TICKET_BYTES = 16
ENTRY = struct.Struct("<B7xQ")
COUNT = struct.Struct("<I")
BLOCK = struct.Struct(f"<Q{KEY_BYTES}s")
PUT_FLAG = 1 << 31
PUT_REPLY_CODE = 1
ERROR_CODE = 255
# Either receiver (a GET's on the client, a PUT's on the server) takes a block's payload
# this many bytes at a time and hashes each piece right after it lands, still in the CPU
# cache, instead of in a second pass over the whole block from memory at verification
# (xxhash holds the GIL: a piece this size keeps it for tens of microseconds).
HASH_PIECE = 512 * 1024


def hello(ticket: bytes) -> bytes:
    """The first bytes a client sends on a new connection."""
    if len(ticket) != TICKET_BYTES:
        raise WireError(f"OpenBulkReply.ticket: {len(ticket)} bytes, expected {TICKET_BYTES}")
    return MAGIC + ticket


def encode_get(keys: bytes) -> bytes:
    """A GET of packed 16-byte ``keys``."""
    return COUNT.pack(len(keys) // KEY_BYTES) + keys


def encode_put(count: int) -> bytes:
    """The head of a PUT of ``count`` blocks (each then a BLOCK and its bytes)."""
    if not 0 <= count < PUT_FLAG:
        raise WireError(f"PUT block count: {count} is out of range")
    return COUNT.pack(PUT_FLAG | count)


def check_entry(code: int, size: int, tiers: int, max_block_bytes: int, index: int) -> None:
    """Raise WireError unless (code, size) is a valid ENTRY for key ``index``."""
    if code == 0:
        if size:
            raise WireError(f"bulk entry {index}: a miss with {size} bytes")
        return
    if code > tiers:
        raise WireError(f"bulk entry {index}: tier code {code}, the server has {tiers} tiers")
    if not 0 < size <= max_block_bytes:
        raise WireError(
            f"bulk entry {index}: size {size} outside (0, max_block_bytes {max_block_bytes}]"
        )
