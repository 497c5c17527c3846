"""Two real vLLM engines share KV through a real nopecache server (over a real Redis).

One scenario, in order (the tests share engines because each start costs ~30 s):

fp32 (every output must equal vLLM's plain no-cache output token for token):
  1. engine A32 starts while the server is down: its requests run uncached; their outputs
     are the baselines. The server starts; A32 answers the system prompt + question 1
     and stores it.
  2. a fresh engine B32 answers the system prompt + question 2: the connector claims the
     system prompt's whole blocks, each placed through the fused kernel API (its calls
     logged in B32's worker by tests/support/kernel_probe) as a copy at its own
     positions, output identical to the baseline.
  3. every stored value is corrupted in Redis: B32's next claim fails verification, the
     blocks are reported as load errors, vLLM recomputes, output identical.
  4. the server hangs, then dies: requests complete uncached, outputs identical.
bf16:
  5. the server restarts empty; A32 stores fp32 blocks again; a fresh bf16 engine B16
     claims nothing from them (fp32 and bf16 never share blocks).
  6. engine A16 stores the bf16 blocks; B16 claims the system prompt; its output equals
     vLLM's own prefix cache serving the same split (engine APC16, warmed the same way).
     Both run ``layerwise``: A16 copies its saves out layer by layer in the forward, B16
     writes its loads in layer by layer as its forward reaches each layer.
  7. A16 runs with ``pi_reuse="contiguous"``: a truncated chat history (old turns
     dropped) claims the moved history past the exact prefix.
compact forms (``kv_codec=fp8``):
  8. F1 stores fp8 blocks; F2 loads them into its bf16 cache, salts its block hashes and
     stores nothing; its answer is recorded beside the uncached one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_prompts import BLOCK, IM_START, PIP_FACTS
from tests.support.engine_proc import EngineFactory, common_prefix
from tests.support.kernel_probe import KernelProbe
from tests.support.redis_procs import RedisProc, free_ports
from tests.support.server_procs import CacheServerProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

SYSTEM = PIP_FACTS * 3
QUESTIONS = [
    "How much is a day pass?",
    "Can I take my bike at 8 am?",
    "When does the night train leave?",
    "How long is lost property kept?",
    "What refund do I get for a 90 minute delay?",
]


def _chat(engine: Any, question: str, system: str = SYSTEM) -> list[int]:
    return list(
        engine.chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
    )


def _expected_claim(stored: list[int], prompt: list[int]) -> int:
    common = common_prefix(stored, prompt)
    limit = min(common, len(stored) // BLOCK * BLOCK, (len(prompt) - 1) // BLOCK * BLOCK)
    return limit - limit % BLOCK


def _wait_stored(
    redis: RedisProc, at_least: int, timeout_s: float = 120.0, *, fail: bool = True
) -> int:
    """Wait until the background store has landed (the key count stops growing).

    ``timeout_s`` only bounds a hang on a loaded machine; idle, a store lands in well
    under a second. Past it: an AssertionError, or with ``fail=False`` the count."""
    client = redis.client()
    deadline = time.monotonic() + timeout_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = int(client.dbsize())
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - stable_since > 1.0:
            return n
        time.sleep(0.1)
    if not fail:
        return last
    raise AssertionError(f"only {last} blocks reached Redis")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = RedisProc(tmp_path_factory.mktemp("redis"), free_ports(1)[0])
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: RedisProc) -> Any:
    """A cache server whose only tier is Redis (so the test can reach every stored byte)."""
    proc = CacheServerProc(
        Path(tmp_path_factory.mktemp("server")), free_ports(1)[0], tiers=(redis.url,)
    )
    yield proc  # not started: the first test starts it
    proc.kill()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> KernelProbe:
    """Logs the placement kernel's calls in the engines started with its env."""
    return KernelProbe(tmp_path_factory.mktemp("probe") / "kernel.log")


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What the ordered tests hand each other (engines, prompts, baselines)."""
    return {}


def _connector(server: CacheServerProc, **extra: Any) -> dict[str, Any]:
    return {"url": f"nopecache://{server.address}?lookup_timeout=500ms", **extra}


def _metric(engine: Any, name: str) -> float:
    return engine.metrics().get(f"vllm:nopecache_{name}", 0.0)


def test_fp32_server_down_then_shared(
    engines: EngineFactory,
    server: CacheServerProc,
    redis: RedisProc,
    probe: KernelProbe,
    state: dict[str, Any],
) -> None:
    a32 = engines(dtype="float32", connector=_connector(server))
    prompts = [_chat(a32, q) for q in QUESTIONS]
    baseline = []
    for p in prompts:  # server down at start: every request completes uncached
        out = a32.generate(p, max_tokens=12)
        assert out["cached"] == 0
        baseline.append(out["ids"])
    assert all(baseline), "the baseline answers are empty"
    assert _metric(a32, "loaded_exact_tokens") == 0

    server.start()
    # The first request after the start may still find the server down to A32's client
    # (gRPC's reconnect back-off, or a first call slower than lookup_timeout=500ms on a
    # loaded machine: CI once stored nothing here); a down server's keys are misses and its
    # stores are dropped, by design. So ask again until one store lands, each answer the
    # baseline's; 60 s per try only bounds a store that is slow, never a correct result.
    need = len(prompts[0]) // BLOCK
    for _ in range(4):
        assert a32.generate(prompts[0], max_tokens=12)["ids"] == baseline[0]
        if _wait_stored(redis, need, timeout_s=60.0, fail=False) >= need:
            break
    else:
        raise AssertionError(f"no store of {need} blocks reached Redis in 4 tries")

    b32 = engines(dtype="float32", connector=_connector(server), env=probe.env())
    out = b32.generate(prompts[1], max_tokens=12)
    claim = _expected_claim(prompts[0], prompts[1])
    assert claim >= 3 * BLOCK
    assert out["cached"] == claim
    # Every claimed token landed through the kernel API, one call per block, as a copy of
    # post-RoPE K at its own positions (bit exact): no other placement path ran.
    assert probe.take() == {"same": claim, "calls": claim // BLOCK}
    assert _metric(b32, "loaded_exact_tokens") == claim
    assert _metric(b32, "claimed_exact_tokens") == claim
    # B32 held no other request: the claim loaded before the step's forward.
    assert _metric(b32, "idle_sync_claims") == 1
    assert out["ids"] == baseline[1]
    state.update(a32=a32, b32=b32, prompts=prompts, baseline=baseline, claim=claim)


def test_corrupted_blocks_are_recomputed(redis: RedisProc, state: dict[str, Any]) -> None:
    b32, prompts, baseline = state["b32"], state["prompts"], state["baseline"]
    client = redis.client()
    keys = sorted(client.keys("*"))
    values = [client.get(k) for k in keys]
    assert len(keys) >= 2
    for key, value in zip(keys, values[1:] + values[:1], strict=True):
        assert value is not None
        client.set(key, value)  # every key now holds another block: valid lz4, wrong KV
    errors_before = _metric(b32, "load_errors")
    out = b32.generate(prompts[2], max_tokens=12)
    assert _metric(b32, "load_errors") > errors_before
    assert out["ids"] == baseline[2]


def test_hung_then_dead_server_runs_uncached(
    server: CacheServerProc, state: dict[str, Any]
) -> None:
    b32, prompts, baseline = state["b32"], state["prompts"], state["baseline"]
    server.pause()
    try:
        out = b32.generate(prompts[3], max_tokens=12)
    finally:
        server.kill()
    assert out["ids"] == baseline[3]
    out = b32.generate(prompts[4], max_tokens=12)
    assert out["cached"] == 0
    assert out["ids"] == baseline[4]
    b32.stop()  # each engine holds ~2 GiB: keep at most three alive


def test_bf16_never_reads_fp32_blocks(
    engines: EngineFactory, server: CacheServerProc, redis: RedisProc, state: dict[str, Any]
) -> None:
    redis.client().flushall()
    server.start()
    a32, prompts = state["a32"], state["prompts"]
    a32.generate(prompts[0], max_tokens=4)
    _wait_stored(redis, len(prompts[0]) // BLOCK)
    # B16 only reads (save off), so what it claims later can only come from A16; it
    # loads in the step's forward (load_async off), layer by layer (layerwise); the
    # other engines here load before the forward too, each holding one request at a
    # time (sync_when_idle), but whole.
    b16 = engines(
        dtype="bfloat16",
        connector=_connector(server, save=False, load_async=False, layerwise=True),
    )
    out = b16.generate(prompts[1], max_tokens=12)
    assert out["cached"] == 0
    assert _metric(b16, "loaded_exact_tokens") == 0
    a32.stop()
    state.update(b16=b16)


def test_bf16_matches_vllm_prefix_cache_split(
    engines: EngineFactory, server: CacheServerProc, redis: RedisProc, state: dict[str, Any]
) -> None:
    prompts, b16 = state["prompts"], state["b16"]
    # A16 copies what it saves out of vLLM's pages layer by layer, as the forward
    # computes each layer (layerwise); B16 writes its loads in layer by layer.
    a16 = engines(
        dtype="bfloat16",
        connector=_connector(
            server, pi_reuse="contiguous", segment_token_ids=[IM_START], layerwise=True
        ),
    )
    before = int(redis.client().dbsize())
    a16.generate(prompts[0], max_tokens=12)
    _wait_stored(redis, before + 1)
    saved = _metric(a16, "saved_tokens")
    assert saved == len(prompts[0]) and _metric(a16, "layer_saved_tokens") == saved
    out = b16.generate(prompts[1], max_tokens=12)
    assert out["cached"] == state["claim"]
    assert _metric(b16, "layer_loaded_tokens") == out["cached"]  # every one layer by layer

    apc = engines(dtype="bfloat16", prefix_caching=True)
    apc.generate(prompts[0], max_tokens=12)  # warms vLLM's own cache with the same prefix
    ref = apc.generate(prompts[1], max_tokens=12)
    assert ref["cached"] == out["cached"]
    assert out["ids"] == ref["ids"]
    state.update(a16=a16)


def test_contiguous_mode_claims_truncated_history(redis: RedisProc, state: dict[str, Any]) -> None:
    a16 = state["a16"]
    turns = [
        ("Where does the night train go?", "It goes to Tromso, leaving at 22:40."),
        ("Which platform?", "Platform 3 at the central station."),
        ("Is there a quiet carriage?", "Yes, coach C is always the quiet carriage."),
        ("Can I bring my dog?", "Yes, dogs travel for half the child fare."),
        ("And my bike in the evening?", "Bikes are free outside 4 to 6 pm and 7 to 9 am."),
        ("How long is lost property kept?", "For 30 days at the central station office."),
    ] * 2
    system = {"role": "system", "content": "You are Pip, the assistant of Northern Lines."}

    def chat(pairs: list[tuple[str, str]], question: str) -> list[int]:
        messages = [system]
        for user, assistant in pairs:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        return list(a16.chat([*messages, {"role": "user", "content": question}]))

    full = chat(turns, "When do reservations close?")
    before = int(redis.client().dbsize())
    a16.generate(full, max_tokens=4)
    _wait_stored(redis, before + 1)
    pi_before = _metric(a16, "loaded_pi_tokens")
    truncated = chat(turns[4:], "When do reservations close?")  # the oldest turns dropped
    out = a16.generate(truncated, max_tokens=12)
    exact = _expected_claim(full, truncated)
    assert out["cached"] > exact, "nothing claimed past the exact prefix"
    assert _metric(a16, "loaded_pi_tokens") - pi_before == out["cached"] - exact
    assert out["ids"], "no answer"


def test_compact_forms_run_end_to_end_through_a_real_vllm_engine(
    engines: EngineFactory, server: CacheServerProc, redis: RedisProc, state: dict[str, Any]
) -> None:
    """``kv_codec=fp8``: F1 stores fp8 blocks, F2 (vLLM's prefix cache on) loads them into
    its bf16 cache. Compact KV is approximate: F2's block hashes are salted from the first
    claimed block, so its own prefix cache never serves that KV (the same prompt again is
    claimed from the server again), and F2 stores nothing. Runs alone too (-k compact)."""
    for name in ("a16", "b16"):  # each engine holds ~2 GiB: make room
        if name in state:
            state.pop(name).stop()
    if not server.running():
        server.start()
    redis.client().flushall()
    fp8 = {"url": f"nopecache://{server.address}?lookup_timeout=500ms&kv_codec=fp8"}
    f1 = engines(dtype="bfloat16", connector=fp8)
    prompt = _chat(f1, QUESTIONS[1])
    baseline = f1.generate(prompt, max_tokens=12)  # nothing stored yet: uncached
    assert baseline["cached"] == 0 and baseline["ids"]
    _wait_stored(redis, len(prompt) // BLOCK)
    assert _metric(f1, "saved_tokens") == len(prompt)
    stored = int(redis.client().dbsize())

    # F2 loads in the background even when idle (sync_when_idle off): its requests wait in
    # WAITING_FOR_REMOTE_KVS until the worker reports the load, vLLM's async-receive
    # path, which the other engines here, one request at a time, no longer take.
    f2 = engines(dtype="bfloat16", connector={**fp8, "sync_when_idle": False}, prefix_caching=True)
    out = f2.generate(prompt, max_tokens=12)
    claim = (len(prompt) - 1) // BLOCK * BLOCK
    assert claim >= 3 * BLOCK
    assert out["cached"] == claim
    assert _metric(f2, "loaded_exact_tokens") == claim
    assert _metric(f2, "load_errors") == 0
    assert _metric(f2, "idle_sync_claims") == 0
    again = f2.generate(prompt, max_tokens=12)
    # Salted: vLLM's prefix cache did not serve the compact blocks to the second request;
    # the connector claimed them from the server again.
    assert _metric(f2, "claimed_exact_tokens") == 2 * claim
    assert again["cached"] == claim
    assert _metric(f2, "saved_tokens") == 0  # approximate from its first block: no store
    assert int(redis.client().dbsize()) == stored
    # Output recorded: fp8 KV is approximate, so equality with the uncached answer is
    # measured (bench/capacity.py), not asserted; the answer must exist.
    same = common_prefix(list(out["ids"]), list(baseline["ids"]))
    print(f"fp8 claim {claim} tokens: {same}/{len(baseline['ids'])} answer tokens as uncached")
    print(f"uncached: {baseline['ids']}\nfp8 KV:   {out['ids']}")
    assert out["ids"] and again["ids"] == out["ids"]
