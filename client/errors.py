"""The client's exception hierarchy: programming errors the engine must fix, never misses.

A miss, a slow server or a corrupted block is an expected outcome and comes back as a
value (an empty plan, a dropped hit). Exceptions here mean the caller asked for
something impossible: a malformed argument, a block of another model.

    NopecacheError
     +-- InvalidArgumentError   (also a ValueError)
     +-- FingerprintMismatchError
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
