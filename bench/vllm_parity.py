"""Parity at scale: engines reading nopecache answer exactly as a no-cache engine does.

Run in the vLLM environment: ``.venv-vllm/bin/python bench/vllm_parity.py`` (``make bench``
does). The parity harness's traffic (tests/integrations/vllm/engine/test_parity.py,
tests/support/parity_traffic.py) at a larger size, with the server injecting faults into
a share of the blocks it sends (``--faults``, the server's ``--fault-injection`` syntax):

    ref, vlm-ref   no connector: the reference output of every request
    e1             connector, stores: prompt i under identity i (none, adapter A, adapter
                   B, salt s1, adapter A + salt s1)
    e2             connector, serves: the same prompts under the identities moved on, plus
                   a salt nothing stored; all of a round in flight at once
    vlm            connector on the tiny SmolVLM-shaped model: same-size images stored,
                   then served again beside images never seen (identical token ids)

Every engine is fp32, greedy, one OpenMP thread (tests/support/engine_proc.py). Each round
takes a new system prompt, so its stores are fresh. A mismatch is an output of e2 or vlm
that is not token for token the reference's for the same prompt and identity.

Last line: ``RESULT parity_requests=... mismatches=... faults_injected=...
skipped_requests=...`` (``skipped_requests``: ``vllm:nopecache_requests_skipped`` summed
over the connector engines, requests the connector could not key and left alone). The
exit status is 1 when ``mismatches`` is not 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _vllm_procs import bench_processes  # noqa: E402

from tests.support.connector_prompts import PIP_FACTS  # noqa: E402
from tests.support.engine_proc import EngineConfig, EngineProc, Identity  # noqa: E402
from tests.support.fault_servers import start_fault_server  # noqa: E402
from tests.support.lora import write_adapter  # noqa: E402
from tests.support.parity_traffic import (  # noqa: E402
    Request,
    identities,
    run_round,
    serve_round,
    store_round,
)
from tests.support.server_procs import wait_stored  # noqa: E402
from tests.support.tiny_vlm import IMAGE_SIZE, write_tiny_vlm  # noqa: E402

# The RESULT line's keys, in order (:func:`result_line` prints them). The quick run's traffic
# and RESULT line are checked on test_parity.py's engines
# (tests/integrations/vllm/engine/test_parity.py::test_the_bench_quick_run_matches_the_reference),
# which start the same three configurations: test_bench_quick.py skips this bench for that.
RESULT_KEYS = ("parity_requests", "mismatches", "faults_injected", "skipped_requests")

FAULTS = "seed=7,rate=0.3,kinds=flip,truncate,drop,delay"
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
MAX_TOKENS = 8
_TOPICS = ["day pass", "bike", "night train", "lost property", "refund", "quiet carriage"]
_ASKS = ["How much is the {}?", "Tell me about the {}.", "Any rules for the {}?", "{}?"]


@dataclass(frozen=True)
class Size:
    """Rounds (a new system prompt each), questions per round, images per round."""

    rounds: int = 4
    questions: int = 24
    images: int = 6


QUICK = Size(rounds=1, questions=6, images=2)


def _questions(n: int) -> list[str]:
    """``n`` distinct questions."""
    return [
        _ASKS[(i // len(_TOPICS)) % len(_ASKS)].format(_TOPICS[i % len(_TOPICS)]) + f" ({i})"
        for i in range(n)
    ]


def _mismatches(requests: list[Any], outs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> int:
    """Outputs that are not the reference's, each printed."""
    bad = 0
    for r, o, ref in zip(requests, outs, refs, strict=True):
        if o["ids"] != ref["ids"]:
            bad += 1
            label = r.label() if isinstance(r, Request) else str(r)
            print(f"MISMATCH {label}: {o['ids']} != {ref['ids']} (cached {o['cached']})")
    return bad


def _run(engine: EngineProc, requests: list[Request]) -> list[dict[str, Any]]:
    return run_round(engine, requests, MAX_TOKENS)


def text_traffic(
    procs: dict[str, EngineProc], address: str, adapters: tuple[str, str], size: Size
) -> tuple[int, int]:
    """Every round: e1 stores, e2 serves under other identities; (requests, mismatches)."""
    ref, e1, e2 = procs["ref"], procs["e1"], procs["e2"]
    stored_ids = identities(*adapters)
    requests = bad = 0
    for rnd in range(size.rounds):
        system = {"role": "system", "content": f"Round {rnd}. " + PIP_FACTS * 3}
        prompts = [
            ref.chat([system, {"role": "user", "content": q}]) for q in _questions(size.questions)
        ]
        stored = store_round(prompts, stored_ids)
        served = serve_round(prompts, stored_ids, shift=1 + rnd % (len(stored_ids) - 1))
        e1_outs = _run(e1, stored)
        bad += _mismatches(stored, e1_outs, _run(ref, stored))
        wait_stored(address, at_least=1)
        bad += _mismatches(served, _run(e2, served), _run(ref, served))
        requests += len(stored) + len(served)
        print(
            f"round {rnd}: {len(stored) + len(served)} requests, {bad} mismatches so far",
            flush=True,
        )
    return requests, bad


def skipped_requests(engines: list[EngineProc]) -> float:
    """``vllm:nopecache_requests_skipped`` summed over ``engines`` (0 for one without the
    connector): requests the connector could not key and left alone."""
    return sum(e.metrics().get("vllm:nopecache_requests_skipped", 0.0) for e in engines)


def result_line(requests: int, mismatches: int, faults: int, skipped: float) -> str:
    """The bench's last line, keys in the order of ``RESULT_KEYS``."""
    return (
        f"RESULT parity_requests={requests} mismatches={mismatches} "
        f"faults_injected={faults} skipped_requests={int(skipped)}"
    )


def image_traffic(procs: dict[str, EngineProc], address: str, size: Size) -> tuple[int, int]:
    """Same-size images stored, then served beside unseen ones; (requests, mismatches)."""
    ref, vlm = procs["vlm-ref"], procs["vlm"]
    prompt = "<image>" + " Describe the picture in words." * 30
    requests = bad = 0
    for rnd in range(size.rounds):
        seeds = [rnd * 2 * size.images + i for i in range(2 * size.images)]
        first = [
            Identity(image_seed=s, image_size=(IMAGE_SIZE, IMAGE_SIZE))
            for s in seeds[: size.images]
        ]
        mixed = [Identity(image_seed=s, image_size=(IMAGE_SIZE, IMAGE_SIZE)) for s in seeds[::-1]]
        for batch in (first, mixed):
            outs = vlm.generate_many([prompt] * len(batch), max_tokens=MAX_TOKENS, identities=batch)
            refs = ref.generate_many([prompt] * len(batch), max_tokens=MAX_TOKENS, identities=batch)
            bad += _mismatches([i.label() for i in batch], outs, refs)
            requests += len(batch)
            wait_stored(address, at_least=1)
    return requests, bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="vLLM model folder ($NOPECACHE_VLLM_MODEL)")
    parser.add_argument("--faults", default=FAULTS, help="the server's --fault-injection spec")
    parser.add_argument("--quick", action="store_true", help="a smoke run (make test): tiny sizes")
    args = parser.parse_args()
    size = QUICK if args.quick else Size()
    model = args.model or os.environ.get("NOPECACHE_VLLM_MODEL")
    if not model:
        sys.exit("set NOPECACHE_VLLM_MODEL (make bench does) or pass --model")
    work = Path(tempfile.mkdtemp(prefix="nopecache-vllm-parity-"))
    adapters = (
        str(write_adapter(work / "lora-a", 1, model)),
        str(write_adapter(work / "lora-b", 2, model)),
    )
    vlm_dir = str(write_tiny_vlm(work / "vlm", Path(model)))
    with bench_processes(engines=3) as started:
        # 1 GiB: a 128-token fp32 SmolLM2 block is ~5.9 MB (the default tier is 64 MiB).
        server = start_fault_server(
            args.faults, work / "server", tiers=("cpu://?capacity=1GiB&pinned=no",)
        )
        started.server(server.proc)
        # The lookup bound is a hang guard: a timed-out lookup claims nothing (no parity
        # finding, only a weaker run).
        connector = {"url": f"{server.url}?lookup_timeout=10s"}
        vlm_extra = {"limit_mm_per_prompt": {"image": 1}}
        configs = {
            "ref": EngineConfig(model=model, dtype="float32", extra=LORA),
            "e1": EngineConfig(model=model, dtype="float32", extra=LORA, connector=connector),
            "e2": EngineConfig(model=model, dtype="float32", extra=LORA, connector=connector),
            "vlm-ref": EngineConfig(
                model=vlm_dir, dtype="float32", max_model_len=1024, extra=vlm_extra
            ),
            "vlm": EngineConfig(
                model=vlm_dir,
                dtype="float32",
                max_model_len=1024,
                extra=vlm_extra,
                connector=connector,
            ),
        }
        procs = {n: started.engine(n, EngineProc(c, work / f"{n}.log")) for n, c in configs.items()}
        # Two phases of at most three engines (the text ones, then the image ones): five
        # engines at once need ~16 GiB, more than a shared machine has free. The quick run
        # keeps the text phase only (`make test` runs it on test_parity.py's engines):
        # test_parity.py covers images, and two more engine starts would add minutes to CI
        # for no new check.
        skipped = 0.0
        results = [(0, 0), (0, 0)]
        phases = [
            (("ref", "e1", "e2"), lambda: text_traffic(procs, server.address, adapters, size)),
            (("vlm-ref", "vlm"), lambda: image_traffic(procs, server.address, size)),
        ][: 1 if args.quick else 2]
        for index, (names, traffic) in enumerate(phases):
            for name in names:  # side by side: an engine start is ~30 s
                procs[name].launch()
            started.announce()
            for name in names:
                procs[name].wait_ready()
            results[index] = traffic()
            skipped += skipped_requests([procs[name] for name in names])
            for name in names:
                procs[name].stop()
        (text_requests, text_bad), (image_requests, image_bad) = results
        faults = server.faults_injected()
    mismatches = text_bad + image_bad
    print(result_line(text_requests + image_requests, mismatches, faults, skipped))
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
