"""Tensor parallel: a TP=2 engine and a TP=1 engine share KV through one nopecache server.

The model is the tiny Llama of ``tests/support/tiny_llama.py`` (2 KV heads, fp32, the same
seeded weights for both engines). Both engines store KV heads in groups of one
(``kv_head_group=1``): the TP=1 engine writes two blocks per chunk (heads 0 and 1), each
TP=2 rank one (its own head), under the same keys. The server's only tier is Redis, so
the test reaches every stored block by the key it computes itself. In order:

  1. TP=2 stores prompt P; TP=1 claims its whole blocks, output equal to TP=1 no cache.
  2. TP=1 stores prompt Q; TP=2 claims its whole blocks, output equal to TP=2 no cache.
  3. TP=2 loads P too: the connector's counters, summed over its two workers, equal what
     the TP=1 engine counted loading the same blocks (tokens once, every rank's bytes).
  4. TP=1 stores prompt R, then rank 1's blocks (head 1) are deleted from Redis: TP=2's
     lookup (under head 0) claims, rank 0 loads, rank 1 fails; vLLM recomputes the
     blocks on both ranks and the output equals no cache.

"No cache" is the same engine's answer with ``skip_reading_prefix_cache=True`` (vLLM then
reads neither its own cache nor the connector's); vLLM's prefix cache is off, so every
cached token counted comes from nopecache.
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from typing import Any

import pytest

from nopecache.client import FixedChunker, ModelFingerprint, prefix_chunks
from tests.support.engine_proc import EngineFactory, EngineProc
from tests.support.redis_procs import RedisProc, free_ports
from tests.support.server_procs import CacheServerProc
from tests.support.tiny_llama import CONFIG, write_tiny_llama

# A hang guard: the first test starts both engines (a TP=2 engine is four processes that
# each import vLLM), which on a machine shared with other suites takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU block size
PROMPT_TOKENS = 300  # two whole blocks claimed (256 tokens), 44 computed
CLAIM = 256
GROUPS = 2  # KV heads, one per group
REDIS_PREFIX = b"nc:"  # the Redis tier's default key prefix


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """The tiny Llama, its weights written once for both engines."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", Path(model_dir)))


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = RedisProc(tmp_path_factory.mktemp("redis"), free_ports(1)[0])
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: RedisProc) -> Any:
    """A cache server whose only tier is Redis (the test reaches every stored block)."""
    proc = CacheServerProc(
        Path(tmp_path_factory.mktemp("server")), free_ports(1)[0], tiers=(redis.url,)
    )
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def pair(engines: EngineFactory, server: CacheServerProc, tiny_model: str) -> dict[str, Any]:
    """The TP=2 engine and the TP=1 engine, both storing heads in groups of one."""
    connector = {"url": f"nopecache://{server.address}", "kv_head_group": 1}
    common: dict[str, Any] = {"model": tiny_model, "dtype": "float32", "connector": connector}
    tp2 = engines(tensor_parallel=2, **common)
    tp1 = engines(**common)
    return {"tp2": tp2, "tp1": tp1}


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, CONFIG["vocab_size"]) for _ in range(PROMPT_TOKENS)]


@functools.cache
def _fingerprint(tiny_model: str) -> ModelFingerprint:
    """The whole model's fingerprint as the connector derives it (path, config, weights,
    RoPE: ``model_identity`` on the engines' own vLLM config)."""
    from vllm.engine.arg_utils import EngineArgs

    from nopecache.integrations.vllm.config import model_identity

    config = EngineArgs(
        model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=4096
    ).create_engine_config()
    return model_identity(config).fingerprint


def _group_keys(tiny_model: str, prompt: list[int], group: int) -> list[bytes]:
    """The Redis keys of the prompt's whole exact-prefix blocks of one head group, as
    the connector keys them (fingerprint of the served model, the group's heads)."""
    whole = _fingerprint(tiny_model)
    spans = FixedChunker(BLOCK).split(prompt)
    whole_spans = [s for s in spans if len(s) == BLOCK]
    chunks = prefix_chunks(whole.head_group(group, 1), "", prompt, whole_spans)
    return [REDIS_PREFIX + bytes(c.key) for c in chunks]


def _wait_stored(redis: RedisProc, keys: list[bytes], timeout_s: float = 120.0) -> None:
    """Wait until every key is in Redis. ``timeout_s`` only bounds a hang on a loaded
    machine; idle, a background store lands in well under a second."""
    client = redis.client()
    deadline = time.monotonic() + timeout_s
    while client.exists(*keys) != len(keys):
        if time.monotonic() > deadline:
            raise AssertionError(f"{client.exists(*keys)} of {len(keys)} blocks reached Redis")
        time.sleep(0.1)


def _counters(engine: EngineProc) -> dict[str, float]:
    return {
        k.removeprefix("vllm:nopecache_"): v
        for k, v in engine.metrics().items()
        if k.startswith("vllm:nopecache_")
    }


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _no_cache(engine: EngineProc, prompt: list[int]) -> list[int]:
    ids: list[int] = engine.generate(prompt, max_tokens=12, skip_reading_prefix_cache=True)["ids"]
    return ids


def _store(engine: EngineProc, redis: RedisProc, tiny_model: str, prompt: list[int]) -> None:
    engine.generate(prompt, max_tokens=1)
    _wait_stored(redis, [k for g in range(GROUPS) for k in _group_keys(tiny_model, prompt, g)])


def test_tp1_loads_what_tp2_stored(pair: dict[str, Any], redis: RedisProc, tiny_model: str) -> None:
    tp2, tp1 = pair["tp2"], pair["tp1"]
    prompt = _prompt(1)
    _store(tp2, redis, tiny_model, prompt)
    before = _counters(tp1)
    out = tp1.generate(prompt, max_tokens=12)
    after = _counters(tp1)
    assert out["cached"] == CLAIM
    assert _delta(after, before, "loaded_exact_tokens") == CLAIM
    assert _delta(after, before, "load_errors") == 0
    baseline = _no_cache(tp1, prompt)
    assert len(set(baseline)) > 1  # the tiny model's answers depend on the prompt
    assert out["ids"] == baseline
    pair["tp1_load_p"] = {k: _delta(after, before, k) for k in after}


def test_tp2_loads_what_tp1_stored(pair: dict[str, Any], redis: RedisProc, tiny_model: str) -> None:
    tp2, tp1 = pair["tp2"], pair["tp1"]
    prompt = _prompt(2)
    _store(tp1, redis, tiny_model, prompt)
    before = _counters(tp2)
    out = tp2.generate(prompt, max_tokens=12)
    after = _counters(tp2)
    assert out["cached"] == CLAIM
    assert _delta(after, before, "load_errors") == 0
    assert out["ids"] == _no_cache(tp2, prompt)


def test_tp2_counters_are_summed_over_its_workers(pair: dict[str, Any]) -> None:
    tp2 = pair["tp2"]
    tp1_load = pair["tp1_load_p"]  # the TP=1 engine loading prompt 1's blocks
    before = _counters(tp2)
    out = tp2.generate(_prompt(1), max_tokens=1)  # the blocks TP=2 stored itself
    after = _counters(tp2)
    assert out["cached"] == CLAIM
    # Tokens once (every rank loads the same tokens), bytes of both ranks' heads: the
    # same block bytes the TP=1 engine fetched for the same prompt.
    assert _delta(after, before, "loaded_exact_tokens") == CLAIM
    assert _delta(after, before, "loaded_bytes") == tp1_load["loaded_bytes"] > 0
    assert _delta(after, before, "lookups") == 1


def test_one_rank_failing_recomputes_on_every_rank(
    pair: dict[str, Any], redis: RedisProc, tiny_model: str
) -> None:
    tp2, tp1 = pair["tp2"], pair["tp1"]
    prompt = _prompt(3)
    _store(tp1, redis, tiny_model, prompt)
    rank1 = _group_keys(tiny_model, prompt, 1)
    assert redis.client().delete(*rank1) == len(rank1)  # head 1: rank 1's blocks only
    before = _counters(tp2)
    out = tp2.generate(prompt, max_tokens=12)
    after = _counters(tp2)
    # The lookup (head 0's keys) claimed; rank 1 failed both blocks, rank 0 none.
    assert _delta(after, before, "claimed_exact_tokens") == CLAIM
    assert _delta(after, before, "load_errors") == CLAIM // BLOCK
    assert out["ids"] == _no_cache(tp2, prompt)
