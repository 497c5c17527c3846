"""Fault injection on the read paths (``--fault-injection``, cache_server/faults.py), end to
end: a real server on loopback damages, drops and delays the blocks it sends, and the
real client turns every fault into a miss. A fetch returns the exact stored bytes or a
miss, never anything else: every placed block of a paged cache is compared bit for bit
with the KV that was stored, and every slot of a missed block must be untouched.

Routes through the client, with the server path each one reads:

    grpc       shm off, bulk off         Get, data frames           path "get"
    shm        the shared-memory window   Get, lent pages copied     path "get"
    bulk       shm off, bulk stream       the bulk byte stream       path "bulk"
    zero_copy  the mapped pool            LeaseGet, and the shm Get  path "zero_copy"
                                          fallback for refused leases (path "get")
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from nopecache.cache_server.config import ConfigError, ServerConfig, load_config
from nopecache.cache_server.faults import (
    Fault,
    FaultInjector,
    FaultKind,
    FaultSpec,
    damaged,
    parse_fault_spec,
)
from nopecache.client import ClientConfig, PagedKV, RetryPolicy
from nopecache.client.cost import CostConfig
from nopecache.client.metrics import ClientStats
from nopecache.proto.block import BlockError, StoredForm, parse, validate
from tests.support.client_harness import DIM, HEADS, LAYERS, PREFIX_BLOCK, client, kv, prompt
from tests.support.fault_servers import start_fault_server
from tests.support.ready import ProcessExited
from tests.support.server_harness import SMALL, Harness, key_of, make_block, serving
from tests.support.server_procs import CacheServerProc

TOKENS = 10 * PREFIX_BLOCK  # ten exact-prefix blocks of 2 layers x 16 tokens x 2 x 8 fp32
ROUNDS = 2
SENTINEL = 7.0  # what an untouched slot of the paged cache holds
# A hang guard for each call, not a timing: a loopback fetch of ten 4 KiB blocks takes
# milliseconds; a loaded 2-core machine may take many times that. (The client's default
# deadlines, 0.5 s for a lookup, would turn a slow machine's hits into misses.)
GET_TIMEOUT_S = 30.0

ROUTES: dict[str, dict[str, object]] = {
    "grpc": {"shm": "off", "bulk": "off"},
    "shm": {"shm": "on", "bulk": "off", "zero_copy": False},
    "bulk": {"shm": "off", "bulk": "auto"},
    "zero_copy": {"shm": "on", "bulk": "off", "zero_copy": True},
}
PATH_OF = {"grpc": "get", "shm": "get", "bulk": "bulk", "zero_copy": "zero_copy"}
KINDS = [k.value for k in FaultKind]
FAULTS = "nopecache_faults_injected_total"


def faulty(spec: FaultSpec) -> ServerConfig:
    """The small test server (a pool zero copy can map) with ``spec`` injected."""
    return replace(SMALL, fault_injection=spec)


@dataclass
class Fetched:
    """What the rounds of fetches of one client came to."""

    blocks: int  # planned blocks, all rounds
    failed: list[tuple[int, int]]  # target spans of missed blocks, all rounds
    stats: ClientStats


def _paged() -> PagedKV:
    """A paged cache of the whole prompt (slot i for position i), every slot SENTINEL."""
    shape = (TOKENS // PREFIX_BLOCK, PREFIX_BLOCK, HEADS, DIM)
    return PagedKV(
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        torch.arange(TOKENS),
    )


def fetch_rounds(address: str, route: str, rounds: int = ROUNDS, **changes: object) -> Fetched:
    """Store the prompt's exact-prefix blocks, then fetch them ``rounds`` times into fresh
    paged caches over ``route``; asserts each placed block is bit-exact and each missed
    block left its slots untouched. Runs the (synchronous) client: call it in a thread."""
    fields: dict[str, object] = {
        "get_timeout_s": GET_TIMEOUT_S,
        "put_timeout_s": GET_TIMEOUT_S,
        "lookup_timeout_s": GET_TIMEOUT_S,
        "control_timeout_s": GET_TIMEOUT_S,
        "connect_timeout_s": GET_TIMEOUT_S,
        **ROUTES[route],
        **changes,
    }
    cfg = ClientConfig(
        servers=(address,),
        retry=RetryPolicy(max_attempts=1),
        cost=CostConfig(enabled=False),
        namespace="faults",
        **fields,  # type: ignore[arg-type]
    )
    tokens = prompt(TOKENS, seed=11)
    k, v = kv(TOKENS, seed=11)
    failed: list[tuple[int, int]] = []
    blocks = 0
    with client(cfg, StoredForm.ROPE) as c:
        report = c.store(tokens, (k, v), 0, form="rope", position_independent=False)
        assert report.failed == 0
        for _ in range(rounds):
            plan = c.lookup(tokens, allow_position_independent=False)
            assert plan.prefix_end == TOKENS and len(plan.blocks) == TOKENS // PREFIX_BLOCK
            into = _paged()
            result = c.fetch(plan, tokens, into=into)
            assert sorted(result.placed + result.failed, key=lambda h: h.target.start) == sorted(
                plan.blocks, key=lambda h: h.target.start
            )
            assert into.v_caches is not None
            for layer in range(LAYERS):
                got_k = into.k_caches[layer].reshape(TOKENS, HEADS, DIM)
                got_v = into.v_caches[layer].reshape(TOKENS, HEADS, DIM)
                for hit in result.placed:  # the stored bytes, exactly (no rotation: delta 0)
                    t = slice(hit.target.start, hit.target.end)
                    assert torch.equal(got_k[t], k[layer, t]), (layer, t)
                    assert torch.equal(got_v[t], v[layer, t]), (layer, t)
                for hit in result.failed:  # nothing written
                    t = slice(hit.target.start, hit.target.end)
                    assert bool((got_k[t] == SENTINEL).all()), (layer, t)
                    assert bool((got_v[t] == SENTINEL).all()), (layer, t)
            blocks += len(plan.blocks)
            failed += [(h.target.start, h.target.end) for h in result.failed]
        stats = c.stats()
    return Fetched(blocks, failed, stats)


def injected(h: Harness, kind: str | None = None, path: str | None = None) -> int:
    """Faults the in-process server counted, of one kind and/or path or all."""
    total = 0
    for metric in h.running.metrics.registry.collect():
        for s in metric.samples:
            if s.name != FAULTS:
                continue
            if kind in (None, s.labels["kind"]) and path in (None, s.labels["path"]):
                total += int(s.value)
    return total


# -- every kind on every route: the exact bytes or a miss ----------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("kind", KINDS)
async def test_every_fault_is_a_miss_and_every_hit_is_exact(kind: str, route: str) -> None:
    spec = FaultSpec(seed=3, rate=0.5, kinds=(FaultKind(kind),), delay_ms=20)
    async with serving(faulty(spec)) as h:
        got = await asyncio.to_thread(fetch_rounds, h.running.address, route)
        path = PATH_OF[route]
        if route == "zero_copy" and kind != "delay":
            # The pool's pages are never damaged: the lease is refused and the key read
            # over the shared-memory Get, where it draws a fault of its own.
            assert injected(h, "refuse_lease", "zero_copy") > 0
            assert injected(h, path="zero_copy") == injected(h, "refuse_lease")
            path = "get"
        faults = injected(h, kind, path)
        assert faults > 0 and injected(h) == faults + injected(h, "refuse_lease")
    assert got.stats.server_errors == {}
    if kind == "delay":  # well inside the client's deadline: served, late
        assert got.failed == [] and got.stats.missed_blocks == got.stats.verify_failures == 0
        return
    # Each fault cost exactly its own block, nothing else.
    assert len(got.failed) == faults < got.blocks
    if kind == "drop":
        assert (got.stats.missed_blocks, got.stats.verify_failures) == (faults, 0)
    else:  # caught by the checksums and sizes
        assert (got.stats.verify_failures, got.stats.missed_blocks) == (faults, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_delay_past_the_clients_deadline_is_a_miss(route: str) -> None:
    # Every block held back 3 s; the client waits 0.5 s for a Get.
    spec = FaultSpec(seed=1, rate=1.0, kinds=(FaultKind.DELAY,), delay_ms=3000)
    async with serving(faulty(spec)) as h:
        got = await asyncio.to_thread(fetch_rounds, h.running.address, route, 1, get_timeout_s=0.5)
        assert injected(h, "delay") > 0
    assert len(got.failed) == got.blocks == TOKENS // PREFIX_BLOCK
    assert sum(got.stats.server_errors.values()) >= 1


# -- what is stored stays intact ------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["grpc", "bulk", "zero_copy"])
async def test_faulted_reads_never_touch_the_stored_blocks(route: str) -> None:
    spec = FaultSpec(
        seed=2, rate=1.0, kinds=(FaultKind.FLIP_PAYLOAD, FaultKind.FLIP_HEADER, FaultKind.TRUNCATE)
    )
    async with serving(faulty(spec)) as h:
        got = await asyncio.to_thread(fetch_rounds, h.running.address, route)
        assert len(got.failed) == got.blocks  # every read damaged
        store = h.running.store
        keys = await store.keys_with_prefix(b"")
        assert len(keys) == TOKENS // PREFIX_BLOCK
        for found in await store.get_many(keys):
            assert found is not None
            validate(found[0])  # both checksums hold
        # Faults off again on the same server: a clean read returns the exact bytes.
        faults = h.running.service.faults
        assert faults is not None
        faults.spec = replace(spec, rate=0.0)
        clean = await asyncio.to_thread(fetch_rounds, h.running.address, route)
    assert clean.failed == [] and clean.stats.verify_failures == 0


# -- rate 0, seeds --------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_rate_zero_injects_nothing() -> None:
    spec = FaultSpec(seed=9, rate=0.0, delay_ms=2000)
    async with serving(faulty(spec)) as h:
        for route in ROUTES:
            got = await asyncio.to_thread(fetch_rounds, h.running.address, route)
            assert got.failed == [] and got.stats.verify_failures == 0, route
        assert injected(h) == 0


@pytest.mark.asyncio
async def test_the_same_seed_gives_the_same_faults() -> None:
    runs = []
    for seed in (5, 5, 6):
        async with serving(faulty(FaultSpec(seed=seed, rate=0.5, delay_ms=5))) as h:
            got = await asyncio.to_thread(fetch_rounds, h.running.address, "grpc", 3)
            by_kind = {k: injected(h, k, "get") for k in KINDS}
        runs.append((got.failed, by_kind))
    assert runs[0] == runs[1]
    assert runs[0][0] and sum(runs[0][1].values()) > 0
    assert runs[0] != runs[2]  # another seed, another sequence


def test_the_injectors_sequence_is_the_seeds_per_path() -> None:
    def draws(seed: int, order: list[str]) -> dict[str, list[object]]:
        inj = FaultInjector(FaultSpec(seed=seed, rate=0.3), lambda kind, path: None)
        out: dict[str, list[object]] = {"get": [], "bulk": []}
        for path in order:
            out[path].append(inj.draw(path))  # type: ignore[arg-type]
        return out

    a = draws(4, ["get", "bulk"] * 100)
    # Interleaving reads of another path does not change a path's sequence.
    assert a == draws(4, ["get"] * 100 + ["bulk"] * 100)
    assert a != draws(5, ["get", "bulk"] * 100)
    assert 0 < sum(f is not None for f in a["get"]) < 100


@pytest.mark.parametrize("at", [0.0, 0.5, 0.999])
@pytest.mark.parametrize(
    "kind", [FaultKind.FLIP_PAYLOAD, FaultKind.FLIP_HEADER, FaultKind.TRUNCATE]
)
def test_damage_is_done_to_a_copy_in_the_part_it_names(kind: FaultKind, at: float) -> None:
    blob = bytearray(make_block(key_of(1), tokens=16, head_dim=16))
    original = bytes(blob)
    start = len(blob) - parse(blob)[1].nbytes
    pages = [memoryview(blob)[:4096], memoryview(blob)[4096:]]  # as a tier lends them
    out = damaged(Fault(kind, at, 0x5A), pages)
    assert blob == original  # never the stored bytes
    with pytest.raises(BlockError):
        validate(out)
    if kind is FaultKind.TRUNCATE:
        assert 1 <= len(out) < len(blob) and out == original[: len(out)]
        return
    (where,) = [i for i in range(len(blob)) if out[i] != original[i]]
    assert out[where] == original[where] ^ 0x5A
    assert (where >= start) == (kind is FaultKind.FLIP_PAYLOAD)


# -- the option ----------------------------------------------------------------------------------
def test_the_option_parses_into_a_frozen_spec_and_is_off_by_default() -> None:
    assert ServerConfig().fault_injection is None
    spec = load_config(
        ["--fault-injection", "seed=7,rate=0.2,kinds=flip,truncate,drop,delay,delay_ms=50"], env={}
    ).fault_injection
    assert spec == FaultSpec(
        seed=7,
        rate=0.2,
        kinds=(
            FaultKind.FLIP_PAYLOAD,
            FaultKind.FLIP_HEADER,
            FaultKind.TRUNCATE,
            FaultKind.DROP,
            FaultKind.DELAY,
        ),
        delay_ms=50,
    )
    with pytest.raises(AttributeError):
        spec.rate = 1.0  # type: ignore[misc]
    assert parse_fault_spec("off") is None
    assert load_config(["--fault-injection", "off"], env={}).fault_injection is None
    env = {"NOPECACHE_FAULT_INJECTION": "rate=1,kinds=drop"}
    assert load_config([], env=env).fault_injection == FaultSpec(0, 1.0, (FaultKind.DROP,))


BAD = [
    ("rate=2", "rate: must be in"),
    ("seed=x,rate=0.1", "seed: expected an integer"),
    ("rate=0.1,kinds=melt", "kinds: 'melt' is not one of"),
    ("rate=0.1,kinds=drop,drop", "kinds: listed twice"),
    ("rate=0.1,delay_ms=0", "delay_ms: must be in"),
    ("rate=0.1,delay_ms=600000", "delay_ms: must be in"),
    ("rate=0.1,colour=red", "'colour' is not one of"),
    ("seed=1", "rate: required"),
    ("rate=0.1,seed", "'seed': expected key=value"),
]


@pytest.mark.parametrize(("value", "why"), BAD)
def test_bad_values_are_errors_naming_the_option(value: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as flag:
        load_config(["--fault-injection", value], env={})
    assert str(flag.value).startswith("--fault-injection: ") and why in str(flag.value)
    with pytest.raises(ConfigError) as env:
        load_config([], env={"NOPECACHE_FAULT_INJECTION": value})
    assert str(env.value).startswith("NOPECACHE_FAULT_INJECTION: ") and why in str(env.value)
    toml = tmp_path / "server.toml"
    toml.write_text(f'fault_injection = "{value}"\n')
    with pytest.raises(ConfigError) as file:
        load_config(["--config", str(toml)], env={})
    assert str(file.value).startswith("fault_injection (in ") and why in str(file.value)


def test_a_server_started_with_a_bad_value_exits_naming_the_option(tmp_path: Path) -> None:
    proc = CacheServerProc(tmp_path, 1, extra_args=("--fault-injection", "rate=1.5"))
    with pytest.raises(ProcessExited) as exited:
        proc.start()
    assert "--fault-injection: rate: must be in [0, 1], got 1.5" in exited.value.args[0]


# -- the helper for the parity harness: a server process, its counter ------------------------------
def test_a_fault_server_process_warns_and_counts_what_it_injects(tmp_path: Path) -> None:
    server = start_fault_server("seed=1,rate=1,kinds=drop", tmp_path)
    try:
        assert server.faults_injected() == 0
        got = fetch_rounds(server.address, "grpc", 1)
        assert len(got.failed) == got.blocks == TOKENS // PREFIX_BLOCK
        assert got.stats.missed_blocks == got.blocks
        assert server.faults_injected() == got.blocks
        assert server.faults_by_label() == {("drop", "get"): got.blocks}
        assert server.url == f"nopecache://{server.address}"
        assert "FAULT INJECTION IS ON" in server.proc.log_tail(20_000)
    finally:
        server.kill()
