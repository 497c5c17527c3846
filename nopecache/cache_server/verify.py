"""One check for every block the server accepts or serves from a tier it does not own.

A block is checked the same way whether it arrives in a Put or is read back from a lower
tier that other processes can write (Redis): ``proto.block.validate`` (magic, header
checksum, header fields, sizes, payload checksum) with the uncompressed payload bounded by
``max_block_bytes`` *before* anything is decompressed, and the header's key equal to the
key it was asked for. Stored keys carry the tenant's namespace in front of the client key
(``tenants.py``), and blocks carry the client key in their header, so the check compares
the header with the last ``KEY_BYTES`` of the stored key.

Work: checksumming is cheap, but an lz4 payload of tens of MiB takes tens of
milliseconds to decompress. Blocks of at least ``THREAD_BYTES`` are checked in a worker
thread (xxhash and lz4 release the GIL for most of it) so the event loop keeps serving
other clients' small calls meanwhile.
"""

from __future__ import annotations

import asyncio

from nopecache.proto.block import KEY_BYTES, BlockError, BytesLike, validate

__all__ = ["THREAD_BYTES", "BlockVerifier"]

THREAD_BYTES = 1024 * 1024


class BlockVerifier:
    """Checks blocks against a key and the server's ``max_block_bytes``."""

    def __init__(self, max_payload_bytes: int) -> None:
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes: must be positive, got {max_payload_bytes}")
        self.max_payload_bytes = max_payload_bytes

    def check(self, key: bytes, blob: BytesLike, key_field: str = "PutFrame.key") -> str | None:
        """Why ``blob`` is not a valid block for client ``key`` (named ``key_field`` in the
        reason), or None when it is."""
        try:
            header = validate(blob, max_payload_bytes=self.max_payload_bytes)
        except BlockError as e:
            return str(e)
        if header.key != key:
            return (
                f"key: {key_field} {key.hex()} does not match the block header's key "
                f"{header.key.hex()}"
            )
        return None

    async def check_async(
        self, key: bytes, blob: BytesLike, key_field: str = "PutFrame.key"
    ) -> str | None:
        """``check``, in a worker thread for large blocks."""
        if memoryview(blob).nbytes >= THREAD_BYTES:
            return await asyncio.to_thread(self.check, key, blob, key_field)
        return self.check(key, blob, key_field)

    async def check_stored(self, stored_key: bytes, blob: BytesLike) -> str | None:
        """``check_async`` for a block read back under ``stored_key`` (namespace + key)."""
        return await self.check_async(stored_key[-KEY_BYTES:], blob, "the key read")
