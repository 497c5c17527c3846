"""Same-host zero copy: what server and client agree on besides the messages.

Handoff over the abstract Unix socket named by ``OpenArenaReply.socket``::

    client -> server   nonce (NONCE_BYTES)
    server -> client   b"\\x00" with one descriptor (SCM_RIGHTS): the pool, read-only
                       b"\\x01" + a UTF-8 message (no descriptor): why not

Lease replies pack their page runs as little-endian arrays (``LeaseGetReply``):
``run_counts`` one uint32 per key, ``runs`` (offset, length) uint64 pairs.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "HANDOFF_ERROR",
    "HANDOFF_OK",
    "HANDOFF_TIMEOUT_S",
    "LEASE_ID_BYTES",
    "MAX_ERROR_BYTES",
    "NONCE_BYTES",
    "RUN_DTYPE",
    "pack_runs",
    "unpack_runs",
]

NONCE_BYTES = 16
# Each side of the handoff gives the other this long (the client to answer with the
# descriptor, a connection to send its nonce) before it gives up or cuts the socket.
HANDOFF_TIMEOUT_S = 5.0
LEASE_ID_BYTES = 16
HANDOFF_OK = b"\x00"
HANDOFF_ERROR = b"\x01"
MAX_ERROR_BYTES = 4096
RUN_DTYPE = np.dtype("<u8")
_COUNT_DTYPE = np.dtype("<u4")


def pack_runs(per_key: list[list[tuple[int, int]]]) -> tuple[bytes, bytes]:
    """``(run_counts, runs)`` of each key's (offset, length) runs (empty: not leased)."""
    counts = np.fromiter((len(r) for r in per_key), dtype=_COUNT_DTYPE, count=len(per_key))
    flat = [x for runs in per_key for run in runs for x in run]
    return counts.tobytes(), np.asarray(flat, dtype=RUN_DTYPE).tobytes()


def unpack_runs(run_counts: bytes, runs: bytes, keys: int) -> list[list[tuple[int, int]]]:
    """Each key's runs from a reply; raises ValueError when the arrays do not agree."""
    if len(run_counts) != 4 * keys:
        raise ValueError(f"run_counts: {len(run_counts)} bytes for {keys} keys")
    counts = np.frombuffer(run_counts, dtype=_COUNT_DTYPE)
    if len(runs) % 16 or len(runs) // 16 != int(counts.sum()):
        raise ValueError(f"runs: {len(runs)} bytes for {int(counts.sum())} runs")
    flat = np.frombuffer(runs, dtype=RUN_DTYPE).reshape(-1, 2).tolist()
    out: list[list[tuple[int, int]]] = []
    at = 0
    for count in counts.tolist():
        out.append([(int(a), int(b)) for a, b in flat[at : at + count]])
        at += count
    return out
