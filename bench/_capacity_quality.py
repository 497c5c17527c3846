"""What a compact stored form costs in answers and what it moves per second, for
``bench/capacity.py``.

Quality, on SmolLM2-135M-Instruct through the transformers adapter and the real client and
server (the report half of ``bench/_quality_set.py``, the set ``bench/quality.py`` reports
blend on), for each codec against the uncompressed form stored and fetched the same way:

- exact prefix: the prompt's context and chunks (everything before the question) stored
  as an exact prefix, fetched back, and the question prefilled over them; along the full
  prefill's greedy answer (teacher-forced), KL(raw || codec) of the next-token
  distributions and top-1 agreement with the raw form's, pooled over all answer tokens;
- blend: the chunks stored on their own (behind the dialog sink) and reused position-
  independently under the default recompute policy, the same two figures against the raw
  form's blend, and the share of the prompts whose fact the raw blend keeps that the
  codec's keeps too (greedy answers compared where the top-1s differ).

Speed: ``encode_tensors`` / ``decode_payload`` of one 256-token block of a Llama-3-8B-shaped
model (32 layers, 8 KV heads, head_dim 128, bf16: 32 MiB) on this CPU, GB/s of the
engine-dtype bytes, best of a few rounds.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _harness import cache_server
from _quality_eval import (
    MAX_ANSWER,
    Config,
    _captured,
    answer_logprobs,
    build_case,
    decode,
    parts,
    reference,
)
from _quality_set import half

from nopecache.client import CacheClient, ClientConfig
from nopecache.client.cost import CostConfig
from nopecache.integrations.hf.adapter import CacheClientSource, HFEngine
from nopecache.integrations.hf.forward import PrefillOutput
from nopecache.proto.block import StoredForm
from nopecache.proto.kv_codec import decode_payload, encode_tensors, payload_layout
from nopecache.recompute import policies as rc
from tests.support.local_model import load_model, load_tokenizer

PREFIX_BLOCK = 16
DEFAULT = Config(rc.DEFAULT_POLICY, sink="dialog")
LLAMA_BLOCK = (32, 256, 8, 128)  # layers, tokens, KV heads, head_dim


@dataclass(slots=True)
class Agreement:
    """A codec's answers against the raw form's, pooled over answer tokens."""

    kl: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    facts: list[bool] = field(default_factory=list)

    def add(self, raw: torch.Tensor, got: torch.Tensor) -> bool:
        """Add one prompt's log-probabilities; whether every top-1 agreed."""
        self.kl.append((raw.exp() * (raw - got)).sum(-1))
        agree = raw.argmax(-1) == got.argmax(-1)
        self.top1.append(agree)
        return bool(agree.all())

    @property
    def mean_kl(self) -> float:
        """Mean KL over all answer tokens."""
        return float(torch.cat(self.kl).mean())

    @property
    def mean_top1(self) -> float:
        """Top-1 agreement over all answer tokens."""
        return float(torch.cat(self.top1).float().mean())

    @property
    def fact_kept(self) -> float:
        """Share of the facts the raw form keeps that the codec keeps too."""
        return sum(self.facts) / len(self.facts) if self.facts else 1.0


@dataclass(frozen=True, slots=True)
class CodecQuality:
    """One codec's quality on exact prefixes and in blend."""

    codec: str
    exact: Agreement
    blend: Agreement


def _client(engine: HFEngine, address: str, codec: str) -> CacheClient:
    config = ClientConfig(
        servers=(address,),
        prefix_block_tokens=PREFIX_BLOCK,
        cost=CostConfig(enabled=False),
        lookup_timeout_s=30.0,
        get_timeout_s=60.0,
        put_timeout_s=60.0,
        kv_codec=codec,  # type: ignore[arg-type]
    )
    return CacheClient(
        config,
        fingerprint=engine.fingerprint(StoredForm.NOPE),
        rope=engine.rope,
        v_head_dim=engine.stack.head_dim,
    )


def quality(
    codecs: Sequence[str], prompts: int, progress: Callable[[str], None]
) -> list[CodecQuality]:
    """Each codec's :class:`CodecQuality` on the first ``prompts`` report prompts (0: all)."""
    torch.set_grad_enabled(False)
    tokenizer = load_tokenizer(progress=progress)
    engine = HFEngine(load_model(progress=progress), name="SmolLM2-135M-Instruct")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    chosen = half("report")[: prompts or None]
    out = {c: CodecQuality(c, Agreement(), Agreement()) for c in codecs}
    with (
        tempfile.TemporaryDirectory() as tmp,
        cache_server("2GiB", Path(tmp) / "server.log") as address,
    ):
        clients = {c: _client(engine, address, c) for c in ("none", *codecs)}
        try:
            for p in chosen:
                pt = parts(tokenizer, p)
                ref = reference(engine, tokenizer, pt.tokens, stop)
                cut = len(pt.tokens) - len(pt.question)
                context_kv = _captured(engine, pt.tokens[:cut])
                exact: dict[str, torch.Tensor] = {}
                blend: dict[str, tuple[torch.Tensor, PrefillOutput]] = {}
                for codec, client in clients.items():
                    source = CacheClientSource(client, wait=True, namespace=f"{p.name}/exact")
                    source.store(pt.tokens[:cut], context_kv, position_independent=False)
                    reused = source.reuse(pt.tokens, pt.segments)
                    assert reused is not None and reused.layout.prefix_end > 0
                    out_ = engine.prefill(pt.tokens, reused)
                    exact[codec] = answer_logprobs(engine, out_, ref.answer)
                    case = build_case(engine, tokenizer, client, p, stop, ("dialog",))
                    prefill = engine.prefill(case.tokens, case.reused["dialog"], DEFAULT.policy)
                    blend[codec] = (answer_logprobs(engine, prefill, ref.answer), prefill)
                raw_blend, raw_prefill = blend["none"]
                raw_text = decode(tokenizer, engine.generate(raw_prefill, MAX_ANSWER, stop))
                for codec in codecs:
                    q = out[codec]
                    q.exact.add(exact["none"], exact[codec])
                    got, prefill = blend[codec]
                    same = q.blend.add(raw_blend, got)
                    if p.holds(raw_text):
                        text = (
                            raw_text
                            if same
                            else decode(tokenizer, engine.generate(prefill, MAX_ANSWER, stop))
                        )
                        q.blend.facts.append(p.holds(text))
                progress(
                    f"{p.name:22s} "
                    + " ".join(
                        f"{c}: exact KL {float(out[c].exact.kl[-1].mean()):.2e} "
                        f"blend KL {float(out[c].blend.kl[-1].mean()):.2e}"
                        for c in codecs
                    )
                )
        finally:
            for client in clients.values():
                client.close()
    return [out[c] for c in codecs]


def _best(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def codec_speed(
    codec: str, rounds: int = 3, shape: tuple[int, int, int, int] = LLAMA_BLOCK
) -> tuple[float, float, float]:
    """(bytes ratio, encode GB/s, decode GB/s) of one block of ``shape`` in bf16, GB/s of
    the bf16 bytes; the ratio is the compact payload over the bf16 one."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(shape, generator=g).to(torch.bfloat16)
    v = torch.randn(shape, generator=g).to(torch.bfloat16)
    raw_bytes = 2 * k.numel() * k.element_size()
    parts_ = encode_tensors(codec, k, v)
    payload = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts_])
    enc = _best(lambda: encode_tensors(codec, k, v), rounds)
    dec = _best(lambda: decode_payload(codec, payload, torch.bfloat16, shape, shape[3]), rounds)
    ratio = payload_layout(codec, 2, shape, shape[3]).nbytes / raw_bytes
    return ratio, raw_bytes / enc / 1e9, raw_bytes / dec / 1e9
