"""The one way the server refuses a request: :class:`Refusal`, its kind a :class:`RefusalKind`.

Raised by the transfer rules (``transfer_put.py``, ``transfer_get.py``), the in-flight
budget (``inflight.py``) and the shared-memory table (``shm.py``); caught by the two
codecs, each of which turns it into its wire form in one place: the gRPC service
(``service.py``) aborts the call with the kind's status code and the message as details,
the bulk server (``bulk.py``) answers an ERROR carrying the message. A refusal of one
block of a Put is not raised but kept as that block's result (``transfer_put.BlockResult``).

Transport-free on purpose: no gRPC status here, so the rules can be called and tested
without a server (the kind -> status table is ``codes.STATUS``).
"""

from __future__ import annotations

import enum

__all__ = ["Refusal", "RefusalKind", "bad_request", "over_limit"]


class RefusalKind(enum.Enum):
    """Why a request (or one block of it) is refused, as a caller may act on it."""

    # Malformed: framing, keys, a block that fails verification, bad shm arguments.
    # A retry of the same request fails the same way.
    BAD_REQUEST = "bad_request"
    # Over a limit: key count, block or request bytes, quota, in-flight budget, no tier
    # large enough. A smaller request, or the same one later, may pass.
    OVER_LIMIT = "over_limit"
    # The peer was too slow: a Put that sent nothing, a Get reader that took nothing.
    TOO_SLOW = "too_slow"
    # The shared-memory session named is gone (expired or detached): attach again.
    STALE_SESSION = "stale_session"
    # Every tier that could hold the block is unreachable.
    TIER_DOWN = "tier_down"


class Refusal(Exception):
    """A refused request: its ``kind``, the metric ``reason`` (a short label, e.g.
    ``too_many_keys``) and the ``message`` the caller reads, naming the field."""

    def __init__(self, kind: RefusalKind, reason: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason
        self.message = message

    def __repr__(self) -> str:
        return f"Refusal({self.kind.name}, {self.reason!r}, {self.message!r})"


def bad_request(reason: str, message: str) -> Refusal:
    """A BAD_REQUEST refusal."""
    return Refusal(RefusalKind.BAD_REQUEST, reason, message)


def over_limit(reason: str, message: str) -> Refusal:
    """An OVER_LIMIT refusal."""
    return Refusal(RefusalKind.OVER_LIMIT, reason, message)
