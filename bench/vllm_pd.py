"""Prefill/decode disaggregation through nopecache: 1P1D behind the proxy vs a kv_both pair.

Run in the vLLM environment: ``.venv-vllm/bin/python bench/vllm_pd.py`` (``make bench``).
Two real ``vllm serve`` engines at a time (CPU build, SmolLM2-135M, fp32 so that answers
compare token for token, eager, one OpenMP thread each on its own core) and one nopecache
server (CPU tier):

    pd     a prefill engine (``kv_role="kv_producer"``) and a decode engine
           (``kv_consumer``, vLLM's own prefix cache off: every prompt token it does not
           compute comes from nopecache) behind ``nopecache-pd-proxy``
    both   two ``kv_both`` engines (prefix cache on) sharing a fresh server, requests
           round robin: each engine prefills and decodes its own

The trace is long prompts with long answers (distinct prompts: nothing is shared between
requests, so what the decode engine loads is the hand-off), ``--in-flight`` at once,
streamed completions over token ids, greedy. Each prompt is ``blocks * 128 + 1`` tokens
(128: the CPU build's KV block size), so the decode engine can claim every token but the
one it must compute to sample: the share measures the hand-off, not block rounding (a
prompt of ``n`` tokens leaves its last partial block to the decode engine: at most 127
tokens, under 5% from 2,560 tokens on). The server's CPU tier holds every prompt's fp32
blocks (prefix and content keys), so nothing is evicted between store and load. Before the pd replay the decode engine answers every prompt
as a plain request (nothing stored yet: it computes the whole prompt, a single engine's
answer); the pd answers are compared with those (``pd_mismatches``).

Per setup: time to first token p50/p99 (seconds, from sending to the first chunk with
text, at the client), inter-token latency p50/p99 (milliseconds between text chunks),
requests/s over the replay's wall time. ``pd_loaded_share``: prompt tokens the decode
engine loaded (``vllm:nopecache_loaded_exact_tokens``, a delta over the replay) over the
replay's prompt tokens (target >= 0.95 for these prompt lengths: only the last partial
block is computed). ``--quick`` runs a tiny pd replay only (both's keys say ``skipped``).

Last line: ``RESULT pd_ttft_p50_s=... pd_ttft_p99_s=... pd_itl_p50_ms=... pd_itl_p99_ms=...
pd_rps=... both_ttft_p50_s=... both_ttft_p99_s=... both_itl_p50_ms=... both_itl_p99_ms=...
both_rps=... pd_loaded_share=... pd_mismatches=... failed_requests=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from _pd_procs import ProxyProc, pd_transfer  # noqa: E402
from _serve_procs import SERVED_NAME, ServeProc  # noqa: E402
from _vllm_procs import Started, bench_processes  # noqa: E402

from tests.support.machine import core_for  # noqa: E402
from tests.support.redis_procs import free_ports  # noqa: E402
from tests.support.server_procs import CacheServerProc  # noqa: E402

RESULT_KEYS = (
    "pd_ttft_p50_s",
    "pd_ttft_p99_s",
    "pd_itl_p50_ms",
    "pd_itl_p99_ms",
    "pd_rps",
    "both_ttft_p50_s",
    "both_ttft_p99_s",
    "both_itl_p50_ms",
    "both_itl_p99_ms",
    "both_rps",
    "pd_loaded_share",
    "pd_mismatches",
    "failed_requests",
)
# Only a hang guard: a request is seconds on an idle 2-core machine.
_REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Size:
    """The trace's size."""

    requests: int
    blocks: int  # prompt length: blocks * BLOCK + 1 tokens
    answer: int
    in_flight: int
    tier: str  # the nopecache server's CPU tier: it holds every prompt's blocks


# fp32 KV is ~46 KiB a token for SmolLM2-135M, stored twice (prefix and content keys).
QUICK = Size(requests=4, blocks=3, answer=8, in_flight=2, tier="cpu://?capacity=512MiB&pinned=no")
FULL = Size(requests=16, blocks=8, answer=64, in_flight=4, tier="cpu://?capacity=2GiB&pinned=no")
BLOCK = 128  # vLLM's KV block size on the CPU build


def prompt(i: int, tokens: int, encode: Callable[[str], list[int]]) -> list[int]:
    """A distinct prompt of exactly ``tokens`` token ids (no block shared with another
    request's): a warehouse log cut to length, ending on its question."""
    question = encode(" Which crate holds the most bolts? Answer:")
    facts = ", ".join(f"crate {i}-{j} holds {(i * 31 + j * 17) % 89} bolts" for j in range(tokens))
    return encode(f"Warehouse log {i}. {facts}")[: tokens - len(question)] + question


@dataclass(slots=True)
class Outcome:
    """One streamed answer."""

    text: str = ""
    ttft: float = float("nan")
    gaps: list[float] = field(default_factory=list)  # seconds between text chunks
    prompt_tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, text: list[int], answer: int) -> Outcome:
    out = Outcome()
    body = {
        "model": SERVED_NAME,
        "prompt": text,
        "max_tokens": answer,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        if not out.text:
                            out.ttft = now - start
                        else:
                            out.gaps.append(now - last)
                        last = now
                        out.text += choice["text"]
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
    return out


async def _replay(
    urls: list[str], prompts: list[list[int]], size: Size
) -> tuple[list[Outcome], float]:
    outcomes: list[Outcome | None] = [None] * len(prompts)
    queue = list(enumerate(prompts))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, text = queue.pop(0)
            outcomes[i] = await _one(client, urls[i % len(urls)], text, size.answer)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(size.in_flight)))
    wall = time.perf_counter() - start
    return [o for o in outcomes if o is not None], wall


def replay(urls: list[str], prompts: list[list[int]], size: Size) -> tuple[list[Outcome], float]:
    """Send every prompt (request ``i`` to ``urls[i % len]``), ``in_flight`` at once."""
    return asyncio.run(_replay(urls, prompts, size))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(outcomes: list[Outcome], wall: float) -> dict[str, float]:
    """TTFT/ITL percentiles and requests/s of a replay."""
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in ok]
    gaps = [g for o in ok for g in o.gaps]
    return {
        "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "itl_p99_ms": 1000 * _pct(gaps, 0.99),
        "rps": len(ok) / wall,
    }


def _engine(
    name: str,
    model: str,
    core: int,
    work: Path,
    transfer: dict[str, Any],
    prefix_caching: bool = True,
) -> ServeProc:
    return ServeProc(
        name,
        model,
        core,
        work / f"{name}.log",
        transfer,
        dtype="float32",
        prefix_caching=prefix_caching,
    )


def _server(started: Started, work: Path, tier: str) -> CacheServerProc:
    server = started.server(
        CacheServerProc(work / f"server-{len(started.servers)}", free_ports(1)[0], tiers=(tier,))
    )
    server.start()
    return server


def run_pd(
    model: str, work: Path, prompts: list[list[int]], size: Size
) -> tuple[dict[str, float], int, float, int]:
    """The pd setup: (summary, mismatches, loaded share, failed requests)."""
    with bench_processes(engines=2) as started:
        server = _server(started, work, size.tier)
        prefill = _engine(
            "prefill", model, core_for(0), work, pd_transfer("kv_producer", server.address)
        )
        decode = _engine(
            "decode",
            model,
            core_for(1),
            work,
            pd_transfer("kv_consumer", server.address),
            prefix_caching=False,
        )
        for proc in (prefill, decode):
            proc.launch(started)
        for proc in (prefill, decode):
            proc.wait_ready()
        proxy = ProxyProc([prefill.url], [decode.url], work / "proxy.log").start(started)
        started.announce()
        reference, _ = replay([decode.url], prompts, size)
        before = decode.metrics().get("vllm:nopecache_loaded_exact_tokens", 0.0)
        outcomes, wall = replay([proxy.url], prompts, size)
        loaded = decode.metrics().get("vllm:nopecache_loaded_exact_tokens", 0.0) - before
        failed = sum(o.error is not None for o in outcomes)
        for o in outcomes:
            if o.error is not None:
                print(f"pd request failed: {o.error}", flush=True)
        mismatches = sum(
            o.error is None and r.error is None and o.text != r.text
            for o, r in zip(outcomes, reference, strict=True)
        )
        prompt_tokens = sum(o.prompt_tokens for o in outcomes if o.error is None)
        share = loaded / prompt_tokens if prompt_tokens else float("nan")
        return summary(outcomes, wall), mismatches, share, failed


def run_both(
    model: str, work: Path, prompts: list[list[int]], size: Size
) -> tuple[dict[str, float], int]:
    """The kv_both pair: (summary, failed requests)."""
    with bench_processes(engines=2) as started:
        server = _server(started, work, size.tier)
        engines = [
            _engine(f"both{i}", model, core_for(i), work, pd_transfer("kv_both", server.address))
            for i in range(2)
        ]
        for proc in engines:
            proc.launch(started)
        for proc in engines:
            proc.wait_ready()
        started.announce()
        outcomes, wall = replay([e.url for e in engines], prompts, size)
        return summary(outcomes, wall), sum(o.error is not None for o in outcomes)


def main() -> int:
    """Run the bench; print the RESULT line last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny pd replay only (make test)")
    parser.add_argument("--in-flight", type=int, default=None)
    args = parser.parse_args()
    model = os.environ.get("NOPECACHE_VLLM_MODEL", "")
    if not model:
        print("set NOPECACHE_VLLM_MODEL (python -m tests.support.local_model)", file=sys.stderr)
        return 2
    size = QUICK if args.quick else FULL
    if args.in_flight is not None:
        size = dataclasses.replace(size, in_flight=args.in_flight)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    prompts = [prompt(i, size.blocks * BLOCK + 1, encode) for i in range(size.requests)]
    work = Path(tempfile.mkdtemp(prefix="nopecache-vllm-pd-"))
    print(f"vllm_pd: {size}, logs in {work}", flush=True)
    pd, mismatches, share, failed = run_pd(model, work, prompts, size)
    print(f"pd: {pd}", flush=True)
    fields: dict[str, str] = {f"pd_{k}": f"{v:.4g}" for k, v in pd.items()}
    if args.quick:
        fields.update({f"both_{k}": "skipped" for k in pd})
    else:
        both, failed_both = run_both(model, work, prompts, size)
        print(f"both: {both}", flush=True)
        fields.update({f"both_{k}": f"{v:.4g}" for k, v in both.items()})
        failed += failed_both
    fields.update(
        pd_loaded_share=f"{share:.4f}", pd_mismatches=str(mismatches), failed_requests=str(failed)
    )
    print("RESULT " + " ".join(f"{k}={fields[k]}" for k in RESULT_KEYS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
