"""nopecache inside vLLM: two vLLM engines share a system prompt's KV at another position.

``make demo`` (or ``NOPECACHE_VLLM_MODEL=<model folder> .venv-vllm/bin/python
examples/demo_vllm.py [--quick]``) runs, on the CPU::

    demo (this process)
      |-- nopecache server    python -m nopecache.cache_server, CPU tier, 127.0.0.1:<free>
      |-- vLLM engine 1       connector in prefix mode: a chat whose system prompt sits at
      |                       position 0; prefill, answer, store its KV
      '-- vLLM engine 2       connector with pi_reuse="blend": an uploaded report comes
                              first, so the system prompt lands at ~600, where a prefix
                              cache misses

1. Both engines start (side by side). Engine 2 answers its prompt while the server holds
   nothing: time to first token and answer without the cache (its lookup misses).
2. Engine 1 answers its chat; its KV lands on the server.
3. Engine 2 answers the same prompt again: the connector claims up to the last block
   boundary inside the system prompt, places the system prompt's KV re-rotated to its new
   positions, runs the layer loop for the report (misses) and the policy's share of the
   reused tokens, and vLLM computes the rest. TTFT counts lookup, fetch and all that.

The engines run SmolLM2-135M-Instruct (bf16, vLLM's CPU build, its own prefix cache off)
and share nothing but the server. Server and engines are stopped at the end, on an error
and on Ctrl-C. Exit status 0 when both engines answered and engine 2 reused cached
tokens, 1 otherwise (130 on Ctrl-C). The last line is machine-readable:
``DEMO key=value ...``.

Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the demo
alone stops everything in any phase (server start-up, vLLM start-up, generation, storing)
within ``2 * STOP_GRACE_S`` (20 s) plus the processes' own exit:

    the demo         the first signal raises KeyboardInterrupt; later ones are ignored,
                     and one that comes during a stop is handled after it, so nothing
                     cuts a stop halfway
    engines          each leads its own process group (vLLM's engine-core process below
                     it included), which the terminal's SIGINT does not reach; the demo
                     SIGTERMs both groups at once and SIGKILLs what is left after
                     STOP_GRACE_S (tests/support/proc_groups.py)
    server           SIGTERM (it already has the terminal's SIGINT), SIGKILL after
                     STOP_GRACE_S
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The engine processes are the ones the vLLM tests and benchmarks drive.
sys.path.insert(0, str(ROOT))

from _demo_scenario import (  # noqa: E402
    LONG_SYSTEM_PROMPT,
    ChatPrompt,
    print_answers,
    scenario_prompt,
    wrap_answer,
)
from _demo_server import DemoError, embedded_server  # noqa: E402

from nopecache.recompute.policies import DEFAULT_BUDGET, DEFAULT_POLICY_NAME  # noqa: E402
from tests.support.engine_proc import EngineConfig, EngineError, EngineProc, stop_all  # noqa: E402
from tests.support.machine import require_memory  # noqa: E402
from tests.support.proc_groups import interrupt_on_signals, stop_groups, stopping  # noqa: E402
from tests.support.server_procs import wait_stored  # noqa: E402

IM_START = 1  # SmolLM2's <|im_start|>: each chat message is a segment
# The transformers demo's second question, put so that SmolLM2-135M finds the form.
QUESTION_2 = "My suitcase was lost on the train. Which form do I use to report it?"
_COUNTERS = ("loaded_exact_tokens", "loaded_pi_tokens", "blend_miss_tokens")
_LAYER_COUNTERS = ("pi_token_layers", "recomputed_token_layers", "blend_fallbacks")


@dataclass(frozen=True, slots=True)
class Run:
    """Engine 2's prompt answered once: TTFT, the answer, the connector's counters."""

    ttft_s: float
    answer: str
    counters: dict[str, float]
    claimed: int  # tokens the request took from the cache


def _counters(engine: EngineProc) -> dict[str, float]:
    metrics = engine.metrics()
    return {k: metrics.get(f"vllm:nopecache_{k}", 0.0) for k in _COUNTERS + _LAYER_COUNTERS}


def answer_prompt(engine: EngineProc, prompt: ChatPrompt, new_tokens: int) -> Run:
    """The greedy answer; its TTFT is vLLM's own (arrival to first token: lookup, fetch,
    placement, layer loop and forward)."""
    before = _counters(engine)
    out = engine.generate(list(prompt.tokens), max_tokens=new_tokens)
    after = _counters(engine)
    ttft = out["ttft"] if out["ttft"] is not None else out["seconds"]
    return Run(
        float(ttft),
        str(out["text"]).strip(),
        {k: after[k] - before[k] for k in after},
        int(out["cached"]),
    )


@contextmanager
def engines(
    model: str, address: str, workdir: Path, policy: str, budget: float
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """Engine 1 (prefix mode, stores) and engine 2 (blend, reads only), built side by side.

    Both are stopped on the way out; on an interrupt both process groups get SIGTERM at
    once (SIGKILL after a grace), so an engine still loading its model or generating
    does not finish that before it quits.
    """
    url = f"nopecache://{address}"
    seg = {"url": url, "segment_token_ids": [IM_START]}
    blend = {"pi_reuse": "blend", "recompute_policy": policy, "recompute_budget": budget}
    procs = [
        EngineProc(EngineConfig(model=model, connector=seg), workdir / "engine-1.log"),
        EngineProc(
            EngineConfig(model=model, connector={**seg, **blend, "save": False}),
            workdir / "engine-2.log",
        ),
    ]
    interrupted = False
    require_memory(len(procs))  # a clear error, not an engine OOM-killed halfway
    try:
        for n, proc in enumerate(procs, 1):
            proc.launch()
            _say(
                n,
                f"pid {proc.pid}, core {proc.cpu}: vLLM is loading SmolLM2-135M-Instruct "
                f"(log: {proc.log_path})",
            )
        for n, proc in enumerate(procs, 1):
            proc.wait_ready()
            proc.generate(proc.chat([{"role": "user", "content": "Hello!"}]), max_tokens=2)
            _say(n, "ready")
        yield procs[0], procs[1]
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        with stopping():
            if interrupted:
                stop_groups([proc.group() for proc in procs if proc.proc is not None])
            # Without an interrupt: each engine quits when its stdin closes; 30 s only
            # bounds a vLLM shutdown on a loaded machine (a few seconds idle).
            stop_all(procs, timeout_s=30)


def _say(engine: int, line: str) -> None:
    print(f"  [engine {engine}] {line}", flush=True)


def _sizes(prompt: ChatPrompt) -> str:
    parts = " + ".join(f"{n} {t}" for n, t in prompt.sizes())
    return f"{len(prompt.tokens)} tokens = {parts}"


def play(
    model: str, workdir: Path, args: argparse.Namespace, tokenizer: Any
) -> tuple[dict[str, Any], int]:
    """Run the scenario against a fresh server; the DEMO fields and engine 2's reuse."""
    prompt_1 = scenario_prompt(tokenizer, 1, system=LONG_SYSTEM_PROMPT)
    prompt_2 = scenario_prompt(
        tokenizer, 2, args.quick, system=LONG_SYSTEM_PROMPT, question=QUESTION_2
    )
    print("starting the nopecache server (CPU tier)", flush=True)
    with embedded_server(workdir) as (address, server_pid):
        print(f"server pid {server_pid} listening on {address}", flush=True)
        with engines(model, address, workdir, args.policy, args.budget) as (one, two):
            _say(2, f"prompt: {_sizes(prompt_2)}")
            _say(2, "the server holds nothing yet: answering without the cache")
            cold = answer_prompt(two, prompt_2, args.max_new_tokens)
            _say(2, f"time to first token without the cache: {cold.ttft_s * 1e3:.0f} ms")
            _say(1, f"prompt: {_sizes(prompt_1)}")
            first = one.generate(list(prompt_1.tokens), max_tokens=args.max_new_tokens)
            stored = wait_stored(address)
            _say(1, f"answered; the server now holds {stored} blocks of its KV")
            warm = answer_prompt(two, prompt_2, args.max_new_tokens)
            _say(2, f"time to first token with the cache: {warm.ttft_s * 1e3:.0f} ms")
            pids = (one.pid, two.pid)
    fields = summary(prompt_1, prompt_2, str(first["text"]).strip(), cold, warm, args)
    fields.update(server_pid=server_pid, engine_pids=f"{pids[0]},{pids[1]}")
    c = warm.counters
    return fields, int(c["loaded_exact_tokens"] + c["loaded_pi_tokens"])


def summary(
    prompt_1: ChatPrompt,
    prompt_2: ChatPrompt,
    answer_1: str,
    cold: Run,
    warm: Run,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Print what the cache did for engine 2; the DEMO line's fields."""
    c = warm.counters
    exact, pi = int(c["loaded_exact_tokens"]), int(c["loaded_pi_tokens"])
    misses = int(c["blend_miss_tokens"])
    share = c["recomputed_token_layers"] / c["pi_token_layers"] if c["pi_token_layers"] else 0.0
    vllm_computed = len(prompt_2.tokens) - exact - pi - misses
    print()
    print("=" * 100)
    print(f"engine 1: {len(prompt_1.tokens)} prompt tokens, system prompt at position 0")
    print("  answer:")
    print(wrap_answer(answer_1))
    parts = ", ".join(f"{name} {n}" for name, n in prompt_2.sizes())
    print(f"engine 2: {len(prompt_2.tokens)} prompt tokens ({parts})")
    print(f"  reused, exact prefix:          {exact:5d} tokens  (lossless)")
    print(f"  reused, position-independent:  {pi:5d} tokens  (re-rotated to new positions)")
    print(
        f"  recomputed of those:           {share:6.1%} of their token-layers "
        f"(policy {args.policy}, budget {args.budget})"
    )
    print(f"  computed in the blend loop:    {misses:5d} tokens  (misses inside the claim)")
    print(f"  computed by vLLM after it:     {vllm_computed:5d} tokens")
    if c["blend_fallbacks"]:
        print(f"  blend fell back to prefix claims {c['blend_fallbacks']:.0f} times (see the log)")
    speedup = cold.ttft_s / warm.ttft_s
    print(f"  time to first token, no cache: {cold.ttft_s * 1e3:7.0f} ms")
    print(
        f"  time to first token, cache:    {warm.ttft_s * 1e3:7.0f} ms  "
        f"(lookup and fetch included; {speedup:.2f}x)"
    )
    same = print_answers(warm.answer, cold.answer)
    return {
        "reused_exact": exact,
        "reused_pi": pi,
        "recompute_fraction": f"{share:.3f}",
        "blend_misses": misses,
        "ttft_cached_ms": f"{warm.ttft_s * 1e3:.0f}",
        "ttft_nocache_ms": f"{cold.ttft_s * 1e3:.0f}",
        "same_answer": "yes" if same else "no",
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The demo's options (bad values exit with status 2 and a message)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="vLLM model folder ($NOPECACHE_VLLM_MODEL)")
    parser.add_argument("--quick", action="store_true", help="shorter report and answers")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="answer length")
    parser.add_argument("--policy", default=DEFAULT_POLICY_NAME, help="recompute policy")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="recompute budget")
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 40
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    args.model = args.model or os.environ.get("NOPECACHE_VLLM_MODEL")
    if not args.model or not (Path(args.model) / "config.json").is_file():
        parser.error(
            "--model (or $NOPECACHE_VLLM_MODEL) must name the converted SmolLM2 folder; "
            "`make demo` sets it up"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; the exit status."""
    interrupt_on_signals()  # Ctrl-C and SIGTERM end the demo through the cleanup
    args = parse_args(argv)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with tempfile.TemporaryDirectory(prefix="nopecache-vllm-demo-") as tmp:
            fields, reused = play(args.model, Path(tmp), args, tokenizer)
    except (DemoError, EngineError, RuntimeError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted; server and engines stopped", file=sys.stderr)
        return 130
    print("DEMO " + " ".join(f"{k}={v}" for k, v in fields.items()))
    if reused == 0:
        print("demo failed: engine 2 reused no cached tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
