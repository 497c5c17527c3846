"""The vLLM connector's two halves without vLLM, for tests: a tiny Llama's identity, one
engine's scheduler and worker halves over a real server with CPU paged caches, and a
request as vLLM hands it over (token ids and block hashes).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig

from nopecache.client import CacheClient, ModelFingerprint
from nopecache.integrations.vllm.config import ConnectorConfig, ModelIdentity
from nopecache.integrations.vllm.scheduler import SchedulerSide
from nopecache.integrations.vllm.worker import WorkerSide
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.server_procs import CacheServerProc
from tests.support.slow_lookups import SlowServer

LAYERS, HEADS, DIM, BS, NB = 2, 2, 8, 4, 12


def _identity() -> ModelIdentity:
    config = LlamaConfig(
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        hidden_size=32,
        head_dim=DIM,
    )
    rope = RopeSpec.from_hf_config(config)
    fp = ModelFingerprint.from_rope_spec(
        model="tiny-llama",
        revision="",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.float32,
        form=StoredForm.ROPE,
        rope=rope,
    )
    return ModelIdentity(fingerprint=fp, rope=rope, v_head_dim=DIM, block_size=BS)


class _Engine:
    """One engine's two halves, its client and its paged caches (random contents)."""

    def __init__(
        self,
        server: CacheServerProc | SlowServer,
        seed: int,
        query: str = "?lookup_timeout=300ms",
        blend_unsupported: str | None = None,
        layout: str = "flash",
        device: str = "cpu",
        kv_role: str = "kv_both",
        **extra: Any,
    ) -> None:
        """``layout``: "flash" (FlashAttention's ``[2, blocks, block_size, heads, dim]``) or
        "cpu" (vLLM's CPU attention pages ``[blocks, heads, block_size, 2 * dim]``); the
        caches live on ``device``."""
        model = _identity()
        self.config = ConnectorConfig.from_extra_config(
            {"url": f"nopecache://{server.address}{query}", **extra}, kv_role
        )
        self.client = CacheClient(
            self.config.client,
            fingerprint=model.fingerprint,
            rope=model.rope,
            v_head_dim=DIM,
            prefix_block_tokens=BS,
        )
        gen = torch.Generator().manual_seed(seed)
        shape = (2, NB, BS, HEADS, DIM) if layout == "flash" else (NB, HEADS, BS, 2 * DIM)
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(*shape, generator=gen).to(device)
            for i in reversed(range(LAYERS))  # registration order must not matter
        }
        self.scheduler = SchedulerSide(self.config, model, self.client, blend_unsupported)
        self.worker = WorkerSide(self.config, model, self.client)
        self.worker.register(self.caches)

    def cache(self, layer: int) -> torch.Tensor:
        return self.caches[f"model.layers.{layer}.self_attn.attn"]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer as ``[blocks, block_size, heads, dim]`` views (any layout)."""
        assert self.worker.layout is not None
        cache = self.cache(layer)
        return self.worker.layout.k_view(cache), self.worker.layout.v_view(cache)

    def matched(self, request: Any, computed: int) -> int:
        """``matched_tokens`` asked again until it answers, as vLLM's scheduler does on
        each step while the lookup is in flight (None)."""
        # Only a hang guard: a loopback lookup answers in milliseconds, or fails after
        # the client's lookup timeout (300 ms here).
        deadline = time.monotonic() + 60
        while (claimed := self.scheduler.matched_tokens(request, computed)) is None:
            assert time.monotonic() < deadline, "the lookup never finished"
            time.sleep(0.001)
        return claimed

    def step(self, request: Any, block_ids: list[int], computed: int) -> Any:
        """Schedule the whole prompt of ``request`` in one step; run load and save."""
        out = self.plan_step(request, block_ids, computed)
        self.worker.begin_step()
        self.load(out.plan)
        self.worker.save(out.plan)
        self.client.drain()
        return out

    def plan_step(self, request: Any, block_ids: list[int], computed: int) -> Any:
        """The scheduler half of :meth:`step`: claim, allocate and plan, nothing run."""
        claimed = self.matched(request, computed)
        self.scheduler.after_alloc(request, block_ids, claimed)
        plan = self.scheduler.build_step(self.plan_output(request, block_ids, computed, claimed))
        return SimpleNamespace(claimed=claimed, plan=plan)

    def plan_output(self, request: Any, block_ids: list[int], computed: int, claimed: int) -> Any:
        """vLLM's scheduler output of a step that runs the rest of ``request``'s prompt."""
        n = len(request.prompt_token_ids)
        return SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id=request.request_id,
                    block_ids=(block_ids,),
                    num_computed_tokens=computed + claimed,
                )
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={request.request_id: n - computed - claimed},
            total_num_scheduled_tokens=n - computed - claimed,
        )

    def load(self, plan: Any) -> None:
        """Run the step's loads, the background ones to their end (:func:`run_loads`)."""
        run_loads(self.worker, plan)

    def close(self) -> None:
        self.worker.close()
        self.client.close()


def run_loads(worker: WorkerSide, plan: Any) -> None:
    """Run a step's loads on ``worker`` and wait for the background ones (``load_async``,
    the default) until ``finished_loads`` reports each, as vLLM holds the request's
    forward until then."""
    worker.load(plan)
    waiting = {spec.req_id for spec in plan.loads if spec.asynchronous}
    # Only a hang guard: a loopback fetch of a few blocks takes milliseconds.
    deadline = time.monotonic() + 60
    while waiting:
        assert time.monotonic() < deadline, f"loads of {sorted(waiting)} never finished"
        waiting -= worker.finished_loads()
        time.sleep(0.001)


def _request(req_id: str, tokens: list[int], kv_transfer_params: Any = None) -> Any:
    hashes = [f"h{tuple(tokens[: (i + 1) * BS])}".encode() for i in range(len(tokens) // BS)]
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        block_hashes=hashes,
        kv_transfer_params=kv_transfer_params,
    )
