"""An OpenAI-compatible proxy in front of prefill and decode engines (``nopecache-pd-proxy``).

::

    nopecache-pd-proxy --prefill http://p0:8100 --prefill http://p1:8100 \\
                       --decode http://d0:8200 --port 8000

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes to the next prefill engine
(round robin) as the same request with ``max_tokens=1`` (chat: ``max_completion_tokens``
too) and ``stream=false``; its answer's ``kv_transfer_params`` (the producer's hand-off,
``handoff.py``) are added to the original request, which goes to the next decode engine,
and the decode engine's answer, streamed or not, is the client's. The decode engine waits
for the blocks the hand-off names (``handoff_deadline_ms``) and recomputes what never
landed: a failed prefill store costs time, never a wrong token.

Failures keep their status: an upstream that answers an error (a 400 for a bad request,
a 503 while loading) is answered with its status and body. A prefill engine that cannot be
reached or drops the connection is retried on the next one (each at most once); when none
answers, the client gets 502 with an OpenAI-style error. ``GET /health`` is 200 when every
engine's ``/health`` is, else the first failing one's status (502 for one that cannot be
reached); ``GET /v1/models`` is a decode engine's.

Runs where vLLM runs (aiohttp is a vLLM dependency); nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["ProxyConfig", "build_app", "main", "prefill_body"]

log = logging.getLogger(__name__)

_CONNECT_S = 10.0  # an engine that does not accept a connection in 10 s is down
_UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """The engines behind the proxy (base URLs, e.g. ``http://127.0.0.1:8100``)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one prefill and one decode engine")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's version of a request: one token of one sequence, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "n" in out:
        out["n"] = 1  # one sequence fills the cache; the decode engine samples all n
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "upstream_error", "code": status}}, status=status
    )


class _Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._prefill: Iterator[str] = itertools.cycle(config.prefill)
        self._decode: Iterator[str] = itertools.cycle(config.decode)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_S)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            return _error(400, f"the request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        path = request.path
        params: Any = None
        for _ in self.config.prefill:  # each engine at most once
            url = next(self._prefill) + path
            try:
                async with self.session.post(url, json=prefill_body(body)) as resp:
                    if resp.status != 200:
                        return web.Response(
                            status=resp.status,
                            body=await resp.read(),
                            content_type=resp.content_type,
                        )
                    params = (await resp.json()).get("kv_transfer_params")
                    break
            except _UPSTREAM_ERRORS as err:
                log.warning("prefill engine %s failed: %r; trying the next", url, err)
        else:
            return _error(502, "no prefill engine answered")
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        return await self._decode_answer(request, next(self._decode) + path, body)

    async def _decode_answer(
        self, request: web.Request, url: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        assert self.session is not None
        try:
            async with self.session.post(url, json=body) as resp:
                if not body.get("stream") or resp.status != 200:
                    return web.Response(
                        status=resp.status, body=await resp.read(), content_type=resp.content_type
                    )
                out = web.StreamResponse(status=resp.status)
                out.content_type = resp.content_type
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except _UPSTREAM_ERRORS as err:
            log.warning("decode engine %s failed: %r", url, err)
            return _error(502, f"the decode engine failed: {type(err).__name__}")

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for base in (*self.config.prefill, *self.config.decode):
            try:
                async with self.session.get(base + "/health") as resp:
                    if resp.status != 200:
                        return web.Response(status=resp.status, text=f"{base}: {resp.status}")
            except _UPSTREAM_ERRORS as err:
                return web.Response(status=502, text=f"{base}: {type(err).__name__}")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        url = next(self._decode) + "/v1/models"
        try:
            async with self.session.get(url) as resp:
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type=resp.content_type
                )
        except _UPSTREAM_ERRORS as err:
            return _error(502, f"the decode engine failed: {type(err).__name__}")


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy's aiohttp application."""
    proxy = _Proxy(config)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    """Run the proxy (``nopecache-pd-proxy --prefill URL --decode URL [--port N]``)."""
    parser = argparse.ArgumentParser(prog="nopecache-pd-proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill engine URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode engine URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = ProxyConfig(
        tuple(u.rstrip("/") for u in args.prefill), tuple(u.rstrip("/") for u in args.decode)
    )
    web.run_app(build_app(config), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
