"""The HTTP side of bench/vllm_serve.py: replay sessions against OpenAI-compatible servers.

Each request is ``POST /v1/completions`` with the prompt as token ids (the trace's exact
tokens: no chat template between the trace and the engine), greedy, streamed; its time to
first token is from sending to the first streamed chunk that carries text, as a client
sees it (queueing in the engine included). Sessions are taken in order by ``in_flight``
workers, each sending its session's requests one after another, so up to ``in_flight``
requests run at once; request ``i`` of the flattened trace goes to engine ``i % len(urls)``
(round robin fixed by the trace, the same in every configuration: no cache-aware routing).
A request fails on a non-200 answer, a transport error, or an answer without text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

__all__ = ["Outcome", "Planned", "replay"]

# Only a hang guard: a request is seconds on an idle 2-core machine; a loaded one stretches
# that several times over, and a request that hangs must still end the run with an error.
_REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send: its index in the trace, engine, tokens and answer length."""

    index: int
    engine: int
    tokens: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    """What one request got."""

    index: int
    engine: int
    prompt_tokens: int
    ttft: float = float("nan")
    seconds: float = float("nan")
    text: str = ""
    error: str | None = None


async def _send(client: httpx.AsyncClient, url: str, model: str, req: Planned) -> Outcome:
    out = Outcome(req.index, req.engine, len(req.tokens))
    body = {
        "model": model,
        "prompt": list(req.tokens),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return out
            parts: list[str] = []
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error']}"
                    return out
                piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if piece and not parts:
                    out.ttft = time.perf_counter() - start
                parts.append(piece)
            out.text = "".join(parts)
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.seconds = time.perf_counter() - start
    if not out.text:
        out.error = "the answer had no text"
    return out


async def _replay(
    urls: Sequence[str], model: str, sessions: Sequence[Sequence[Planned]], in_flight: int
) -> tuple[list[Outcome], float]:
    queue: asyncio.Queue[Sequence[Planned]] = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=in_flight * 2, max_keepalive_connections=in_flight * 2)
    timeout = httpx.Timeout(_REQUEST_TIMEOUT_S)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            session = queue.get_nowait()
            for req in session:
                outcomes.append(await _send(client, urls[req.engine], model, req))

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(in_flight)))
        wall = time.perf_counter() - start
    return sorted(outcomes, key=lambda o: o.index), wall


def replay(
    urls: Sequence[str], model: str, sessions: Sequence[Sequence[Planned]], in_flight: int
) -> tuple[list[Outcome], float]:
    """Send every session (see the module docstring); the outcomes in trace order and the
    wall time from the first send to the last answer."""
    return asyncio.run(_replay(urls, model, sessions, in_flight))
