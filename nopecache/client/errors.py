"""The client's exception hierarchy: programming errors the engine must fix, never misses.

A miss, a slow server or a corrupted block is an expected outcome and comes back as a
value (an empty plan, a dropped hit). Exceptions here mean the caller asked for
something impossible: a malformed argument, a block of another model.

    NopecacheError
     +-- InvalidArgumentError   (also a ValueError)
     +-- FingerprintMismatchError
     +-- TransportError         (internal: a server broke the contract; becomes misses)
     +-- ArenaRefusedError      (internal: no read-only pool mapping; the copy paths serve)

A server's refusal of one block is not an exception either: it is a
``StoreResult`` with ``StoreStatus.REJECTED`` and the server's reason (transport.py).
"""

from __future__ import annotations


class NopecacheError(Exception):
    """Base class of every exception the nopecache client raises."""


class InvalidArgumentError(NopecacheError, ValueError):
    """An argument or field has a value the client cannot use.

    ``argument`` names the offending argument (or ``"object.field"``), ``reason`` says
    what is wrong with it; ``str(err)`` is ``"<argument>: <reason>"``.
    """

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"{argument}: {reason}")
        self.argument = argument
        self.reason = reason

    def __reduce__(self) -> tuple[type[InvalidArgumentError], tuple[str, str]]:
        # Keep both fields across pickling (multiprocessing workers re-raise it).
        return (type(self), (self.argument, self.reason))


class FingerprintMismatchError(NopecacheError):
    """Data made for one model fingerprint was offered to a client of another."""


class TransportError(NopecacheError):
    """A server's reply broke the wire contract (bad frame, wrong count, bad limits).

    Raised inside the transport (and by fast-path sources) and handled like an RPC
    failure: the server is marked down and its keys become misses; it never reaches the
    engine.
    """


class ArenaRefusedError(NopecacheError):
    """The server gave no descriptor of its pool (same-host zero copy): a nonce that is
    unknown, used, expired or presented by another process, or a server that offers no
    pool. The connection takes the copying paths; it never reaches the engine."""
