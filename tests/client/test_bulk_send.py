"""The bulk stream's gathering sender: every byte of every part, in order, however the
socket splits the writes."""

from __future__ import annotations

import random
import socket
import threading
import time

from nopecache.client.bulk import _IOV_MAX, _send_parts


def test_parts_arrive_whole_and_in_order_through_partial_sends() -> None:
    rng = random.Random(7)
    # More parts than one sendmsg takes, sizes from empty to larger than the socket buffer.
    sizes = [0, 1, 24, 300_000, 0, 5, 1_000_000] + [rng.randrange(0, 5000) for _ in range(1100)]
    assert len(sizes) > _IOV_MAX
    parts = [memoryview(rng.randbytes(n)) for n in sizes]
    want = b"".join(bytes(p) for p in parts)
    a, b = socket.socketpair()
    # A small send buffer forces partial sends in the middle of parts.
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            chunk = b.recv(65536)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        # The deadline only guards a hang: the transfer takes milliseconds.
        _send_parts(a, parts, time.monotonic() + 120)
        reader.join(120)
    finally:
        a.close()
        b.close()
    assert bytes(got) == want
