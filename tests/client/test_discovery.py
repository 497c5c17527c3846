"""Discovery: a name stands for every address it resolves to, resolved again on a timer and
soon after a server fails (rate-limited); the client re-shards and only the keys of servers
that came or went move. Real servers on loopback; DNS is the system resolver for
``localhost`` or a resolver the test rewrites (no DNS server, /etc/hosts untouched)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import torch

from nopecache.client import AsyncCacheClient, CacheClient, ClientConfig, ModelFingerprint
from nopecache.client.config import normalize_server
from nopecache.client.discovery import Discovery, GetaddrinfoResolver
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.sharding import Rendezvous
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.server_procs import CacheServerProc, ServerFactory

LAYERS, HEADS, DIM = 2, 2, 8
SPEC = RopeSpec.default(DIM)
NAME = "replicas.test"
# Small blocks so a short prompt has many keys to spread over the servers; long timeouts
# so that a loaded machine does not turn a slow answer into a miss.
CLIENT_PARAMS = (
    "discover=dns&dns_refresh=0&dns_min_interval=100ms&cost_enabled=false&lookup_timeout=10s"
    "&get_timeout=10s&put_timeout=10s&connect_timeout=5s&retry_max_attempts=1"
    "&prefix_block_tokens=16&chunk_min_tokens=4&chunk_avg_tokens=16&chunk_max_tokens=32"
)


class ListResolver:
    """A stand-in for DNS that the test rewrites: name -> addresses; records every query."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.calls: list[float] = []  # time.monotonic() of each query
        self.delay_s = 0.0

    async def resolve(self, host: str, port: int) -> tuple[str, ...]:
        """The addresses set for ``host``; gaierror for a name without any."""
        self.calls.append(time.monotonic())
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return tuple(self.answers[host])


class Applied:
    """Records every server set Discovery applies."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, ...]] = []

    async def __call__(self, servers: tuple[str, ...]) -> None:
        self.sets.append(servers)


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- the resolvers -----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_system_resolver_gives_every_address_of_localhost() -> None:
    expected = tuple(
        dict.fromkeys(
            normalize_server(f"[{a[4][0]}]:4242" if a[0] == socket.AF_INET6 else f"{a[4][0]}:4242")
            for a in socket.getaddrinfo("localhost", 4242, type=socket.SOCK_STREAM)
        )
    )
    assert "127.0.0.1:4242" in expected
    assert await GetaddrinfoResolver().resolve("localhost", 4242) == expected
    assert await GetaddrinfoResolver("ipv4").resolve("localhost", 4242) == ("127.0.0.1:4242",)


@pytest.mark.asyncio
async def test_system_resolver_passes_ip_literals_through() -> None:
    assert await GetaddrinfoResolver().resolve("127.0.0.1", 7) == ("127.0.0.1:7",)
    assert await GetaddrinfoResolver("ipv6").resolve("::1", 7) == ("[::1]:7",)
    with pytest.raises(socket.gaierror):
        await GetaddrinfoResolver("ipv6").resolve("127.0.0.1", 7)


def test_bad_family_is_named() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        GetaddrinfoResolver("inet")  # type: ignore[arg-type]
    assert err.value.argument == "family"


# -- Discovery on its own ----------------------------------------------------------------
@pytest.mark.asyncio
async def test_union_of_all_names_is_applied_once_per_change() -> None:
    resolver = ListResolver({"a": ["10.0.0.2", "10.0.0.1:9"], "b": ["10.0.0.1:9"]})
    applied = Applied()
    discovery = Discovery(["a:1", "B:2"], applied, resolver=resolver, refresh_s=0)
    assert discovery.servers == ("a:1", "b:2")  # the names until they resolve
    assert await discovery.start() == ("10.0.0.1:9", "10.0.0.2:1")  # bare address: the port
    assert await discovery.refresh() == ("10.0.0.1:9", "10.0.0.2:1")
    resolver.answers["b"] = ["10.0.0.3:9"]
    assert await discovery.refresh() == ("10.0.0.1:9", "10.0.0.2:1", "10.0.0.3:9")
    assert applied.sets == [
        ("10.0.0.1:9", "10.0.0.2:1"),
        ("10.0.0.1:9", "10.0.0.2:1", "10.0.0.3:9"),
    ]
    assert len(resolver.calls) == 6  # two names, three resolutions
    await discovery.close()


@pytest.mark.asyncio
async def test_a_name_that_stops_resolving_keeps_its_addresses() -> None:
    resolver = ListResolver({"a": ["10.0.0.1:1"], "b": ["10.0.0.2:1"]})
    applied = Applied()
    discovery = Discovery(["a:1", "b:1"], applied, resolver=resolver, refresh_s=0, timeout_s=0.2)
    both = ("10.0.0.1:1", "10.0.0.2:1")
    assert await discovery.start() == both
    del resolver.answers["a"]  # NXDOMAIN
    assert await discovery.refresh() == both
    resolver.answers["a"] = []  # no record
    assert await discovery.refresh() == both
    resolver.answers["a"] = ["not an address"]
    assert await discovery.refresh() == both
    resolver.delay_s = 5.0  # slower than timeout_s
    assert await discovery.refresh() == both
    assert applied.sets == [both]
    await discovery.close()


@pytest.mark.asyncio
async def test_nothing_resolving_keeps_the_configured_names() -> None:
    applied = Applied()
    discovery = Discovery(["gone:5"], applied, resolver=ListResolver({}), refresh_s=0)
    assert await discovery.start() == ("gone:5",)
    assert applied.sets == []
    await discovery.close()


@pytest.mark.asyncio
async def test_resolves_again_on_the_timer() -> None:
    resolver = ListResolver({"a": ["10.0.0.1:1"]})
    applied = Applied()
    discovery = Discovery(["a:1"], applied, resolver=resolver, refresh_s=0.05, min_interval_s=0)
    await discovery.start()
    resolver.answers["a"] = ["10.0.0.1:1", "10.0.0.2:1"]
    await _until(lambda: discovery.servers == ("10.0.0.1:1", "10.0.0.2:1"))
    assert applied.sets[-1] == ("10.0.0.1:1", "10.0.0.2:1")
    await discovery.close()
    calls = len(resolver.calls)
    await asyncio.sleep(0.2)
    assert len(resolver.calls) == calls  # closed: no more queries


@pytest.mark.asyncio
async def test_failures_trigger_one_resolution_per_min_interval() -> None:
    resolver = ListResolver({"a": ["10.0.0.1:1"]})
    discovery = Discovery(["a:1"], Applied(), resolver=resolver, refresh_s=0, min_interval_s=0.3)
    await discovery.start()
    for _ in range(3):  # several failures at once: one resolution, after the interval
        discovery.server_failed()
    await _until(lambda: len(resolver.calls) == 2)
    assert resolver.calls[1] - resolver.calls[0] >= 0.3
    await asyncio.sleep(0.4)
    assert len(resolver.calls) == 2  # coalesced, and no timer (refresh_s=0)
    discovery.server_failed()  # long after the last resolution: without waiting
    await _until(lambda: len(resolver.calls) == 3)
    await discovery.close()
    discovery.server_failed()
    await asyncio.sleep(0.1)
    assert len(resolver.calls) == 3


def test_discovery_needs_discover_dns() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Discovery.for_config(ClientConfig(("h:1",)), Applied())
    assert err.value.argument == "discover"
    with pytest.raises(InvalidArgumentError) as err:
        AsyncCacheClient(
            "nopecache://h:1",
            fingerprint=_fingerprint(),
            rope=SPEC,
            v_head_dim=DIM,
            resolver=ListResolver({}),
        )
    assert err.value.argument == "resolver"


# -- a client over real servers ----------------------------------------------------------
def _fingerprint() -> ModelFingerprint:
    return ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.float32,
        form=StoredForm.NOPE,
        rope=SPEC,
    )


def _doc(n: int = 400) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 5000, (n,), generator=g)
    shape = (LAYERS, n, HEADS, DIM)
    return tokens, (torch.randn(shape, generator=g), torch.randn(shape, generator=g))


async def _found(client: AsyncCacheClient, tokens: torch.Tensor) -> set[bytes]:
    """Keys of the content chunks of ``tokens`` that the lookup found."""
    plan = await client.lookup(tokens)
    assert not plan.prefix  # stored without prefix blocks
    return {h.key.value for h in plan.hits}


@pytest.mark.asyncio
async def test_client_follows_the_names_and_only_moved_keys_miss(
    cache_servers: ServerFactory,
) -> None:
    procs = cache_servers(3)
    s0, s1, s2 = (s.address for s in procs)
    resolver = ListResolver({NAME: [s0, s1]})  # SRV-like: host:port pairs
    client = AsyncCacheClient(
        f"nopecache://{NAME}:1?namespace=follow&{CLIENT_PARAMS}",
        fingerprint=_fingerprint(),
        rope=SPEC,
        v_head_dim=DIM,
        resolver=resolver,
    )
    try:
        tokens, kv = _doc()
        keys = [c.key.value for c in client.prepare_store(tokens, kv, prefix=False).pi]
        assert len(keys) >= 15
        assert client.servers == (f"{NAME}:1",)
        first = await client.store(tokens, kv, prefix=False)
        assert client.servers == tuple(sorted((s0, s1)))
        assert (first.stored, first.failed) == (len(keys), 0)
        ring2, ring3, ring_end = (
            Rendezvous([s0, s1]),
            Rendezvous([s0, s1, s2]),
            Rendezvous([s1, s2]),
        )
        holders = {k: {ring2.owner(k)} for k in keys}

        # A server appears: exactly the keys it now owns miss, nothing else moved.
        resolver.answers[NAME] = [s0, s1, s2]
        assert await client.refresh_servers() == tuple(sorted((s0, s1, s2)))
        moved = {k for k in keys if ring3.owner(k) != ring2.owner(k)}
        assert moved == {k for k in keys if ring3.owner(k) == s2}
        assert 0 < len(moved) < len(keys)
        assert await _found(client, tokens) == set(keys) - moved
        second = await client.store(tokens, kv, prefix=False)
        assert (second.stored, second.already_present) == (len(moved), len(keys) - len(moved))
        for k in keys:
            holders[k].add(ring3.owner(k))

        # A server dies and leaves DNS: its keys are misses (not errors), the failure makes
        # the client resolve again (there is no timer), and it re-shards over the rest.
        calls = len(resolver.calls)
        procs[0].kill()
        resolver.answers[NAME] = [s1, s2]
        assert await _found(client, tokens) == {k for k in keys if ring3.owner(k) != s0}
        await _until(lambda: client.servers == tuple(sorted((s1, s2))))
        assert len(resolver.calls) == calls + 1
        expected = {k for k in keys if ring_end.owner(k) in holders[k] - {s0}}
        assert await _found(client, tokens) == expected
        assert expected != set(keys)  # s0 held keys nobody else had: lost with it
    finally:
        await client.close()


def test_localhost_through_the_system_resolver(cache_server: CacheServerProc) -> None:
    url = (
        f"nopecache://localhost:{cache_server.port}?namespace=localhost&dns_family=ipv4&"
        + CLIENT_PARAMS.replace("dns_refresh=0", "dns_refresh=30s")
    )
    with CacheClient(url, fingerprint=_fingerprint(), rope=SPEC, v_head_dim=DIM) as client:
        assert client.refresh_servers() == (cache_server.address,)
        tokens, kv = _doc(120)
        report = client.store(tokens, kv)
        assert report.stored > 0 and report.failed == 0
        plan = client.lookup(tokens)
        assert plan.prefix_end == 112  # 7 whole blocks of 16
        assert client.servers == (f"127.0.0.1:{cache_server.port}",)
