"""The P/D proxy's routing against small aiohttp upstreams on loopback.

What ``vllm serve`` engines cannot show cheaply (test_pd_engine.py runs the proxy
in front of real ones): round robin over several prefill and decode engines, the prefill
request rewritten to one token without streaming, the hand-off carried to the decode
request, a streamed answer passed through chunk by chunk, an upstream error answered with
its status and body, a prefill engine that refuses connections skipped for the next one,
and 502 when none answers. The upstreams answer what they were sent, so every assertion
is on what the proxy really sent. In the vLLM suite: the proxy runs where vLLM (and so
aiohttp) is.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy runs in the vLLM environment")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from nopecache.integrations.vllm.pd.proxy import ProxyConfig, build_app, prefill_body  # noqa: E402
from tests.support.redis_procs import free_ports  # noqa: E402


def _upstream(name: str, seen: list[tuple[str, dict[str, Any]]]) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((name, body))
        if body.get("model") == "missing":
            return web.json_response({"error": {"message": "no model missing"}}, status=404)
        if body.get("stream"):
            out = web.StreamResponse()
            out.content_type = "text/event-stream"
            await out.prepare(request)
            for word in ("a", "b"):
                await out.write(f"data: {json.dumps({'from': name, 'text': word})}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            return out
        return web.json_response(
            {"from": name, "kv_transfer_params": {"nopecache": {"by": name}}, "got": body}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    return app


def test_prefill_body_is_one_token_not_streamed() -> None:
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"a": 1}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False}
    sampled = prefill_body({"prompt": "x", "n": 3, "min_tokens": 5})
    assert sampled == {"prompt": "x", "n": 1, "max_tokens": 1, "stream": False}
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat == {"messages": [], "max_completion_tokens": 1, "max_tokens": 1, "stream": False}


def test_round_robin_hand_off_streaming_errors_and_retry() -> None:
    async def run() -> None:
        seen: list[tuple[str, dict[str, Any]]] = []
        upstreams = {n: TestServer(_upstream(n, seen)) for n in ("p0", "p1", "d0", "d1")}
        for server in upstreams.values():
            await server.start_server()
        url = {n: str(s.make_url("")).rstrip("/") for n, s in upstreams.items()}
        dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
        config = ProxyConfig((url["p0"], dead, url["p1"]), (url["d0"], url["d1"]))
        client = TestClient(TestServer(build_app(config)))
        await client.start_server()
        try:
            answers = []
            for i in range(3):
                resp = await client.post(
                    "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 5}
                )
                assert resp.status == 200
                answers.append(await resp.json())
            # Prefill p0, then the dead one skipped for p1, then p0; decode d0, d1, d0.
            assert [a["from"] for a in answers] == ["d0", "d1", "d0"]
            assert [a["got"]["kv_transfer_params"]["nopecache"]["by"] for a in answers] == [
                "p0",
                "p1",
                "p0",
            ]
            sent = [(n, b["max_tokens"], b["stream"]) for n, b in seen if n.startswith("p")]
            assert sent == [("p0", 1, False), ("p1", 1, False), ("p0", 1, False)]
            assert [b["max_tokens"] for n, b in seen if n.startswith("d")] == [5, 5, 5]

            seen.clear()
            resp = await client.post(
                "/v1/chat/completions", json={"messages": [], "max_tokens": 5, "stream": True}
            )
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
            assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")
            assert [n for n, _ in seen] == ["p1", "d1"]  # the dead one skipped again

            resp = await client.post("/v1/completions", json={"model": "missing", "prompt": "q"})
            assert resp.status == 404 and "no model missing" in await resp.text()
            resp = await client.post("/v1/completions", data=b"not json")
            assert resp.status == 400
            assert (await client.get("/health")).status == 502  # the dead prefill engine
        finally:
            await client.close()
            for server in upstreams.values():
                await server.close()

        only_dead = TestClient(TestServer(build_app(ProxyConfig((dead,), (dead,)))))
        await only_dead.start_server()
        try:
            resp = await only_dead.post("/v1/completions", json={"prompt": "q"})
            assert resp.status == 502 and "no prefill engine" in await resp.text()
        finally:
            await only_dead.close()

    asyncio.run(run())
