"""A fixed bulk port for a front proxy (issue 36, item 3): ``bulk_listen`` is claimed at
start-up and ``bulk_advertise_port`` is what OpenBulk announces. Servers in process.

Regressions: the listener used to start at the first OpenBulk on an ephemeral port, so a
proxy had nothing fixed to forward to, and a fixed port chosen ahead could meanwhile be
taken by some client's ephemeral port (bench/load.py met it: EADDRINUSE at OpenBulk).
"""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from nopecache.cache_server.config import ConfigError
from nopecache.cache_server.main import start_server
from tests.support.bulk_wire import open_bulk
from tests.support.redis_procs import free_ports
from tests.support.server_harness import SMALL, serving

pytestmark = pytest.mark.asyncio


async def test_bulk_listen_is_claimed_at_start_and_the_advertised_port_announced() -> None:
    bulk, advertised = free_ports(2)
    config = replace(SMALL, bulk_listen=f"127.0.0.1:{bulk}", bulk_advertise_port=advertised)
    async with serving(config) as h:
        # Listening before any OpenBulk: a proxy can forward to it from the start.
        with socket.create_connection(("127.0.0.1", bulk), timeout=30):
            pass
        reply = await open_bulk(h)
        assert (reply.refused, reply.port, len(reply.ticket)) == ("", advertised, 16)


async def test_without_an_advertised_port_the_listening_one_is_announced() -> None:
    (bulk,) = free_ports(1)
    async with serving(replace(SMALL, bulk_listen=f"127.0.0.1:{bulk}")) as h:
        assert (await open_bulk(h)).port == bulk


async def test_a_taken_bulk_port_fails_the_start_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^bulk_listen: cannot listen on 127.0.0.1:{port}"):
            await start_server(replace(SMALL, bulk_listen=f"127.0.0.1:{port}"))
