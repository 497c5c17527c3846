"""Serving agent traffic through ``vllm serve``: two engines sharing one cache, four setups.

Run in the vLLM environment: ``.venv-vllm/bin/python bench/vllm_serve.py`` (``make bench``
does). Two real OpenAI-compatible vLLM servers (CPU build, SmolLM2-135M, bf16, eager,
vLLM's prefix cache on, one OpenMP thread each, each bound to its own core: round robin
over the allowed cores, printed) answer a replay of agent traffic over HTTP
(``bench/_serve_trace.py``: a chat that grows and is truncated, a corpus chat under a token
budget, agents sharing an instruction block behind different preambles, RAG documents
retrieved in new orders, a tool result pasted again later). ``--in-flight`` sessions run at
once, each sending its requests one after another (streamed completions over the trace's
token ids, greedy); request ``i`` goes to engine ``i % 2``, so consecutive turns of a chat
land on different engines and any sharing between them has to come through a shared cache.

The same trace and load run once per configuration, one configuration after another (two
engines at a time: the memory of five does not exist here), each with fresh servers:

    nocache   no connector: vLLM's own prefix cache only
    prefix    nopecache's connector, ``pi_reuse="off"`` (exact prefixes, lossless), one
              nopecache server (CPU tier) for both engines
    blend     nopecache's connector, ``pi_reuse="blend"`` (reuse at any position, first_k
              recompute of 15%), its own fresh nopecache server
    lmcache   LMCache 0.5.6's multiprocess connector (``lmcache server`` + ``LMCacheMPConnector``,
              as ``bench/vllm_e2e.py --peer lmcache``) from ``--lmcache-overlay`` (default
              ``.lmcache-overlay``; see vllm_e2e's docstring to build it). Without it the
              bench says the configuration is skipped and ``serve_rps_vs_lmcache=skipped``;
              ``--quick`` runs only ``nocache`` and ``blend`` (what its RESULT line needs)
              unless ``--configs`` names others: LMCache never in ``make test``.

Per configuration: completed requests per second and prompt tokens per second over the
replay's wall time, client-side TTFT p50 and p99, tokens served from cache over prompt tokens
(from each server's ``/metrics``, deltas over the replay: vLLM's ``prefix_cache_hits`` plus,
for nopecache, the tokens its connector loaded, ``vllm:nopecache_loaded_exact_tokens`` +
``loaded_pi_tokens``, and for LMCache ``external_prefix_cache_hits``), and the trace's content
bound (tokens that appeared in an earlier request at any position, computed from the trace).
Answers to the requests that ask for a fact are checked for it, as bench/vllm_blend.py does.

Last line: ``RESULT serve_rps_vs_nocache=... serve_rps_vs_lmcache=... ttft_p50_vs_nocache=...
ttft_p99_vs_nocache=... hit_vs_bound=... blend_fact_kept=... failed_requests=...
blend_load_mb_s=... prefix_load_mb_s=...``, ratios of blend mode: requests/s over no
cache's (target >= 2.0) and over LMCache's (>= 1.3), TTFT p50 and p99 over no cache's
(below 1: faster), blend's cache share over the content bound (>= 0.85), of the fact
requests whose no-cache answer holds the fact the share whose blend answer does, and the
requests that failed in all configurations (target 0); then the connector's load data
path in blend and in prefix mode: 10^6 block bytes fetched per second of fetching and
placing them into vLLM's pages (``vllm:nopecache_fetched_bytes`` over
``vllm:nopecache_fetch_seconds``, both engines; blend's layer loop excluded, so the two
compare: issue 33's target is blend within 1.5x of prefix; ``skipped`` when the
configuration did not run, ``nan`` when it loaded nothing). bench/pi_placement.py
measures the same without an engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from _demo_scenario import chat_prompt  # noqa: E402
from _serve_client import Outcome, Planned, replay  # noqa: E402
from _serve_procs import SERVED_NAME, ServeProc, start_lmcache_server  # noqa: E402
from _serve_trace import (  # noqa: E402
    QUICK,
    Prompt,
    Session,
    Size,
    build_trace,
    content_bound,
)
from _traces import Segment  # noqa: E402
from _vllm_procs import Started, bench_processes  # noqa: E402

from tests.support.machine import core_for, require_memory  # noqa: E402
from tests.support.redis_procs import free_ports  # noqa: E402
from tests.support.server_procs import CacheServerProc  # noqa: E402

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "serve_rps_vs_nocache",
    "serve_rps_vs_lmcache",
    "ttft_p50_vs_nocache",
    "ttft_p99_vs_nocache",
    "hit_vs_bound",
    "blend_fact_kept",
    "failed_requests",
    "blend_load_mb_s",
    "prefix_load_mb_s",
)

CONFIGS = ("nocache", "prefix", "blend", "lmcache")
ENGINES = 2
IM_START = 1  # SmolLM2's <|im_start|>: every chat message starts with it
_SETTLE_TIMEOUT_S = 120.0  # hang guard: counters reach /metrics within a step or two


@dataclass(slots=True)
class ConfigResult:
    """What one configuration measured."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = math.nan
    counters: dict[str, float] = field(default_factory=dict)  # deltas, summed over engines

    @property
    def done(self) -> list[Outcome]:
        """The requests that completed."""
        return [o for o in self.outcomes if o.error is None]

    @property
    def failed(self) -> int:
        """The requests that failed."""
        return len(self.outcomes) - len(self.done)

    @property
    def rps(self) -> float:
        """Completed requests per second of the replay."""
        return len(self.done) / self.wall

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens of completed requests per second of the replay."""
        return sum(o.prompt_tokens for o in self.done) / self.wall

    def mean_seconds(self) -> tuple[float, float]:
        """Mean request time over the completed requests and the mean part of it after the
        first token (the answer's tokens, which no cache of the prompt speeds up), s."""
        if not self.done:
            return math.nan, math.nan
        total = statistics.fmean(o.seconds for o in self.done)
        return total, statistics.fmean(o.seconds - o.ttft for o in self.done)

    def ttft(self, q: float) -> float:
        """TTFT quantile ``q`` (0.5, 0.99) over the completed requests, seconds."""
        values = sorted(o.ttft for o in self.done)
        if len(values) < 2:
            return values[0] if values else math.nan
        return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]

    @property
    def connector_tokens(self) -> float:
        """Tokens a connector brought in (nopecache: loaded; LMCache: vLLM's external hits)."""
        c = self.counters
        if self.name in ("prefix", "blend"):
            return c.get("vllm:nopecache_loaded_exact_tokens", 0.0) + c.get(
                "vllm:nopecache_loaded_pi_tokens", 0.0
            )
        return c.get("vllm:external_prefix_cache_hits", 0.0)

    @property
    def load_mb_s(self) -> float:
        """The connector's fetch and placement rate: 10^6 bytes fetched per second spent
        fetching and placing (layer loops excluded); nan when nothing was fetched."""
        seconds = self.counters.get("vllm:nopecache_fetch_seconds", 0.0)
        if seconds <= 0:
            return math.nan
        return self.counters.get("vllm:nopecache_fetched_bytes", 0.0) / seconds / 1e6

    @property
    def cached_tokens(self) -> float:
        """Tokens served from a cache: vLLM's own prefix hits plus the connector's."""
        return self.counters.get("vllm:prefix_cache_hits", 0.0) + self.connector_tokens

    @property
    def cache_share(self) -> float:
        """Tokens served from cache over prompt tokens (vLLM's counter)."""
        prompt = self.counters.get("vllm:prompt_tokens", 0.0)
        return self.cached_tokens / prompt if prompt else math.nan


def nopecache_transfer(url: str, mode: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of nopecache's connector in ``mode`` (off or blend)."""
    return {
        "kv_connector": "NopecacheConnector",
        "kv_connector_module_path": "nopecache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "url": url,
            "pi_reuse": mode,
            "segment_token_ids": [IM_START],
        },
    }


def lmcache_transfer(port: int) -> dict[str, Any]:
    """``--kv-transfer-config`` of LMCache's multiprocess connector."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def _counters(engines: Sequence[ServeProc]) -> list[dict[str, float]]:
    return [e.metrics() for e in engines]


def _settle(engines: Sequence[ServeProc], before: list[dict[str, float]], sent: list[int]) -> None:
    """Wait until each engine's /metrics counts the requests it answered (its counters,
    the connector's included, then hold the replay's last step)."""
    deadline = time.monotonic() + _SETTLE_TIMEOUT_S
    for engine, start, n in zip(engines, before, sent, strict=True):
        engine.check_alive()
        while (
            engine.metrics().get("vllm:request_success", 0.0)
            - start.get("vllm:request_success", 0.0)
            < n
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine.name}: /metrics never counted its {n} requests")
            time.sleep(0.1)


def run_config(
    name: str,
    transfer: dict[str, Any] | None,
    env: dict[str, str],
    model: str,
    work: Path,
    started: Started,
    plan: Sequence[Sequence[Planned]],
    in_flight: int,
) -> ConfigResult:
    """Start two engines with ``transfer``, replay the plan, read counters, stop them."""
    require_memory(ENGINES)  # other engines may have started since the last configuration
    engines = [
        ServeProc(f"{name}-{i}", model, core_for(i), work / f"{name}-{i}.log", transfer, env)
        for i in range(ENGINES)
    ]
    for engine in engines:
        engine.launch(started)
    try:
        for engine in engines:
            assert engine.proc is not None
            print(
                f"{engine.name}: core {engine.cpu}, port {engine.port}, process group "
                f"{engine.proc.pid}",
                flush=True,
            )
        for engine in engines:
            engine.wait_ready()
            # First requests allocate: keep them out of the numbers.
            _post(
                f"{engine.url}/v1/completions",
                {"model": SERVED_NAME, "prompt": "Hello!", "max_tokens": 2, "temperature": 0.0},
            )
        before = _counters(engines)
        outcomes, wall = replay([e.url for e in engines], SERVED_NAME, plan, in_flight)
        for engine in engines:
            engine.check_alive()  # a dead engine fails its requests: say why
        sent = [
            sum(1 for o in outcomes if o.engine == i and o.error is None) for i in range(ENGINES)
        ]
        _settle(engines, before, sent)
        after = _counters(engines)
        totals: dict[str, float] = {}
        for b, a in zip(before, after, strict=True):
            for key, value in a.items():
                totals[key] = totals.get(key, 0.0) + value - b.get(key, 0.0)
        return ConfigResult(name, outcomes, wall, totals)
    finally:
        started.stop_now([e.proc for e in engines if e.proc is not None])


def _fact_held(text: str, fact: str | None) -> bool:
    return fact is not None and fact.lower() in text.lower()


def print_table(
    results: dict[str, ConfigResult], bound: float, facts: dict[int, str | None]
) -> None:
    """The per-configuration table (markdown, as docs/results/vllm_serve.md shows it)."""
    print()
    print(
        "| config | requests | failed | req/s | prompt tok/s | TTFT p50 | TTFT p99 | vLLM prefix "
        "hits | connector | from cache / prompt | content bound | facts |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    n_facts = sum(1 for f in facts.values() if f is not None)
    for r in results.values():
        held = sum(_fact_held(o.text, facts[o.index]) for o in r.done)
        print(
            f"| {r.name} | {len(r.outcomes)} | {r.failed} | {r.rps:.3f} | {r.prompt_tps:.0f} "
            f"| {r.ttft(0.5) * 1e3:.0f} ms | {r.ttft(0.99) * 1e3:.0f} ms "
            f"| {r.counters.get('vllm:prefix_cache_hits', 0.0):.0f} | {r.connector_tokens:.0f} "
            f"| {r.cache_share:.1%} | {bound:.1%} | {held}/{n_facts} |"
        )
    print()


def _ratio(results: dict[str, ConfigResult], a: str, b: str, value: str) -> str:
    if a not in results or b not in results:
        return "skipped"
    get = {
        "rps": lambda r: r.rps,
        "p50": lambda r: r.ttft(0.5),
        "p99": lambda r: r.ttft(0.99),
    }[value]
    return f"{get(results[a]) / get(results[b]):.4f}"


def summary(
    results: dict[str, ConfigResult], bound: float, facts: dict[int, str | None]
) -> dict[str, str]:
    """The RESULT line's values (see the module docstring)."""
    out = {
        "serve_rps_vs_nocache": _ratio(results, "blend", "nocache", "rps"),
        "serve_rps_vs_lmcache": _ratio(results, "blend", "lmcache", "rps"),
        "ttft_p50_vs_nocache": _ratio(results, "blend", "nocache", "p50"),
        "ttft_p99_vs_nocache": _ratio(results, "blend", "nocache", "p99"),
        "hit_vs_bound": "skipped",
        "blend_fact_kept": "skipped",
        "failed_requests": str(sum(r.failed for r in results.values())),
        "blend_load_mb_s": "skipped",
        "prefix_load_mb_s": "skipped",
    }
    for name in ("blend", "prefix"):
        if name in results:
            out[f"{name}_load_mb_s"] = f"{results[name].load_mb_s:.1f}"
    if "blend" in results:
        out["hit_vs_bound"] = f"{results['blend'].cache_share / bound:.4f}"
    if "blend" in results and "nocache" in results:
        ref = {o.index: o.text for o in results["nocache"].done}
        got = {o.index: o.text for o in results["blend"].done}
        held = [i for i, t in ref.items() if _fact_held(t, facts[i])]
        kept = [i for i in held if _fact_held(got.get(i, ""), facts[i])]
        out["blend_fact_kept"] = f"{len(kept) / len(held):.4f}" if held else "nan"
        for i in held:
            if i not in kept:
                print(f"request {i}: blend lost {facts[i]!r}: {ref[i]!r} -> {got.get(i)!r}")
    return out


def plan_trace(
    sessions: Sequence[Session], tokenizer: Any
) -> tuple[list[list[Planned]], list[Prompt], dict[int, str | None]]:
    """Tokenize the trace: planned requests per session (round robin over the engines),
    the prompts in trace order, and each request's fact."""
    plan: list[list[Planned]] = []
    prompts: list[Prompt] = []
    facts: dict[int, str | None] = {}
    for session in sessions:
        planned = []
        for req in session.requests:
            chat = chat_prompt(tokenizer, [(role, role, text) for role, text in req.messages])
            i = len(prompts)
            prompts.append(Prompt(chat.tokens, chat.segments))
            facts[i] = req.fact
            planned.append(Planned(i, i % ENGINES, chat.tokens, req.max_tokens))
        plan.append(planned)
    return plan, prompts, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="vLLM model folder ($NOPECACHE_VLLM_MODEL)")
    parser.add_argument("--lmcache-overlay", type=Path, default=ROOT / ".lmcache-overlay")
    parser.add_argument(
        "--configs",
        nargs="*",
        choices=CONFIGS,
        default=None,
        help="run only these (default: all four; --quick: nocache and blend)",
    )
    parser.add_argument("--in-flight", type=int, default=4, help="sessions sent at once")
    parser.add_argument("--seed", type=int, default=23, help="trace seed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (make test): a short chat, two agents, two RAG users, the tool "
        "pair, 4-token answers; no cache and blend only unless --configs names others",
    )
    args = parser.parse_args()
    if args.in_flight < 1:
        sys.exit(f"--in-flight must be >= 1, got {args.in_flight}")
    model = args.model or os.environ.get("NOPECACHE_VLLM_MODEL")
    if not model:
        sys.exit("set NOPECACHE_VLLM_MODEL (make bench does) or pass --model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def measure(seg: Segment) -> int:
        return len(tokenizer.encode(seg.rendered(), add_special_tokens=False))

    sessions = build_trace(QUICK if args.quick else Size(), args.seed, measure)
    plan, prompts, facts = plan_trace(sessions, tokenizer)
    prompt_tokens = sum(len(p.tokens) for p in prompts)
    bound = sum(content_bound(prompts)) / prompt_tokens
    print(
        f"trace: {len(sessions)} sessions, {len(prompts)} requests, {prompt_tokens} prompt "
        f"tokens (longest {max(len(p.tokens) for p in prompts)}), content bound {bound:.1%}, "
        f"{sum(f is not None for f in facts.values())} fact checks; {args.in_flight} sessions "
        "in flight",
        flush=True,
    )
    # --quick runs what the RESULT line needs (blend beside no cache): each configuration
    # is a pair of engine starts, minutes on a loaded 2-core machine, and make test runs
    # it. LMCache only when asked for (as vllm_e2e's --peer, never in make test).
    default = ["nocache", "blend"] if args.quick else list(CONFIGS)
    configs = list(dict.fromkeys(args.configs or default))
    if "lmcache" not in configs:
        print("lmcache: skipped (not asked for; --quick runs it only with --configs)", flush=True)
    if "prefix" not in configs:
        print("prefix: skipped (not asked for; --quick runs it only with --configs)", flush=True)
    overlay: Path = args.lmcache_overlay
    if "lmcache" in configs and not (overlay / "bin" / "lmcache").is_file():
        print(
            f"lmcache: skipped (no LMCache in {overlay}; see bench/vllm_e2e.py's docstring)",
            flush=True,
        )
        configs.remove("lmcache")
    work = Path(tempfile.mkdtemp(prefix="nopecache-vllm-serve-"))
    print(f"logs in {work}", flush=True)
    results: dict[str, ConfigResult] = {}
    with bench_processes(engines=ENGINES) as started:
        for name in configs:
            env: dict[str, str] = {}
            transfer: dict[str, Any] | None = None
            server: CacheServerProc | None = None
            lmcache: subprocess.Popen[bytes] | None = None
            if name in ("prefix", "blend"):
                server = started.server(
                    CacheServerProc(
                        work / name, free_ports(1)[0], tiers=("cpu://?capacity=2GiB&pinned=no",)
                    )
                )
                server.start()
                mode = "off" if name == "prefix" else "blend"
                transfer = nopecache_transfer(f"nopecache://{server.address}", mode)
            elif name == "lmcache":
                port, lmcache = start_lmcache_server(overlay, work, started)
                transfer = lmcache_transfer(port)
                env = {"PYTHONPATH": f"{overlay}:{ROOT}", "LMCACHE_DISABLE_BANNER": "1"}
            result = run_config(name, transfer, env, model, work, started, plan, args.in_flight)
            if server is not None:
                server.stop()
            if lmcache is not None:
                started.stop_now([lmcache])
            results[name] = result
            r = result
            load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"{name}: machine load {load} (1/5/15 min) as the replay ended: ratios "
                "between configurations assume a similar load",
                flush=True,
            )
            print(
                f"{name}: {len(r.done)}/{len(r.outcomes)} done in {r.wall:.1f} s, "
                f"{r.rps:.3f} req/s, TTFT p50 {r.ttft(0.5) * 1e3:.0f} ms p99 "
                f"{r.ttft(0.99) * 1e3:.0f} ms, from cache {r.cache_share:.1%}",
                flush=True,
            )
            total, after = r.mean_seconds()
            print(
                f"{name}: a request took {total * 1e3:.0f} ms on average, {after * 1e3:.0f} ms "
                "of it after the first token",
                flush=True,
            )
            connector = {
                k.removeprefix("vllm:nopecache_"): v
                for k, v in r.counters.items()
                if k.startswith("vllm:nopecache_") and v
            }
            if connector:
                print(f"{name}: connector counters {connector}", flush=True)
            for o in r.outcomes:
                if o.error is not None:
                    print(f"{name}: request {o.index} (engine {o.engine}) failed: {o.error}")
    print_table(results, bound, facts)
    fields = summary(results, bound, facts)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
