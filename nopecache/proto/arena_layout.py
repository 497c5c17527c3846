"""Same-host zero copy: what server and client agree on besides the messages.

Handoff over the abstract Unix socket named by ``OpenArenaReply.socket``::

    client -> server   nonce (NONCE_BYTES)
    server -> client   b"\\x00" with one descriptor (SCM_RIGHTS): the pool, read-only
                       b"\\x01" + a UTF-8 message (no descriptor): why not

Lease replies pack their page runs as little-endian arrays (``LeaseGetReply``):
``run_counts`` one uint32 per key, ``runs`` (offset, length) uint64 pairs.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from nopecache.proto import cache_pb2 as pb

if TYPE_CHECKING:
    import torch

__all__ = [
    "CUDA_IPC_NOT_ACCEPTED",
    "HANDOFF_CUDA_IPC",
    "HANDOFF_ERROR",
    "HANDOFF_OK",
    "HANDOFF_TIMEOUT_S",
    "LEASE_ID_BYTES",
    "MAX_ERROR_BYTES",
    "NONCE_BYTES",
    "RUN_DTYPE",
    "ArenaKind",
    "CudaIpcHandle",
    "cuda_device_uuid",
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
HANDOFF_CUDA_IPC = b"\x02"
# OpenArenaReply.refused of a pool on a GPU to a client that does not accept CUDA IPC.
CUDA_IPC_NOT_ACCEPTED = (
    "the pool is in CUDA memory (cuda://) and this client does not open CUDA IPC "
    "(OpenArenaRequest.accept_cuda_ipc)"
)
CUDA_IPC_LENGTH = struct.Struct("<I")
# A packed handle is ~200 bytes (two 64-byte CUDA handles, a short shm name): a reader
# never takes more than this from the socket.
MAX_CUDA_IPC_BYTES = 4096
MAX_ERROR_BYTES = 4096
RUN_DTYPE = np.dtype("<u8")


class ArenaKind(enum.IntEnum):
    """What an offer hands over on the socket (``OpenArenaReply.kind``)."""

    HOST_MEMFD = pb.ARENA_KIND_HOST_MEMFD
    CUDA_IPC = pb.ARENA_KIND_CUDA_IPC


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


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """What a process needs to open the server's device pool: the fields torch's
    ``UntypedStorage._share_cuda_()`` returns, less the device index (each process numbers
    its GPUs itself: ``OpenArenaReply.cuda_device_uuid`` names the GPU).

    ``handle``: the cudaIpcMemHandle of the allocation holding the pool; ``size_bytes`` /
    ``offset_bytes``: the pool within it; ``ref_counter_*``: torch's producer-side count
    of the processes holding it open; ``event_*``: an IPC event the opener waits on before
    its first read.
    """

    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def __post_init__(self) -> None:
        for name in ("handle", "ref_counter_handle", "event_handle"):
            if not isinstance(getattr(self, name), bytes):
                raise ValueError(f"CudaIpcHandle.{name}: must be bytes")
        for name in ("size_bytes", "offset_bytes", "ref_counter_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CudaIpcHandle.{name}: must be an int >= 0, got {value!r}")
        if not self.handle:
            raise ValueError("CudaIpcHandle.handle: empty")
        if not isinstance(self.event_sync_required, bool):
            raise ValueError("CudaIpcHandle.event_sync_required: must be a bool")

    def pack(self) -> bytes:
        """The socket message: HANDOFF_CUDA_IPC, the length, the msgpack fields."""
        body = msgpack.packb(
            [
                self.handle,
                self.size_bytes,
                self.offset_bytes,
                self.ref_counter_handle,
                self.ref_counter_offset,
                self.event_handle,
                self.event_sync_required,
            ],
            use_bin_type=True,
        )
        if len(body) > MAX_CUDA_IPC_BYTES:
            raise ValueError(f"CudaIpcHandle: {len(body)} bytes packed, over {MAX_CUDA_IPC_BYTES}")
        return HANDOFF_CUDA_IPC + CUDA_IPC_LENGTH.pack(len(body)) + body

    @classmethod
    def unpack(cls, body: bytes) -> CudaIpcHandle:
        """From the bytes after the length; raises ValueError naming what is wrong."""
        try:
            fields = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"CudaIpcHandle: not msgpack: {e}") from e
        if not isinstance(fields, list) or len(fields) != 7:
            raise ValueError("CudaIpcHandle: expected a list of 7 fields")
        return cls(*fields)


def cuda_device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device as ``GPU-xxxxxxxx-...`` (as nvidia-smi -L prints it): how
    server and client name one GPU whatever each one's device numbering."""
    import torch  # deferred: only a pool on a GPU needs it

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
