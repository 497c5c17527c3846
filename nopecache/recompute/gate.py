"""The correctness gate: does blend mode keep this model's answers? Measured, not assumed.

Position-independent reuse re-rotates stored nope K to new positions with the RoPE the
engine *describes* (``RopeSpec`` from the model's config). If that description is wrong
(another base, a scaling the config does not name, a model family whose attention the
layer loop does not reproduce) every reused chunk is garbage, and nothing downstream
notices: the prefill still returns logits. So at start-up, in blend mode, an engine runs
a short calibration: each of :data:`CALIBRATION_PROMPTS` (context, a chunk, a question)
is prefilled in full and then with the chunk computed on its own, re-rotated to its
place in the prompt and reused under the configured policy and budget; the two are
compared along the full prefill's greedy answer (teacher-forced): mean KL(full || blend)
and top-1 agreement. First of all, the described rotation of the model's own pre-RoPE K
must reproduce the model's post-RoPE K (:func:`rope_error`): a wrong base or scaling
fails this outright, even where a short prompt's answers would hide it. Above
:class:`GateThresholds` the engine claims exact prefixes only,
logs :meth:`GateVerdict.reason` with the figures and counts every request it would have
blended (``blend_fallbacks``).

The thresholds (``DEFAULT_THRESHOLDS``), measured on SmolLM2-135M with these prompts
(first_k(0.15); docs/results/quality.md, "correctness gate"): its own description gives a
RoPE error of 9.3e-08, KL 0.043 and top-1 0.854 (``none``: KL 0.098, top-1 0.833); a
base 10x too small gives a RoPE error of 0.83, KL 4.0 and top-1 0.19; a linear scaling
of 2 the model does not use gives a RoPE error of 0.84 but KL 0.136 and top-1 0.81 —
the answers alone would let it through, which is why the RoPE check comes first.
This module is engine-agnostic (prompts, the arithmetic, the verdict); each integration
runs the prefills (``integrations/hf/gate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nopecache.client.errors import InvalidArgumentError
from nopecache.kernels.rope_check import relative_error

__all__ = [
    "CALIBRATION_PROMPTS",
    "DEFAULT_THRESHOLDS",
    "ROPE_EPS_MULTIPLE",
    "CalibrationPrompt",
    "GateThresholds",
    "GateVerdict",
    "divergence",
    "judge",
    "rope_error",
]


@dataclass(frozen=True, slots=True)
class CalibrationPrompt:
    """Text before the chunk (an exact prefix), the chunk (reused at a new offset) and the
    question (a miss), each tokenized on its own."""

    context: str
    chunk: str
    question: str


_BACKGROUND = (
    "Some background from my notes, for later. The weather was mild all week and the "
    "garden needed little water. We repainted the fence on Saturday and took the old "
    "bicycle to the repair shop, where they replaced both tyres and the chain. On Sunday "
    "we visited my aunt, who has moved to a smaller flat near the river; she has a "
    "balcony full of tomato plants now and a cat called Pepper that sleeps in the sun. "
    "The school term starts in two weeks, so the children need new shoes and notebooks. "
    "The car is due for its inspection next month, and the dentist appointment moved to "
    "Thursday afternoon. My brother is visiting in the summer with his two dogs, so we "
    "will need to clear the spare room and buy a second bed. The library book about "
    "mountain walks is overdue, and the council collects garden waste on Tuesdays. "
    "At work the new project starts in March; the team is still waiting for the "
    "budget, and the office kitchen is being renovated, so lunch is in the canteen on "
    "the ground floor until April. The neighbours are planning a street party in June "
    "and asked everyone to bring a dish and a folding chair. I want to start running "
    "again in the mornings, perhaps three times a week along the canal path, and to "
    "read more books instead of watching television in the evenings.\n\n"
)

CALIBRATION_PROMPTS: tuple[CalibrationPrompt, ...] = (
    CalibrationPrompt(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        + _BACKGROUND,
        "Harbour notice. The ferry to Marrow Island leaves from pier 6 at a quarter past "
        "eight every morning, and the crossing takes forty minutes. Tickets are sold on "
        "board by the purser, Agnes Whitlock, who also keeps the lost property.\n\n",
        "Question: Who sells the tickets on the ferry?<|im_end|>\n<|im_start|>assistant\n",
    ),
    CalibrationPrompt(
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n" + _BACKGROUND,
        "Team page. The data team is led by Oskar Brandt. It maintains the reporting "
        "dashboards, the weekly sales forecast and the customer database, and it meets "
        "every Thursday in the Juniper room.\n\n",
        "Question: Who leads the data team?<|im_end|>\n<|im_start|>assistant\n",
    ),
    CalibrationPrompt(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        + _BACKGROUND,
        'Tool output from weather.get(city="Bergen"):\n{"city": "Bergen", '
        '"temperature_c": 11, "condition": "rain", "wind_kmh": 32, "sunset": "21:47"}\n\n',
        "Question: What is the temperature in Bergen?<|im_end|>\n<|im_start|>assistant\n",
    ),
)
"""Built-in calibration prompts (ChatML text; a tokenizer without those special tokens
reads them as plain text, which still measures reuse). The chunk lands after a ~400-token
context: a RoPE description that is wrong by a scaling factor moves a chunk by a share
of its offset, which a short context would hide."""

ANSWER_TOKENS = 16
"""Greedy answer tokens of the full prefill compared per prompt."""


@dataclass(frozen=True, slots=True)
class GateThresholds:
    """Blend is refused when the mean KL is above ``max_kl`` or top-1 below ``min_top1``."""

    max_kl: float = 0.5
    min_top1: float = 0.6
    max_rope_error: float = 1e-3
    """Largest error of the described rotation against the model's own post-RoPE K,
    relative to the largest |K| (a right description is at fp32 rounding, ~1e-6)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_rope_error, bool) or not isinstance(
            self.max_rope_error, int | float
        ):
            raise InvalidArgumentError(
                "max_rope_error", f"must be a number >= 0, got {self.max_rope_error!r}"
            )
        if not self.max_rope_error >= 0:
            raise InvalidArgumentError(
                "max_rope_error", f"must be >= 0, got {self.max_rope_error!r}"
            )
        if isinstance(self.max_kl, bool) or not isinstance(self.max_kl, int | float):
            raise InvalidArgumentError("max_kl", f"must be a number >= 0, got {self.max_kl!r}")
        if not self.max_kl >= 0:
            raise InvalidArgumentError("max_kl", f"must be >= 0, got {self.max_kl!r}")
        if isinstance(self.min_top1, bool) or not isinstance(self.min_top1, int | float):
            raise InvalidArgumentError("min_top1", f"must be in [0, 1], got {self.min_top1!r}")
        if not 0.0 <= self.min_top1 <= 1.0:
            raise InvalidArgumentError("min_top1", f"must be in [0, 1], got {self.min_top1!r}")

    def for_dtype(self, dtype: torch.dtype) -> GateThresholds:
        """These thresholds for a model computing in ``dtype``: the RoPE error allowed is at
        least ``ROPE_EPS_MULTIPLE`` x the dtype's epsilon, since a 16-bit model's own
        rotation rounds K (SmolLM2 in bf16: 5.5e-03 against an fp32 description; a
        wrong base or scaling measures 0.8-1.3)."""
        floor = ROPE_EPS_MULTIPLE * torch.finfo(dtype).eps
        if self.max_rope_error >= floor:
            return self
        return GateThresholds(self.max_kl, self.min_top1, floor)


ROPE_EPS_MULTIPLE = 4.0
"""The RoPE error a model's own rounding may reach, in epsilons of its dtype."""

DEFAULT_THRESHOLDS = GateThresholds()


@dataclass(frozen=True, slots=True)
class GateVerdict:
    """What the calibration measured, and whether blend mode may run."""

    policy: str
    kl: float
    """Mean KL(full || blend) over every compared answer token."""
    top1: float
    """Share of the answer tokens where blend's argmax is the full prefill's."""
    tokens: int
    """Answer tokens compared."""
    prompts: int
    thresholds: GateThresholds
    rope_error: float = 0.0
    """Largest error of the described rotation of the model's own pre-RoPE K against its
    post-RoPE K, relative to the largest |K|."""

    @property
    def passed(self) -> bool:
        """True when the RoPE description reproduces the model's K and blend keeps the
        answers within the thresholds."""
        t = self.thresholds
        return (
            self.rope_error <= t.max_rope_error and self.kl <= t.max_kl and self.top1 >= t.min_top1
        )

    def reason(self) -> str:
        """One line for the log: the figures against the thresholds."""
        t = self.thresholds
        verdict = "passed" if self.passed else "refused: prefix mode only"
        return (
            f"blend correctness gate {verdict} ({self.policy}, {self.prompts} prompts, "
            f"{self.tokens} answer tokens): RoPE error {self.rope_error:.2e} "
            f"(max {t.max_rope_error:g}), KL {self.kl:.4f} (max {t.max_kl:g}), "
            f"top-1 {self.top1:.3f} (min {t.min_top1:g})"
        )


def divergence(full: torch.Tensor, blend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL(full || blend) and top-1 agreement ``[n]`` of two teacher-forced
    log-probability tensors ``[n, vocab]``."""
    if full.shape != blend.shape or full.dim() != 2:
        raise InvalidArgumentError(
            "blend", f"shape {tuple(blend.shape)} must equal full's {tuple(full.shape)} [n, vocab]"
        )
    full, blend = full.float(), blend.float()
    kl = (full.exp() * (full - blend)).sum(-1).clamp_min(0.0)
    return kl, full.argmax(-1) == blend.argmax(-1)


def rope_error(described: torch.Tensor, model: torch.Tensor) -> float:
    """Largest |described - model| over the largest |model| of two post-RoPE K tensors
    (``kernels.rope_check.relative_error``, the start-up RoPE check's measure)."""
    if described.shape != model.shape:
        raise InvalidArgumentError(
            "described", f"shape {tuple(described.shape)} != the model's {tuple(model.shape)}"
        )
    return relative_error(described, model)


def judge(
    policy: str,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    thresholds: GateThresholds = DEFAULT_THRESHOLDS,
    *,
    rope: float = 0.0,
) -> GateVerdict:
    """The verdict on ``pairs`` of (full, blend) log-probabilities, one pair per prompt,
    and ``rope`` (the :func:`rope_error` measured)."""
    if not pairs:
        raise InvalidArgumentError("pairs", "the gate needs at least one calibration prompt")
    kls, agree = zip(*(divergence(f, b) for f, b in pairs), strict=True)
    kl, top1 = torch.cat(kls), torch.cat(agree)
    return GateVerdict(
        policy,
        float(kl.mean()),
        float(top1.float().mean()),
        int(kl.numel()),
        len(pairs),
        thresholds,
        rope,
    )
