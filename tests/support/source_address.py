"""Calls from another loopback source address: a TCP relay for tests.

gRPC's Python channel cannot choose its source address, so a test that needs a caller at
127.0.0.5 dials :class:`relay_from`'s listening address (127.0.0.1, a free port); each
connection it accepts is relayed to the target over a socket bound to the source address.
The server then sees the peer ``ipv4:127.0.0.5:PORT``. Loopback only (127.0.0.0/8).
``listen`` picks the relay's own address: a client whose server announces a second port
(the bulk stream's) dials the host it dialled for gRPC at that port, so a relay for that
port listens on the same host with the announced port number.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket

__all__ = ["connect_from", "relay_from"]

_CHUNK = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF or a closed socket."""
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError):
        writer.close()


class relay_from:
    """``async with relay_from("127.0.0.5", "127.0.0.1:1234") as address``: dial ``address``
    (``listen=("127.0.0.15", 1234)``: the relay listens there instead of 127.0.0.1:free)."""

    def __init__(
        self, source: str, target: str, listen: tuple[str, int] = ("127.0.0.1", 0)
    ) -> None:
        for host in (source, listen[0]):
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError(f"tests use loopback addresses only, got {host}")
        self._listen = listen
        self._source = source
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self._source, 0))
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self._target)
        except OSError:
            sock.close()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(sock=sock)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._track, *self._listen)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


def connect_from(source: str, host: str, port: int, timeout_s: float = 30.0) -> socket.socket:
    """A blocking TCP socket from ``source`` (loopback) connected to ``host:port``."""
    if not ipaddress.ip_address(source).is_loopback:
        raise ValueError(f"tests use loopback addresses only, got {source}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        sock.connect((host, port))
    except OSError:
        sock.close()
        raise
    return sock
