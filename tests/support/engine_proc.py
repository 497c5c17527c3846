"""A real vLLM engine in a child process, driven by JSON lines (for tests and benchmarks).

``EngineProc(config).start()`` runs this file as a script in the vLLM environment: it
builds ``vllm.LLM`` from the config and answers one JSON command per line on stdin with
one JSON line on a private pipe (vLLM's own logs go to a log file). Commands:

    {"op": "chat", "messages": [...]}            -> {"ids": [...]}  (chat template applied)
    {"op": "generate", "prompts": [[ids] | "text"], "max_tokens": n, "prompt_logprobs": k | null,
     "logprobs": k | null, "skip_reading_prefix_cache": bool | null,
     "identities": [{"lora": path | null, "cache_salt": s | null, "image_seed": n | null,
                     "image_size": [w, h]}] | null}
        -> {"outputs": [{"ids", "text", "cached", "ttft", "prompt_logprobs", "logprobs",
                         "prompt_ids"}],
            "seconds": s}   (ttft: vLLM's own time to first token of the request, seconds)
    {"op": "metrics"}                            -> {"vllm:...": value}  (counters summed;
                                                    a histogram as "<name>:count", ":sum")

``identities`` (one per prompt, see :class:`Identity`) gives each request the inputs
besides its tokens that vLLM folds into its block hashes: a LoRA adapter (a PEFT folder,
named by its folder's name, one ``LoRARequest`` id per folder for the engine's life), a ``cache_salt``, and an image
(seeded noise built by :func:`seeded_image`, sent as ``multi_modal_data``). A text prompt
(a string) lets the model's processor expand its image placeholder.

CPU settings every engine shares (so every run does the same arithmetic): one OpenMP
thread bound to one core (``VLLM_CPU_OMP_THREADS_BIND=<core>``: any KV connector reserves
a core and would change the thread count, which changes bf16 results), 1 GiB of KV cache,
offline, eager mode. The core is the config's ``cpu``, or else the next one round robin
over the cores this process may use (:func:`tests.support.machine.core_for`): engines
spread over the machine instead of sharing core 0. :attr:`EngineProc.cpu` says which.
A tensor-parallel engine (``tensor_parallel`` > 1) runs one worker per rank, rank ``r``
bound to the ``r``-th core from there (``VLLM_CPU_OMP_THREADS_BIND="a|b"``, vLLM's
per-rank form); :attr:`EngineProc.cpus` lists them.

Each engine leads a process group of its own, which vLLM's engine-core process joins:
:meth:`EngineProc.stop` (and a demo's Ctrl-C, through :meth:`EngineProc.group`) stops the
whole group within a bound, and a terminal's Ctrl-C reaches only the parent, which
decides how its engines stop.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.machine import allowed_cores, core_for
from tests.support.proc_groups import Group, stop_groups

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
_START_TIMEOUT_S = 240.0
_launches = itertools.count()  # engines launched by this process without a fixed core


@dataclass(frozen=True)
class EngineConfig:
    """How to build the engine: model folder, dtype, prefix caching, connector settings."""

    model: str
    dtype: str = "bfloat16"
    prefix_caching: bool = False
    connector: dict[str, Any] | None = None  # kv_connector_extra_config; None: no connector
    max_model_len: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)
    # Another connector than nopecache's (a peer, for benchmarks), and its environment.
    connector_class: str = "NopecacheConnector"
    connector_module: str | None = "nopecache.integrations.vllm"
    env: dict[str, str] = field(default_factory=dict)
    cpu: int | None = None  # the core its OpenMP thread binds to; None: round robin
    tensor_parallel: int = 1  # tensor_parallel_size: one worker process per rank


@dataclass(frozen=True)
class Identity:
    """What a request carries besides its tokens: adapter, cache salt, image (None: none)."""

    lora: str | None = None  # a PEFT adapter folder (tests/support/lora.py writes them)
    cache_salt: str | None = None
    image_seed: int | None = None  # seeded noise image of ``image_size`` pixels
    image_size: tuple[int, int] = (56, 56)

    def label(self) -> str:
        """A short name for messages: ``lora=a salt=s1 image=3``."""
        lora = None if self.lora is None else Path(self.lora).name
        return f"lora={lora} salt={self.cache_salt} image={self.image_seed}"


def seeded_image(seed: int, size: tuple[int, int]) -> Any:
    """An RGB PIL image of seeded uniform noise (same seed, same pixels)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


EngineFactory = Callable[..., "EngineProc"]
"""The ``engines`` fixture: ``engines(dtype=..., connector=...)`` starts an EngineProc."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two prompts share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class EngineError(RuntimeError):
    """The engine process failed or answered with an error."""


class EngineExited(EngineError):
    """The engine process exited (its answer pipe closed): the message has its exit code
    and the end of its log. Raised as soon as it happens, not after a timeout."""


class EngineProc:
    """Parent side: start the engine, send commands, read answers, stop it."""

    def __init__(self, config: EngineConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.cpu: int | None = config.cpu  # the core it was given, once launched
        self.cpus: list[int] = []  # every rank's core, once launched
        self._answers: Any = None

    def start(self) -> EngineProc:
        """Start the child and wait until its engine is built (raises EngineError)."""
        return self.launch().wait_ready()

    def launch(self) -> EngineProc:
        """Start the child without waiting (several engines then build side by side)."""
        if self.cpu is None:
            self.cpu = core_for(next(_launches))
        first = allowed_cores().index(self.cpu) if self.cpu in allowed_cores() else 0
        self.cpus = [self.cpu] + [
            core_for(first + r) for r in range(1, self.config.tensor_parallel)
        ]
        read_fd, write_fd = os.pipe()
        env = {
            **os.environ,
            **ENGINE_ENV,
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, self.cpus)),
            **self.config.env,
            "NOPECACHE_ENGINE_FD": str(write_fd),
        }
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps(asdict(self.config))],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(write_fd,),
            process_group=0,  # see the module's docstring
        )
        os.close(write_fd)
        log.close()
        self._answers = os.fdopen(read_fd, "r")
        return self

    def wait_ready(self) -> EngineProc:
        """Wait until a launched child's engine is built (raises EngineError)."""
        try:
            self._read(_START_TIMEOUT_S)
        except EngineExited:
            raise  # its code and log are in the message already
        except EngineError as err:
            raise EngineError(
                f"{err}{self._exit_note()}\n--- engine log ---\n{self.log_tail()}"
            ) from None
        return self

    def _exit_note(self) -> str:
        """ ", exit code N" once a child that reported a start-up failure has exited (it
        re-raises right after answering); nothing if it still runs after a bound."""
        assert self.proc is not None
        # The child only unwinds its interpreter: seconds; the bound guards against a hang.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        code = self.proc.returncode
        return "" if code is None else f" (the engine process exited with code {code})"

    def _read(self, timeout_s: float) -> Any:
        assert self.proc is not None
        line = self._answers.readline()
        if not line:
            self.proc.wait(timeout=timeout_s)
            raise EngineExited(
                f"the engine process exited with code {self.proc.returncode}:\n{self.log_tail()}"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise EngineError(answer["error"])
        return answer

    def call(self, op: str, **args: Any) -> Any:
        """Send one command and return its answer."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(_START_TIMEOUT_S)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, with the generation prompt."""
        ids: list[int] = self.call("chat", messages=messages)["ids"]
        return ids

    def generate(
        self,
        prompt: list[int],
        max_tokens: int = 16,
        prompt_logprobs: int | None = None,
        skip_reading_prefix_cache: bool | None = None,
        identity: Identity | None = None,
    ) -> dict[str, Any]:
        """Greedy generation of one prompt: ids, text, cached tokens, seconds (and logprobs).

        vLLM reads no cache (its own nor the connector's) for a request that asks for
        prompt logprobs unless ``skip_reading_prefix_cache=False``. Then only the tokens
        after the first computed position get prompt logprobs (vLLM leaves the others
        unwritten; here they are None) and the output is not detokenized (text "").
        """
        answer = self.call(
            "generate",
            prompts=[prompt],
            max_tokens=max_tokens,
            prompt_logprobs=prompt_logprobs,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            identities=None if identity is None else [asdict(identity)],
        )
        out: dict[str, Any] = answer["outputs"][0]
        out["seconds"] = answer["seconds"]
        return out

    def generate_many(
        self,
        prompts: list[list[int]] | list[str] | list[list[int] | str],
        max_tokens: int = 1,
        logprobs: int | None = None,
        identities: list[Identity] | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy generation of a batch of prompts (one ``LLM.generate`` call), each with
        its own :class:`Identity` when ``identities`` is given (one per prompt)."""
        if identities is not None:
            assert len(identities) == len(prompts), "one identity per prompt"
        answer = self.call(
            "generate",
            prompts=prompts,
            max_tokens=max_tokens,
            logprobs=logprobs,
            identities=None if identities is None else [asdict(i) for i in identities],
        )
        outputs: list[dict[str, Any]] = answer["outputs"]
        return outputs

    def metrics(self) -> dict[str, float]:
        """vLLM's counters (``vllm:*``), the connector's included."""
        metrics: dict[str, float] = self.call("metrics")
        return metrics

    def log_tail(self, n: int = 4000) -> str:
        """The end of the engine's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        """The child's pid (None before launch and after stop)."""
        return None if self.proc is None else self.proc.pid

    def group(self) -> Group:
        """The engine's process group, for :func:`~tests.support.proc_groups.stop_groups`."""
        proc = self.proc
        assert proc is not None

        def reap(timeout_s: float | None) -> bool:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
            return proc.returncode is not None

        return Group(proc.pid, reap)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to quit (its stdin closes); then stop its process group: SIGTERM,
        SIGKILL after a grace (see :mod:`tests.support.proc_groups`). The group stop also
        ends what vLLM left below an engine that quit."""
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
        stop_groups([self.group()])
        if self._answers is not None:
            self._answers.close()
        self.proc = None


def stop_all(procs: list[EngineProc], timeout_s: float = 30.0) -> None:
    """Stop several engines at once: every one is asked to quit before any is waited for
    (an engine takes seconds to shut down)."""
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None and proc.proc.stdin is not None:
            with contextlib.suppress(OSError):  # it died meanwhile: stop() reaps it
                proc.proc.stdin.close()
    for proc in procs:
        proc.stop(timeout_s)


# -- child side ---------------------------------------------------------------------------
def _build(config: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if config["connector"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=config["connector_class"],
            kv_connector_module_path=config["connector_module"],
            kv_role="kv_both",
            kv_connector_extra_config=config["connector"],
        )
    extra = dict(config["extra"])
    if "kv_events_config" in extra:  # JSON in the config: vLLM's own type here
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(**extra["kv_events_config"])
    return LLM(
        model=config["model"],
        dtype=config["dtype"],
        enforce_eager=True,
        enable_prefix_caching=config["prefix_caching"],
        max_model_len=config["max_model_len"],
        tensor_parallel_size=config["tensor_parallel"],
        disable_log_stats=False,
        seed=0,
        **kwargs,
        **extra,
    )


def _logprobs(entries: Any, cached: int = -1) -> list[dict[str, float] | None] | None:
    """Token -> logprob per position; None where vLLM computed nothing.

    For prompt logprobs, entry ``j`` is the distribution of token ``j`` given the tokens
    before it, computed at position ``j - 1``: with ``cached`` tokens read from a cache the
    first one computed is ``cached + 1`` (entries up to ``cached`` are None). Sampled
    logprobs (one entry per generated token) pass ``cached=-1``: all of them are real.
    """
    if entries is None:
        return None
    return [
        None if e is None or j <= cached else {str(tok): lp.logprob for tok, lp in e.items()}
        for j, e in enumerate(entries)
    ]


_lora_ids: dict[str, int] = {}  # adapter folder -> its LoRARequest id (stable per engine)


def _prompts(command: dict[str, Any]) -> tuple[list[Any], list[Any] | None]:
    """vLLM prompts and LoRA requests (None: no request has one) for a generate command."""
    from vllm import TextPrompt, TokensPrompt
    from vllm.lora.request import LoRARequest

    identities = command.get("identities") or [None] * len(command["prompts"])
    prompts: list[Any] = []
    loras: list[Any] = []
    for prompt, ident in zip(command["prompts"], identities, strict=True):
        ident = ident or {}
        fields: dict[str, Any] = {}
        if ident.get("cache_salt") is not None:
            fields["cache_salt"] = ident["cache_salt"]
        if ident.get("image_seed") is not None:
            size = tuple(ident["image_size"])
            fields["multi_modal_data"] = {"image": seeded_image(ident["image_seed"], size)}
        if isinstance(prompt, str):
            prompts.append(TextPrompt(prompt=prompt, **fields))  # type: ignore[typeddict-item,unused-ignore]
        else:
            prompts.append(TokensPrompt(prompt_token_ids=prompt, **fields))  # type: ignore[typeddict-item,unused-ignore]
        path = ident.get("lora")
        if path is None:
            loras.append(None)
        else:
            # The name is the folder's: vLLM keys blocks on it, so it must not depend on the
            # order an engine first saw its adapters in (the id is only engine-local).
            lora_id = _lora_ids.setdefault(path, len(_lora_ids) + 1)
            loras.append(LoRARequest(Path(path).name, lora_id, path))
    return prompts, (loras if any(x is not None for x in loras) else None)


def _serve(llm: Any, command: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    op = command["op"]
    if op == "chat":
        tok = llm.get_tokenizer()
        ids = tok.apply_chat_template(command["messages"], add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return {"ids": [int(i) for i in ids]}
    if op == "generate":
        params = SamplingParams(
            max_tokens=command["max_tokens"],
            temperature=0.0,
            prompt_logprobs=command.get("prompt_logprobs"),
            logprobs=command.get("logprobs"),
            skip_reading_prefix_cache=command.get("skip_reading_prefix_cache"),
            # Reading a cache with prompt logprobs: vLLM fills the rows of cached tokens
            # with whatever memory held, ids included, which the detokenizer chokes on.
            detokenize=command.get("skip_reading_prefix_cache") is not False,
        )
        prompts, loras = _prompts(command)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "outputs": [
                {
                    "ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "ttft": getattr(o.metrics, "first_token_latency", None),
                    "cached": o.num_cached_tokens,
                    "prompt_logprobs": _logprobs(o.prompt_logprobs, o.num_cached_tokens),
                    "logprobs": _logprobs(o.outputs[0].logprobs),
                    "prompt_ids": list(o.prompt_token_ids or []),
                }
                for o in outs
            ],
        }
    if op == "metrics":
        time.sleep(0.5)  # let the last step's stats reach the frontend
        totals: dict[str, float] = {}
        for metric in llm.get_metrics():
            value = getattr(metric, "value", None)
            if isinstance(value, int | float):
                totals[metric.name] = totals.get(metric.name, 0.0) + float(value)
            elif isinstance(getattr(metric, "count", None), int):  # a histogram
                for part in ("count", "sum"):
                    key = f"{metric.name}:{part}"
                    totals[key] = totals.get(key, 0.0) + float(getattr(metric, part))
        return totals
    raise ValueError(f"unknown op {op!r}")


def _child() -> None:
    fd = int(os.environ.pop("NOPECACHE_ENGINE_FD"))
    os.set_inheritable(fd, False)  # vLLM's own children must not hold the answer pipe
    answers = os.fdopen(fd, "w", buffering=1)
    try:
        llm = _build(json.loads(sys.argv[1]))
    except Exception as err:
        answers.write(json.dumps({"error": f"start-up failed: {type(err).__name__}: {err}"}) + "\n")
        raise
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            answer = _serve(llm, json.loads(line))
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    _child()
