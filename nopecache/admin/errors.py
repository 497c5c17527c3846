"""The exit codes of ``nopecache-admin`` and the one error type that carries them.

0  done
1  any other failure (a server-side error the codes below do not name)
2  usage: a bad argument, option or URL (also a request the server calls invalid)
3  auth: no or wrong token (UNAUTHENTICATED) or not allowed (PERMISSION_DENIED)
4  unavailable: the server cannot be reached, is draining, or did not answer in time
5  not found: a tenant, file or folder named does not exist
6  refused: over a limit (RESOURCE_EXHAUSTED: a quota, pinned bytes, key count)
"""

from __future__ import annotations

import enum

import grpc

__all__ = ["AdminError", "ExitCode", "exit_code_of"]


class ExitCode(enum.IntEnum):
    """What the process exit status means (module docstring)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    AUTH = 3
    UNAVAILABLE = 4
    NOT_FOUND = 5
    REFUSED = 6


class AdminError(Exception):
    """A failure the CLI reports on one line and exits with ``code``."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: ExitCode.USAGE,
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.AUTH,
    grpc.StatusCode.PERMISSION_DENIED: ExitCode.AUTH,
    grpc.StatusCode.UNAVAILABLE: ExitCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ExitCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND: ExitCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ExitCode.REFUSED,
}


def exit_code_of(status: grpc.StatusCode) -> ExitCode:
    """The exit code of a call that ended with ``status``."""
    return _BY_STATUS.get(status, ExitCode.FAILED)
