"""One check for every block the server accepts or serves from a tier it does not own.

A block is checked the same way whether it arrives in a Put or is read back from a lower
tier that other processes can write (Redis): ``proto.block.validate`` (magic, header
checksum, header fields, sizes, payload checksum) with the uncompressed payload bounded by
``max_block_bytes`` *before* anything is decompressed, and the header's key equal to the
key it was asked for. Stored keys carry the tenant's namespace in front of the client key
(``tenants.py``), and blocks carry the client key in their header, so the check compares
the header with the last ``KEY_BYTES`` of the stored key.

Work: checksumming is cheap, but an lz4 payload of tens of MiB takes tens of
milliseconds to decompress. Blocks of at least ``THREAD_BYTES`` that need a pass over
their payload are checked in a worker thread (lz4 releases the GIL; xxhash does not, but
the loop then only waits for the GIL, not for the whole check). A bulk PUT's receiver
hashes the payload as it lands and passes that digest (``payload_xxh3``): an uncompressed
block's check then reads only its header, on the loop.
"""

from __future__ import annotations

import asyncio

from nopecache.proto.block import KEY_BYTES, BlockError, BytesLike, parse, validate

__all__ = ["THREAD_BYTES", "BlockVerifier"]

THREAD_BYTES = 1024 * 1024


class BlockVerifier:
    """Checks blocks against a key and the server's ``max_block_bytes``."""

    def __init__(self, max_payload_bytes: int) -> None:
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes: must be positive, got {max_payload_bytes}")
        self.max_payload_bytes = max_payload_bytes

    def check(
        self,
        key: bytes,
        blob: BytesLike,
        key_field: str = "PutFrame.key",
        payload_xxh3: int | None = None,
    ) -> str | None:
        """Why ``blob`` is not a valid block for client ``key`` (named ``key_field`` in the
        reason), or None when it is. ``payload_xxh3``: the stored payload's digest taken
        as it was received (``proto.block.validate``)."""
        try:
            header = validate(
                blob, max_payload_bytes=self.max_payload_bytes, payload_xxh3=payload_xxh3
            )
        except BlockError as e:
            return str(e)
        if header.key != key:
            return (
                f"key: {key_field} {key.hex()} does not match the block header's key "
                f"{header.key.hex()}"
            )
        return None

    async def check_async(
        self,
        key: bytes,
        blob: BytesLike,
        key_field: str = "PutFrame.key",
        payload_xxh3: int | None = None,
    ) -> str | None:
        """``check``, in a worker thread for large blocks that need a pass over their
        payload (all but an uncompressed one whose ``payload_xxh3`` the receiver took)."""
        if memoryview(blob).nbytes >= THREAD_BYTES and not _header_only(blob, payload_xxh3):
            return await asyncio.to_thread(self.check, key, blob, key_field, payload_xxh3)
        return self.check(key, blob, key_field, payload_xxh3)

    async def check_stored(self, stored_key: bytes, blob: BytesLike) -> str | None:
        """``check_async`` for a block read back under ``stored_key`` (namespace + key)."""
        return await self.check_async(stored_key[-KEY_BYTES:], blob, "the key read")


def _header_only(blob: BytesLike, payload_xxh3: int | None) -> bool:
    """Whether checking ``blob`` reads only its header: its payload's digest is known and
    it is stored uncompressed (a blob whose header does not parse fails at once)."""
    if payload_xxh3 is None:
        return False
    try:
        return parse(blob)[0].compression == "none"
    except BlockError:
        return True
