"""``nopecache-admin`` against a server without tokens that listens beyond loopback
(127.0.0.2 stands for such an address): the gRPC port serves no Admin, and the CLI says
where to look; the loopback listener ``--admin-listen`` names serves it (issue 36, item 6)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from nopecache.admin.cli import main
from nopecache.admin.errors import ExitCode
from tests.support.server_harness import SMALL, STORED, key_of, make_block, put, serving


def run(address: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``nopecache-admin`` (its ``main``) against ``address``: (exit code, stdout, stderr)."""
    code = main(["--url", f"nopecache://{address}", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.asyncio
async def test_the_cli_reaches_admin_on_its_loopback_listener_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = replace(SMALL, host="127.0.0.2", admin_listen="127.0.0.1:0")
    async with serving(config) as h:
        results = await put(h.stub, [(key_of(0), make_block(key_of(0)))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        # The CLI's channel is synchronous: run it off the server's event loop.
        code, _, err = await asyncio.to_thread(run, h.running.address, capsys, "stats")
        assert code == ExitCode.FAILED
        assert err.endswith(
            "AdminStats: UNIMPLEMENTED: Method not found! (no Admin service at this address: "
            "a server without tokens serves it on loopback only, or where its --admin-listen "
            "says)\n"
        ), err
        local = f"127.0.0.1:{h.running.admin_port}"
        code, out, err = await asyncio.to_thread(run, local, capsys, "--json", "stats")
        assert code == ExitCode.OK, err
        stats = json.loads(out)
        assert [t["entries"] for t in stats["tiers"]] == [1]
        code, out, err = await asyncio.to_thread(run, local, capsys, "--json", "flush", "--all")
        assert code == ExitCode.OK, err
        assert json.loads(out)["deleted"] == 1
