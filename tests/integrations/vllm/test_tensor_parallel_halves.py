"""Tensor parallel without vLLM: a TP=2 engine's two worker halves and a TP=1 engine's
one share KV through a real server, bit for bit, in both directions.

Each "engine" is the connector's scheduler half plus one worker half per rank over CPU
paged caches (FlashAttention's layout) of random contents; rank ``r`` of TP=2 holds KV
head ``r``. Heads are stored in groups of one (``kv_head_group=1``), so every engine
stores and fetches the same two blocks per chunk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nopecache.client import CacheClient, ModelFingerprint
from nopecache.integrations.vllm.config import ConnectorConfig, ModelIdentity
from nopecache.integrations.vllm.errors import ConnectorConfigError
from nopecache.integrations.vllm.metadata import StepReport
from nopecache.integrations.vllm.scheduler import SchedulerSide
from nopecache.integrations.vllm.worker import WorkerSide
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, DIM, HEADS, LAYERS, NB, _identity, _request, run_loads


class _TPEngine:
    """A scheduler half and ``tp`` worker halves, each rank with its own caches."""

    def __init__(self, server: CacheServerProc, seed: int, tp: int, group: int = 1) -> None:
        self.model = dataclasses.replace(_identity(), tp_size=tp, kv_head_group=group)
        self.config = ConnectorConfig.from_extra_config(
            {"url": f"nopecache://{server.address}?lookup_timeout=300ms", "kv_head_group": group}
        )
        self.clients: list[CacheClient] = []
        self.scheduler = SchedulerSide(
            self.config, self.model, self._client(self.model.lookup_fingerprint), None
        )
        gen = torch.Generator().manual_seed(seed)
        self.workers: list[WorkerSide] = []
        self.caches: list[list[torch.Tensor]] = []
        for rank in range(tp):
            pairs = [(g, self._client(g.fingerprint)) for g in self.model.head_groups(rank)]
            worker = WorkerSide(self.config, self.model, pairs[0][1], pairs, rank)
            shape = (2, NB, BS, HEADS // tp, DIM)
            caches = [torch.randn(*shape, generator=gen) for _ in range(LAYERS)]
            worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
            self.workers.append(worker)
            self.caches.append(caches)

    def _client(self, fingerprint: ModelFingerprint) -> CacheClient:
        m = self.model
        client = CacheClient(
            self.config.client,
            fingerprint=fingerprint,
            rope=m.rope,
            v_head_dim=DIM,
            prefix_block_tokens=BS,
        )
        self.clients.append(client)
        return client

    def heads(self, layer: int, kv: int) -> torch.Tensor:
        """Layer ``layer``'s K (kv=0) or V (kv=1) over every rank's heads, as one tensor
        ``[blocks, block_size, heads, dim]``."""
        return torch.cat([caches[layer][kv] for caches in self.caches], dim=2)

    def step(self, request: Any, block_ids: list[int]) -> tuple[int, list[Any]]:
        """Schedule the whole prompt in one step; every rank loads and saves."""
        deadline = time.monotonic() + 60  # a hang guard; loopback lookups take ms
        while (claimed := self.scheduler.matched_tokens(request, 0)) is None:
            assert time.monotonic() < deadline, "the lookup never finished"
            time.sleep(0.001)
        self.scheduler.after_alloc(request, block_ids, claimed)
        n = len(request.prompt_token_ids)
        output = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id=request.request_id, block_ids=(block_ids,), num_computed_tokens=claimed
                )
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={request.request_id: n - claimed},
            total_num_scheduled_tokens=n - claimed,
        )
        plan = self.scheduler.build_step(output)
        reports = []
        for worker in self.workers:
            worker.begin_step()
            run_loads(worker, plan)
            worker.save(plan)
            reports.append(worker.take_report())
        for client in self.clients:
            client.drain()
        return claimed, reports

    def errors(self) -> list[set[int]]:
        return [w.take_errors() for w in self.workers]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        for client in self.clients:
            client.close()


@pytest.fixture
def engines(cache_server: CacheServerProc) -> Iterator[tuple[_TPEngine, _TPEngine]]:
    tp2, tp1 = _TPEngine(cache_server, 1, tp=2), _TPEngine(cache_server, 2, tp=1)
    yield tp2, tp1
    tp2.close()
    tp1.close()


TOKENS = list(range(100, 100 + 3 * BS + 2))  # 3 whole blocks and 2 tokens
CLAIM = 3 * BS


@pytest.mark.parametrize("direction", ["tp2_to_tp1", "tp1_to_tp2"])
def test_engines_of_both_tp_sizes_share_blocks_bit_exact(
    engines: tuple[_TPEngine, _TPEngine], direction: str
) -> None:
    tp2, tp1 = engines
    src, dst = (tp2, tp1) if direction == "tp2_to_tp1" else (tp1, tp2)
    src_blocks, dst_blocks = [0, 1, 2, 3], [7, 5, 9, 11]
    assert src.step(_request("a", TOKENS), src_blocks)[0] == 0
    claimed, reports = dst.step(_request("b", TOKENS), dst_blocks)
    assert claimed == CLAIM
    assert dst.errors() == [set()] * len(dst.workers)
    for layer in range(LAYERS):
        for kv in (0, 1):
            got = dst.heads(layer, kv)[dst_blocks[:3]]
            assert torch.equal(got, src.heads(layer, kv)[src_blocks[:3]])
    # Tokens once (rank 0), bytes from every rank: both ranks fetched one head each.
    assert [r.loaded_exact_tokens for r in reports] == [CLAIM] + [0] * (len(reports) - 1)
    assert all(r.loaded_bytes > 0 for r in reports)


def test_a_group_that_does_not_divide_a_rank_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match=r"kv_head_group.*does not divide a rank's 1"):
        dataclasses.replace(_identity(), tp_size=2, kv_head_group=2)


def test_tp1_without_groups_keeps_the_whole_head_keys() -> None:
    model: ModelIdentity = _identity()
    assert model.lookup_fingerprint == model.fingerprint
    assert [g.num_heads for g in model.head_groups(0)] == [HEADS]


@pytest.mark.parametrize("value", [0, -1, True, "2", 1.5])
def test_a_bad_kv_head_group_stops_start_up_naming_the_key(value: object) -> None:
    with pytest.raises(ConnectorConfigError, match=r"\['kv_head_group'\]: must be a number"):
        ConnectorConfig.from_extra_config(
            {"url": "nopecache://127.0.0.1:1", "kv_head_group": value}
        )


def test_ranks_of_one_step_fetch_side_by_side() -> None:
    rank0 = StepReport(fetched_bytes=100, fetch_seconds=1.0, forward_seconds=3.0)
    rank1 = StepReport(fetched_bytes=100, fetch_seconds=2.0, forward_seconds=2.0)
    step = rank0.add(rank1, same_step=True)
    assert (step.fetched_bytes, step.fetch_seconds, step.forward_seconds) == (200, 2.0, 3.0)
    later = rank0.add(rank1)  # successive steps: times add up
    assert (later.fetch_seconds, later.forward_seconds) == (3.0, 5.0)
