"""Several replicas over one Redis Cluster, as deployed by deploy/k8s/overlays/cluster, on
loopback: 3 cache servers (CPU tier + ``redis+cluster://`` tier, write-through), a 3-master
Redis Cluster, and 2 engine processes whose clients discover the replicas by name.

The name's "DNS" is a file per engine that the test rewrites, as Kubernetes rewrites the
headless Service's records when a pod stops being ready (see HostsFileResolver). Checked,
in one run so that processes start once:

1. blocks stored through one replica are found (bit-exact) through another, via Redis;
2. with all three replicas discovered, the engines shard alike and find each other's blocks;
3. a replica killed with SIGKILL loses only its local tier: its keys become misses, the
   failure makes the clients resolve again, and once they re-shard every key is found
   again - through Redis for the dead replica's keys, locally for the others;
4. a Redis master killed during the run turns the blocks only it held into misses, never
   into errors: clients keep getting results, servers stay up, new blocks still work.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import redis.crc
import torch

from nopecache.client import CacheClient, ModelFingerprint
from nopecache.client.sharding import Rendezvous
from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rotate_reference
from nopecache.proto import cache_pb2, cache_pb2_grpc
from nopecache.proto.block import StoredForm
from tests.support.redis_procs import RedisClusterProcs
from tests.support.server_procs import ServerFactory

LAYERS, HEADS, DIM = 2, 2, 8
SPEC = RopeSpec.default(DIM)
NAME = "nopecache-headless.test"
URL = (
    f"nopecache://{NAME}:50551?namespace=replicas&discover=dns&dns_refresh=0"
    "&dns_min_interval=100ms&cost_enabled=false&lookup_timeout=10s&get_timeout=10s"
    "&put_timeout=10s&connect_timeout=5s&down_backoff=500ms"
    "&prefix_block_tokens=16&chunk_min_tokens=4&chunk_avg_tokens=16&chunk_max_tokens=32"
)
REDIS_PREFIX = b"nc:"  # the redis tier's default key prefix
_REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HostsFileResolver:
    """Stand-in for the headless Service's DNS: the name's addresses are the words of a file
    (``host:port`` each, like SRV answers) that the test replaces atomically."""

    path: str

    async def resolve(self, host: str, port: int) -> tuple[str, ...]:
        """The addresses listed in the file now."""
        text = await asyncio.to_thread(Path(self.path).read_text)
        return tuple(text.split())


def _publish(path: Path, addresses: Sequence[str]) -> None:
    """What "DNS" answers from now on (written whole, then renamed: never half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(addresses))
    os.replace(tmp, path)


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


def _doc(doc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Document ``doc``: 320 token ids, their NOPE K and V (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + doc)
    tokens = torch.randint(0, 5000, (320,), generator=g)
    shape = (LAYERS, 320, HEADS, DIM)
    return tokens, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- the engine processes ----------------------------------------------------------------
def _command(client: CacheClient, command: str, doc: int) -> tuple[Any, ...]:
    tokens, k, v = _doc(doc)
    if command == "store":
        keys = [c.key.value for c in client.core.prepare_store(tokens, (k, v), prefix=False).pi]
        report = client.store(tokens, (k, v), prefix=False)
        return report.stored, report.already_present, report.failed, keys
    if command == "lookup":
        # The servers the lookup is sharded over, read before it: a lookup that finds a
        # server dead wakes the background re-resolution, which may have applied the new
        # list by the time the lookup returns (or not): reading after it raced.
        servers = client.servers
        plan = client.lookup(tokens)
        return {h.key.value for h in plan.hits}, servers
    if command == "fetch":
        plan = client.lookup(tokens)
        result = client.fetch(plan, tokens)
        assert result.k is not None and result.v is not None
        found = {h.key.value for h in result.placed}
        return found, len(result.failed), result.k.numpy(), result.v.numpy(), client.servers
    if command == "refresh":
        return (client.refresh_servers(),)
    if command == "servers":
        return (client.servers,)
    raise AssertionError(f"unknown command {command!r}")


def _engine(hosts: str, commands: Any, replies: Any) -> None:
    """Child process: one engine's client, running the parent's commands until "stop"."""
    try:
        client = CacheClient(
            URL,
            fingerprint=_fingerprint(),
            rope=SPEC,
            v_head_dim=DIM,
            resolver=HostsFileResolver(hosts),
        )
    except BaseException:
        replies.put(("error", traceback.format_exc()))
        return
    with client:
        replies.put(("ready",))
        while True:
            command, doc = commands.get()
            if command == "stop":
                break
            try:
                replies.put(("ok", *_command(client, command, doc)))
            except BaseException:
                replies.put(("error", traceback.format_exc()))
    replies.put(("stopped",))


class Engine:
    """The parent's handle on one engine process."""

    def __init__(self, ctx: Any, hosts: Path) -> None:
        self.hosts = hosts
        self.commands = ctx.Queue()
        self.replies = ctx.Queue()
        self.proc = ctx.Process(target=_engine, args=(str(hosts), self.commands, self.replies))

    def reply(self) -> tuple[Any, ...]:
        """The next reply; an exception in the engine fails the test with its traceback."""
        try:
            reply: tuple[Any, ...] = self.replies.get(timeout=_REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"engine silent (exit code {self.proc.exitcode})") from None
        assert reply[0] != "error", f"engine raised:\n{reply[1]}"
        return reply[1:]

    def ask(self, command: str, doc: int = 0) -> tuple[Any, ...]:
        """Run one command in the engine; its result."""
        self.commands.put((command, doc))
        return self.reply()

    def wait_servers(self, servers: Sequence[str], timeout_s: float = 60.0) -> None:
        """Wait until the engine's client shards over ``servers`` (asked every 50 ms; the
        timeout is only a hang guard for a loaded machine: DNS refreshes every 100 ms)."""
        want = tuple(sorted(servers))
        deadline = time.monotonic() + timeout_s
        while (now := self.ask("servers")[0]) != want:
            assert time.monotonic() < deadline, f"engine still shards over {now}, not {want}"
            time.sleep(0.05)


# -- what the servers hold ---------------------------------------------------------------
def _tiers(address: str, keys: Sequence[bytes]) -> list[str | None]:
    """The tier each key is in on one server (its Lookup answer), None for a miss."""
    with grpc.insecure_channel(address) as channel:
        reply = cache_pb2_grpc.KVCacheStub(channel).Lookup(
            cache_pb2.LookupRequest(keys=b"".join(keys)), timeout=10
        )
    names = list(reply.tier_names)
    return [names[code - 1] if code else None for code in reply.tiers]


def _tiers_by_owner(ring: Rendezvous, keys: Sequence[bytes]) -> dict[bytes, str | None]:
    """Each key's tier on the server that owns it in ``ring``."""
    out: dict[bytes, str | None] = {}
    for server, idx in ring.group(keys).items():
        group = [keys[i] for i in idx]
        out.update(zip(group, _tiers(server, group), strict=True))
    return out


def _master_of_slot(cluster: RedisClusterProcs) -> dict[int, int]:
    """Slot -> index of the cluster node that serves it."""
    by_port = {node.port: i for i, node in enumerate(cluster.nodes)}
    with cluster.nodes[0].client() as client:
        ranges = client.execute_command("CLUSTER SLOTS")
    out: dict[int, int] = {}
    for entry in ranges:
        # redis-py parses CLUSTER SLOTS into {(start, end): {"primary": (host, port), ...}}
        # or leaves the raw [start, end, [host, port, id], ...] list, depending on version.
        if isinstance(ranges, dict):
            (start, end), nodes = entry, ranges[entry]
            port = int(nodes["primary"][1])
        else:
            start, end, primary = entry[0], entry[1], entry[2]
            port = int(primary[1])
        for slot in range(int(start), int(end) + 1):
            out[slot] = by_port[port]
    return out


def _expected_kv(doc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K rotated to positions 0.. (what a fetch at the same offset places) and V."""
    _, k, v = _doc(doc)
    return torch.stack([rotate_reference(k[i], None, 0, SPEC) for i in range(LAYERS)]), v


def test_replicas_over_a_redis_cluster(
    cache_servers: ServerFactory, redis_cluster_disposable: RedisClusterProcs, tmp_path: Path
) -> None:
    cluster = redis_cluster_disposable
    procs = cache_servers(3, redis_url=cluster.url)
    r0, r1, r2 = (p.address for p in procs)
    hosts_a, hosts_b = tmp_path / "a.hosts", tmp_path / "b.hosts"
    _publish(hosts_a, [r0])
    _publish(hosts_b, [r1])
    ctx = multiprocessing.get_context("spawn")
    a, b = Engine(ctx, hosts_a), Engine(ctx, hosts_b)
    for engine in (a, b):
        engine.proc.start()
    try:
        for engine in (a, b):
            assert engine.reply() == ()

        # 1. Stored through r0 only, found through r1 only: r1 reads Redis.
        stored, present, failed, keys1 = a.ask("store", 1)
        assert (stored, present, failed) == (len(keys1), 0, 0) and len(keys1) >= 10
        found, n_failed, k_np, v_np, servers = b.ask("fetch", 1)
        assert servers == (r1,)
        assert (found, n_failed) == (set(keys1), 0)
        k_want, v_want = _expected_kv(1)
        assert torch.equal(torch.from_numpy(k_np), k_want)
        assert torch.equal(torch.from_numpy(v_np), v_want)

        # 2. Both engines discover all three replicas and shard alike.
        everyone = tuple(sorted((r0, r1, r2)))
        _publish(hosts_a, everyone)
        _publish(hosts_b, everyone)
        assert a.ask("refresh") == (everyone,) and b.ask("refresh") == (everyone,)
        stored, present, failed, keys2 = a.ask("store", 2)
        assert (stored, present, failed) == (len(keys2), 0, 0)
        assert b.ask("lookup", 2) == (set(keys2), everyone)
        ring3 = Rendezvous(everyone)
        assert set(_tiers_by_owner(ring3, keys2).values()) == {"cpu"}
        lost = {k for k in keys2 if ring3.owner(k) == r0}  # only r0's memory had these
        assert 0 < len(lost) < len(keys2)

        # 3. SIGKILL r0; "DNS" stops listing it. The first lookups miss r0's keys (no
        # error) and make the clients resolve again; then every key is found again.
        procs[0].kill()
        survivors = tuple(sorted((r1, r2)))
        _publish(hosts_a, survivors)
        _publish(hosts_b, survivors)
        for engine in (a, b):
            assert engine.ask("lookup", 2) == (set(keys2) - lost, everyone)
        for engine in (a, b):
            engine.wait_servers(survivors)
        assert b.ask("lookup", 2) == (set(keys2), survivors)
        ring2 = Rendezvous(survivors)
        tiers = _tiers_by_owner(ring2, keys2)
        assert {k for k, t in tiers.items() if t == "redis"} == lost
        assert {k for k, t in tiers.items() if t == "cpu"} == set(keys2) - lost

        # 4. SIGKILL the Redis master holding most of the blocks now only in Redis.
        slots = _master_of_slot(cluster)
        master_of = {k: slots[redis.crc.key_slot(REDIS_PREFIX + k)] for k in lost}
        victim = max(range(len(cluster.nodes)), key=list(master_of.values()).count)
        gone = {k for k in lost if master_of[k] == victim}
        assert gone
        cluster.nodes[victim].kill()
        found, servers = b.ask("lookup", 2)
        assert servers == survivors
        assert set(keys2) - lost <= found <= set(keys2) - gone  # local hits stay, gone miss
        tiers = _tiers_by_owner(ring2, keys2)
        assert {k for k in keys2 if tiers[k] == "cpu"} == set(keys2) - lost
        assert all(tiers[k] is None for k in gone)
        # New blocks are stored (the local tier takes them) and found by the other engine.
        stored, present, failed, keys3 = a.ask("store", 3)
        assert (stored, present, failed) == (len(keys3), 0, 0)
        found, n_failed, k_np, v_np, _ = b.ask("fetch", 3)
        assert (found, n_failed) == (set(keys3), 0)
        k_want, v_want = _expected_kv(3)
        assert torch.equal(torch.from_numpy(k_np), k_want)
        assert torch.equal(torch.from_numpy(v_np), v_want)
        assert procs[1].running() and procs[2].running()

        for engine in (a, b):
            engine.commands.put(("stop", 0))
            assert engine.reply() == ()
            engine.proc.join(timeout=_REPLY_TIMEOUT_S)
            assert engine.proc.exitcode == 0
    finally:
        for engine in (a, b):
            if engine.proc.is_alive():
                engine.proc.kill()
