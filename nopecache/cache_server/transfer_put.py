"""The rules of a Put, whichever transport carried it (gRPC frames or the bulk stream).

The codecs (``service.py``, ``bulk.py``) decode their wire into calls on a
:class:`PutIntake` and encode what it returns; everything a client may rely on is decided
here (see ``service.py`` for the contract as the client sees it)::

    codec                          PutIntake                         store
    -----                          ---------                         -----
    block head (key, size)  ->     open_block: key count, block and
                                   request bytes, in-flight reserve
    block bytes             ->     complete (one frame) or stage a
                                   PartialBlock (frames) -> verify
    stream ends cleanly     ->     finish: quota charge per block,   -> TieredStore.put
                                   reconcile once, results in order

A request-level problem (a limit, broken framing, a full budget) raises
:class:`~.refusal.Refusal` and nothing of the request is stored. A problem of one block
(verification, quota, no tier fits, tier unreachable) is that block's
:class:`BlockResult`; the other blocks are unaffected (keys are content hashes, so a
retry of the good ones is idempotent).

The field names in refusal messages are the transport's (``PutFrame.total_size`` vs
``PUT block #3``), so the codec passes its :class:`PutWording`; the checks and their order
are the same for both.

Concurrency: one event loop; an intake belongs to one request.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.inflight import Lease
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.refusal import Refusal, RefusalKind, bad_request, over_limit
from nopecache.cache_server.store import BlobTooLargeError, PutOutcome, TieredStore
from nopecache.cache_server.tenants import QuotaLedger, Tenant
from nopecache.cache_server.verify import BlockVerifier
from nopecache.proto.contract import KEY_BYTES

__all__ = [
    "BULK_WORDING",
    "FRAME_WORDING",
    "YIELD_EVERY_BLOCKS",
    "BlockResult",
    "PartialBlock",
    "PutIntake",
    "PutRules",
    "PutWording",
]

# A Put of thousands of tiny blocks gives other calls a turn of the event loop this often.
YIELD_EVERY_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class PutWording:
    """How a transport names a Put's fields in refusal messages (``str.format`` templates
    over ``position``, ``size``, ``total``, ``limit``, ``length``)."""

    block: str  # the block, in an in-flight budget refusal
    bad_key: str
    too_many: str
    no_size: str
    too_large: str
    over_request: str


FRAME_WORDING = PutWording(
    block="PutFrame: block #{position}",
    bad_key="PutFrame.key: block #{position} key is {length} bytes, not {limit}",
    too_many="PutFrame.key: more than max_keys_per_request {limit} blocks in one Put",
    no_size="PutFrame.total_size: block #{position} must give its size (> 0)",
    too_large="PutFrame.total_size: block #{position} is {size} bytes, over max_block_bytes {limit}",
    over_request="PutFrame.total_size: the stream's blocks add up to {total} bytes, over "
    "max_request_bytes {limit}",
)
"""The gRPC Put stream's wording (fields of PutFrame)."""

BULK_WORDING = PutWording(
    # bad_key and too_many never apply to a bulk PUT (BLOCK fixes the key length, and
    # the block count is checked from the PUT's head first); worded for completeness.
    block="PUT block #{position}",
    bad_key="PUT block #{position}: key is {length} bytes, not {limit}",
    too_many="PUT block count: more than max_keys_per_request {limit} blocks",
    no_size="PUT block #{position}: size {size} outside (0, max_block_bytes {limit}]",
    too_large="PUT block #{position}: size {size} outside (0, max_block_bytes {limit}]",
    over_request="PUT block #{position}: the blocks add up to {total} bytes, over "
    "max_request_bytes {limit}",
)
"""The bulk PUT's wording (proto/bulk.py: a BLOCK head per block)."""


def bad_framing(message: str) -> Refusal:
    """A request whose framing is broken (BAD_REQUEST, reason ``bad_framing``)."""
    return bad_request("bad_framing", message)


@dataclass(slots=True)
class BlockResult:
    """What became of one block of a Put: stored, already present, or refused.

    ``outcome`` is ``STORED`` or ``ALREADY_PRESENT`` when the block is (now) held, None
    while it waits for the end of the request or when ``refusal`` says why not.
    """

    key: bytes
    outcome: PutOutcome | None = None
    refusal: Refusal | None = None


class PartialBlock:
    """A block whose frames are still arriving, copied as they come into one buffer of
    the block's size (uninitialised: every byte is written before anything reads it).

    Why not keep the frames and join them at the end: the join holds the frames and the
    joined block at once, twice the block's reserved bytes, and what a burst of joins
    takes stays resident (issue 36, finding 4). Copied as it arrives, each frame's
    message is freed once copied, and the block exists once.
    """

    __slots__ = ("buffer", "filled", "key", "position", "total_size")

    def __init__(self, key: bytes, total_size: int, first: memoryview, position: int) -> None:
        self.key = key
        self.position = position
        self.total_size = total_size
        self.buffer = np.empty(total_size, dtype=np.uint8)
        self.filled = 0
        self.add(first)

    def add(self, data: memoryview) -> bool:
        """Copy one frame's data in; True once the block is complete."""
        end = self.filled + len(data)
        if end > self.total_size:
            raise bad_framing(
                f"PutFrame.data: block #{self.position} got {end} bytes, more than its "
                f"total_size {self.total_size}"
            )
        self.buffer[self.filled : end] = np.frombuffer(data, dtype=np.uint8)
        self.filled = end
        return end == self.total_size

    def blob(self) -> memoryview:
        """The complete block (a view of the buffer)."""
        return self.buffer.data


Lookup = Callable[[Sequence[bytes]], Awaitable[Sequence[str | None]]]


class PutRules:
    """The server-wide side of Puts: limits, verification, quotas, the store."""

    def __init__(
        self,
        store: TieredStore,
        config: ServerConfig,
        metrics: ServerMetrics,
        quotas: QuotaLedger,
        verifier: BlockVerifier,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.quotas = quotas
        self.verifier = verifier
        # Set by a drain (Admin.Drain, SIGTERM): every new Put is refused (TIER_DOWN, which
        # is UNAVAILABLE on the wire: clients mark this server down and store elsewhere).
        self.draining = False

    def intake(self, tenant: Tenant, lease: Lease, wording: PutWording) -> PutIntake:
        """A new Put of ``tenant``, its blocks reserved in ``lease``; raises Refusal
        (TIER_DOWN) while the server drains."""
        if self.draining:
            self.count_rejected(tenant, "draining")
            raise Refusal(
                RefusalKind.TIER_DOWN,
                "draining",
                "server: draining (leaving rotation), it admits no new Put; store elsewhere",
            )
        return PutIntake(self, tenant, lease, wording)

    def count_rejected(self, tenant: Tenant, reason: str, blocks: int = 1) -> None:
        """Count a refused block (method Put, and its tenant)."""
        self.metrics.rejected("Put", reason)
        self.metrics.tenant_rejected(tenant.name, reason, blocks)


class PutIntake:
    """One Put in progress (see the module docstring); ``results`` has one slot per block."""

    __slots__ = (
        "_lease",
        "_rules",
        "_wording",
        "partial",
        "request_bytes",
        "results",
        "staged",
        "tenant",
    )

    def __init__(self, rules: PutRules, tenant: Tenant, lease: Lease, wording: PutWording) -> None:
        self._rules = rules
        self._lease = lease
        self._wording = wording
        self.tenant = tenant
        self.results: list[BlockResult] = []
        # The valid blocks as (position, key, blob), none of them stored yet.
        self.staged: list[tuple[int, bytes, memoryview | bytes]] = []
        self.partial: PartialBlock | None = None
        self.request_bytes = 0

    async def open_block(self, key: bytes, size: int) -> int:
        """Admit the next block (its key and announced size) and reserve its bytes in the
        lease (waiting for room; the read credit its first frame came on counts); its
        position. Raises Refusal past a limit."""
        config = self._rules.config
        words = self._wording
        position = len(self.results)
        if len(key) != KEY_BYTES:
            raise bad_framing(
                words.bad_key.format(position=position, length=len(key), limit=KEY_BYTES)
            )
        if position >= config.max_keys_per_request:
            raise over_limit(
                "too_many_keys", words.too_many.format(limit=config.max_keys_per_request)
            )
        if size == 0:
            raise bad_framing(
                words.no_size.format(position=position, size=size, limit=config.max_block_bytes)
            )
        if size > config.max_block_bytes:
            raise over_limit(
                "block_too_large",
                words.too_large.format(position=position, size=size, limit=config.max_block_bytes),
            )
        self.request_bytes += size
        if self.request_bytes > config.max_request_bytes:
            raise over_limit(
                "request_too_large",
                words.over_request.format(
                    position=position, total=self.request_bytes, limit=config.max_request_bytes
                ),
            )
        # Whole blocks, not frames: streams holding parts of blocks could fill the budget
        # with none of them able to finish one. A stream that then falls behind the
        # minimum rate, or is silent while others need the room, is cut (progress.py).
        await self._lease.reserve_block(size, words.block.format(position=position))
        self._lease.begin_block(size)
        self.results.append(BlockResult(key))
        if position % YIELD_EVERY_BLOCKS == YIELD_EVERY_BLOCKS - 1:
            await asyncio.sleep(0)  # many tiny blocks must not hold the loop
        return position

    # -- frame streams: a block may come in several frames -------------------------------
    async def frame(self, key: bytes, size: int, data: memoryview) -> None:
        """One decoded PutFrame: a block's first frame (``key`` set) or a continuation."""
        partial = self.partial
        if not key:
            if partial is None:
                raise bad_framing("PutFrame.key: the first frame of a block must carry its key")
            if partial.add(data):
                self.partial = None
                self._lease.end_block()
                await self.complete(partial.key, partial.blob())
            return
        if partial is not None:
            raise bad_framing(
                f"PutFrame.key: block #{len(self.results)} started before block "
                f"#{partial.position} was complete ({partial.filled} of {partial.total_size} "
                "bytes)"
            )
        position = await self.open_block(key, size)
        if len(data) == size:
            # The common case, a block in one frame: kept as a view of the message.
            self._lease.end_block()
            await self.complete(key, data)
        elif len(data) > size:
            raise bad_framing(
                f"PutFrame.data: block #{position} got {len(data)} bytes, more than its "
                f"total_size {size}"
            )
        else:
            self.partial = PartialBlock(key, size, data, position)

    def drop(self) -> None:
        """Let go of every block held (the request is over unstored)."""
        self.partial = None
        self.staged.clear()

    def end_of_frames(self) -> None:
        """The frame stream ended: raises Refusal if it ended inside a block."""
        partial = self.partial
        if partial is not None:
            raise bad_framing(
                f"PutFrame.data: the stream ended inside block #{partial.position} "
                f"({partial.filled} of {partial.total_size} bytes)"
            )

    # -- whole blocks ------------------------------------------------------------------
    async def complete(
        self,
        key: bytes,
        blob: memoryview,
        position: int | None = None,
        payload_xxh3: int | None = None,
    ) -> None:
        """Verify a complete block: stage it, or refuse it (its result). ``position``: the
        block's (``open_block``'s answer), by default the last opened; blocks of one
        request may complete concurrently (a codec verifying one while receiving the
        next): they are staged in position order whatever order they finish in.
        ``payload_xxh3``: its stored payload's digest, taken by the codec as the bytes
        arrived (BlockVerifier.check)."""
        rules = self._rules
        if position is None:
            position = len(self.results) - 1
        problem = await rules.verifier.check_async(key, blob, payload_xxh3=payload_xxh3)
        if problem is None:
            bisect.insort(self.staged, (position, key, blob), key=_position)
            return
        rules.metrics.rejected("Put", "invalid_block")
        self._refuse(position, bad_request("invalid_block", f"block #{position}: {problem}"))

    async def finish(self) -> list[BlockResult]:
        """Store the staged blocks, each charged to the tenant's quota first; the result
        of every block, in order. Call only once the request ended cleanly."""
        rules, tenant, quotas = self._rules, self.tenant, self._rules.quotas
        invalid = len(self.results) - len(self.staged)
        if invalid:
            rules.metrics.tenant_rejected(tenant.name, "invalid_block", invalid)
        lookup: Lookup = rules.store.lookup
        stored_bytes = 0
        reconciled = False
        for n, (position, key, blob) in enumerate(self.staged, 1):
            if n % YIELD_EVERY_BLOCKS == 0:
                await asyncio.sleep(0)
            stored_key = tenant.stored_key(key)
            charged_before = quotas.charged(tenant, stored_key)
            admitted = quotas.admit(tenant, stored_key, len(blob))
            if not admitted and not reconciled:
                # The ledger over-counts what tiers evicted meanwhile: recount, once.
                reconciled = True
                await quotas.reconcile(tenant, lookup)
                admitted = quotas.admit(tenant, stored_key, len(blob))
            if not admitted:
                rules.count_rejected(tenant, "over_quota")
                self._refuse(position, self._over_quota(position, len(blob)))
                continue
            await self._store(position, key, stored_key, blob, charged_before)
            stored_bytes += len(blob)
        if quotas.sweep_due(tenant):
            await quotas.sweep(tenant, lookup)
        rules.metrics.put_bytes(stored_bytes)
        rules.metrics.tenant_put_bytes(tenant.name, stored_bytes)
        if tenant.quota_bytes:
            rules.metrics.tenant_usage(tenant.name, quotas.used_bytes(tenant), tenant.quota_bytes)
        return self.results

    def _over_quota(self, position: int, size: int) -> Refusal:
        """Why a block is refused because its tenant's quota is full."""
        quotas, tenant = self._rules.quotas, self.tenant
        return over_limit(
            "over_quota",
            f"block #{position}: quota: tenant {tenant.name} holds {quotas.used_bytes(tenant)} "
            f"of its {tenant.quota_bytes}-byte quota; this block needs "
            f"{quotas.charge_for(size)} more ({size} bytes in {quotas.unit_bytes}-byte pages)",
        )

    def _refuse(self, position: int, refusal: Refusal) -> None:
        """Record block ``position`` as refused (counted by outcome)."""
        self._rules.metrics.put_outcome("rejected")
        self.results[position].refusal = refusal

    async def _store(
        self,
        position: int,
        key: bytes,
        stored_key: bytes,
        blob: memoryview | bytes,
        charged_before: int | None = None,
    ) -> None:
        """Store one validated block (client ``key``) under ``stored_key``.

        The block's quota charge (taken by the caller) is given back when it was not
        stored, and put back to ``charged_before`` (what the key was charged before) when
        the key already held a block: that block stays, and it is what the tenant holds.
        """
        rules, tenant = self._rules, self.tenant
        try:
            outcome = await rules.store.put(stored_key, blob)
        except BlobTooLargeError as e:
            rules.quotas.release(tenant, (stored_key,))
            rules.count_rejected(tenant, "no_tier_fits")
            self._refuse(position, over_limit("no_tier_fits", str(e)))
            return
        if outcome is PutOutcome.FULL:
            rules.quotas.release(tenant, (stored_key,))
            rules.count_rejected(tenant, "pinned_full")
            self._refuse(
                position,
                over_limit(
                    "pinned_full",
                    "tiers: every tier that can hold this block is full of pinned blocks",
                ),
            )
            return
        if outcome is PutOutcome.UNAVAILABLE:
            rules.quotas.release(tenant, (stored_key,))
            rules.count_rejected(tenant, "tier_unavailable")
            self._refuse(
                position,
                Refusal(
                    RefusalKind.TIER_DOWN,
                    "tier_unavailable",
                    "tiers: every tier that can hold this block is unreachable",
                ),
            )
            return
        if outcome is PutOutcome.ALREADY_PRESENT and charged_before is not None:
            rules.quotas.settle(tenant, stored_key, charged_before)
        rules.metrics.put_outcome(outcome.value)
        self.results[position].outcome = outcome


def _position(staged: tuple[int, bytes, memoryview | bytes]) -> int:
    return staged[0]
