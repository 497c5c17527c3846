"""Rendezvous hashing: exact weights, agreement of owner/group/ranked, minimal movement."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client.errors import InvalidArgumentError
from nopecache.client.keys import BlockKey
from nopecache.client.sharding import Rendezvous, server_seed, weight

THREE = ["10.0.0.1:50551", "10.0.0.2:50551", "10.0.0.3:50551"]


def _keys(n: int, salt: bytes = b"") -> list[bytes]:
    # Deterministic, uniformly spread 16-byte keys (what BlockKeys are).
    return [xxhash.xxh3_128_digest(salt + i.to_bytes(4, "little")) for i in range(n)]


def test_weight_is_xxh3_seeded_by_the_server_id() -> None:
    key = bytes(range(16))
    # Pinned: other processes, machines and client languages must compute the same.
    assert server_seed("10.0.0.1:50551") == 4149478548528034246
    assert weight("10.0.0.1:50551", key) == 3170388443569949836
    assert weight("10.0.0.1:50551", key) == xxhash.xxh3_64_intdigest(
        key, xxhash.xxh3_64_intdigest(b"10.0.0.1:50551")
    )
    assert weight("10.0.0.1:50551", BlockKey(key)) == weight("10.0.0.1:50551", key)


def test_owner_is_the_heaviest_server() -> None:
    ring = Rendezvous(["a:1", "b:1", "c:1"])
    key = bytes(range(16))
    # weights a, b, c: 5777726737777365441 < 8160142756055258151 < 10632388136172098122
    assert ring.owner(key) == "c:1"
    assert ring.ranked(key) == ["c:1", "b:1", "a:1"]
    for k in _keys(50):
        weights = {s: weight(s, k) for s in ring.servers}
        assert ring.owner(k) == max(weights, key=lambda s: weights[s])
        assert ring.ranked(k) == sorted(weights, key=lambda s: -weights[s])


def test_listing_order_does_not_matter() -> None:
    a, b = Rendezvous(THREE), Rendezvous(list(reversed(THREE)))
    assert a == b
    assert hash(a) == hash(b)
    assert a.servers == tuple(sorted(THREE))
    keys = _keys(300)
    assert [a.owner(k) for k in keys] == [b.owner(k) for k in keys]
    assert a.group(keys) == b.group(keys)


def test_group_agrees_with_owner() -> None:
    ring = Rendezvous(THREE)
    keys: list[BlockKey | bytes] = [*_keys(500), BlockKey(bytes(16))]
    groups = ring.group(keys)
    assert list(groups) == sorted(groups)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(keys)))
    for server, idx in groups.items():
        assert idx == sorted(idx)
        assert all(ring.owner(keys[i]) == server for i in idx)


def test_group_edge_cases() -> None:
    ring = Rendezvous(THREE)
    assert ring.group([]) == {}
    key = _keys(1)[0]
    assert ring.group([key, key]) == {ring.owner(key): [0, 1]}
    assert Rendezvous(["only:1"]).group(_keys(3)) == {"only:1": [0, 1, 2]}
    assert Rendezvous(["only:1"]).ranked(key) == ["only:1"]


def test_balance_and_share_moved_by_adding_a_server() -> None:
    keys = _keys(4096)
    before = Rendezvous(THREE)
    after = before.with_servers([*THREE, "10.0.0.4:50551"])
    assert before.servers == tuple(sorted(THREE))  # with_servers leaves it unchanged
    counts = {s: len(i) for s, i in before.group(keys).items()}
    # 4096 fixed keys, binomial(4096, 1/3) sd = 30 keys: within 5 sd of an even share.
    assert all(abs(c - 4096 / 3) < 150 for c in counts.values()), counts
    old = [before.owner(k) for k in keys]
    new = [after.owner(k) for k in keys]
    moved = [i for i in range(len(keys)) if old[i] != new[i]]
    assert all(new[i] == "10.0.0.4:50551" for i in moved)
    # About 1/4 of the keys move to the 4th server (sd 28 keys; within 5 sd).
    assert abs(len(moved) - 4096 / 4) < 140, len(moved)


def test_bad_arguments_are_named() -> None:
    for servers in ([], ["a:1", "a:1"], ["a:1", ""], [b"a:1"]):
        with pytest.raises(InvalidArgumentError) as err:
            Rendezvous(servers)  # type: ignore[arg-type]
        assert err.value.argument == "servers"
    with pytest.raises(InvalidArgumentError) as err:
        Rendezvous("a:1")
    assert err.value.argument == "servers"
    ring = Rendezvous(THREE)
    for bad in (12, "key", bytearray(16)):
        with pytest.raises(InvalidArgumentError) as err:
            ring.owner(bad)  # type: ignore[arg-type]
        assert err.value.argument == "key"
    with pytest.raises(InvalidArgumentError):
        ring.group([b"ok", 3])  # type: ignore[list-item]


server_ids = st.lists(
    st.integers(min_value=1, max_value=65535).map(lambda p: f"node:{p}"),
    min_size=1,
    max_size=6,
    unique=True,
)
key_lists = st.lists(st.binary(min_size=1, max_size=24), min_size=1, max_size=200)


@given(servers=server_ids, extra=st.integers(1, 65535), keys=key_lists)
def test_adding_a_server_moves_keys_only_to_it(
    servers: list[str], extra: int, keys: list[bytes]
) -> None:
    added = f"added:{extra}"
    before = Rendezvous(servers)
    after = before.with_servers([*servers, added])
    for key in keys:
        assert after.owner(key) in (before.owner(key), added)
    # group() is the same assignment as owner(), and sees the same movement.
    moved_to = {
        s for s, idx in after.group(keys).items() for i in idx if before.owner(keys[i]) != s
    }
    assert moved_to <= {added}


@given(servers=server_ids.filter(lambda s: len(s) >= 2), pick=st.integers(0, 5), keys=key_lists)
def test_removing_a_server_moves_only_its_keys(
    servers: list[str], pick: int, keys: list[bytes]
) -> None:
    removed = servers[pick % len(servers)]
    before = Rendezvous(servers)
    after = before.with_servers([s for s in servers if s != removed])
    for key in keys:
        ranked = before.ranked(key)
        if ranked[0] == removed:
            assert after.owner(key) == ranked[1]  # the runner-up inherits it
        else:
            assert after.owner(key) == ranked[0]
        assert after.ranked(key) == [s for s in ranked if s != removed]
