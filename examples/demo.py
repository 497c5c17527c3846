"""nopecache end to end: two engine processes share a system prompt's KV through a server.

``make demo`` (or ``python examples/demo.py [--quick]``) runs, on the CPU::

    demo (this process)
      |-- nopecache server       python -m nopecache.cache_server, CPU tier, 127.0.0.1:<free>
      |-- engine 1 process       SmolLM2-135M-Instruct: system prompt at position 0,
      |                          prefill, store KV (prefix + position-independent), answer
      '-- engine 2 process       started after engine 1 exited: an uploaded report comes
                                 first, so the system prompt lands at ~600 where prefix
                                 caching misses; lookup, fetch re-rotated, recompute with
                                 the default policy, answer; compare with no cache

The engines share nothing but the server. The server and the engines are stopped at the
end, on an error and on Ctrl-C. The exit status is 0 when both engines answered and engine
2 reused cached tokens, 1 otherwise (130 on Ctrl-C). The last line is machine-readable:
``DEMO key=value ...``.

Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the demo
alone stops everything in any phase (server start-up, model load, prefill, storing,
generation) within ``2 * STOP_GRACE_S`` (20 s) plus the processes' own exit:

    the demo         the first signal raises KeyboardInterrupt; later ones are ignored,
                     and one that comes during a stop is handled after it, so nothing
                     cuts a stop halfway
    engine process   leads its own process group and ignores SIGINT; the demo SIGTERMs
                     the group, the engine unwinds between two torch ops, and what is
                     still alive after STOP_GRACE_S is SIGKILLed
    server           SIGTERM (it already has the terminal's SIGINT), SIGKILL after
                     STOP_GRACE_S
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from _demo_engine import EngineJob, EngineReport, engine_main
from _demo_scenario import print_answers, wrap_answer
from _demo_server import DemoError, embedded_server

from tests.support.proc_groups import Group, interrupt_on_signals, stop_groups, stopping

# Only a hang guard: an engine's whole job takes ~10 s on an idle machine, minutes on a
# loaded one; the demo waits on the engine's report or its exit, never on this.
_ENGINE_TIMEOUT_S = 900.0
# An engine that sent its report exits at once; on a loaded machine its interpreter's
# teardown (torch's included) may take seconds, so it gets a generous bound.
_ENGINE_EXIT_S = 60.0


def run_engine(job: EngineJob) -> EngineReport:
    """Run one engine in a fresh (spawned) process and return its report.

    However this ends (report, crash, KeyboardInterrupt), the engine's process group is
    stopped before it returns (:func:`~tests.support.proc_groups.stop_groups`).
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    # daemon: should the demo exit without stopping it, multiprocessing SIGTERMs it
    # rather than waiting for its whole job.
    proc = ctx.Process(target=engine_main, args=(job, send), name=f"engine-{job.role}", daemon=True)
    report = None
    try:
        with stopping():  # a signal inside start() would lose the child's pid: held until set
            proc.start()
        send.close()  # only the child writes; EOF then means the child is gone
        report = _receive(receive, proc.sentinel)
        proc.join(timeout=_ENGINE_EXIT_S)
    finally:
        with stopping():
            send.close()
            if proc.pid is not None:
                stop_groups([Group(proc.pid, lambda t: _join(proc, t))])
            receive.close()
    if report is None or proc.exitcode != 0:
        raise DemoError(
            f"engine {job.role} (pid {proc.pid}) failed with exit code {proc.exitcode}; "
            "its error is printed above"
        )
    return report


def _join(proc: multiprocessing.process.BaseProcess, timeout_s: float | None) -> bool:
    """Wait up to ``timeout_s`` for ``proc``; whether it has exited (and was reaped)."""
    proc.join(timeout_s)
    return proc.exitcode is not None


def _receive(conn: Connection, sentinel: int) -> EngineReport | None:
    """The child's report, or None if it exited without sending one."""
    ready = multiprocessing.connection.wait([conn, sentinel], timeout=_ENGINE_TIMEOUT_S)
    if not ready:
        raise DemoError(f"an engine did not finish within {_ENGINE_TIMEOUT_S:.0f} s")
    # A child that exited may have sent its report first; one that crashed left EOF.
    if not conn.poll(0):
        return None
    try:
        report = conn.recv()
    except EOFError:
        return None
    assert isinstance(report, EngineReport)
    return report


def _layer_runs(per_layer: Sequence[int]) -> str:
    """``297 at layers 0-1, 41 at layers 2-29``: runs of layers with equal counts."""
    runs: list[tuple[int, int, int]] = []  # (first layer, last layer, tokens)
    for layer, n in enumerate(per_layer):
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], layer, n)
        else:
            runs.append((layer, layer, n))
    parts = [
        f"{n} at layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}" for a, b, n in runs
    ]
    return ", ".join(parts) if parts else "none"


def print_summary(first: EngineReport, second: EngineReport) -> bool:
    """Print what the cache did for engine 2; True when engine 2's answer is unchanged."""
    parts = ", ".join(f"{name} {n}" for name, n in second.segment_tokens)
    saved = 1 - second.prefill_cached_s / second.prefill_nocache_s
    saved_with_fetch = 1 - (second.prefill_cached_s + second.fetch_s) / second.prefill_nocache_s
    print()
    print("=" * 100)
    print(
        f"engine 1 (pid {first.pid}): {first.prompt_tokens} prompt tokens, stored "
        f"{first.stored_blocks} blocks"
    )
    print("  answer:")
    print(wrap_answer(first.answer))
    print(f"engine 2 (pid {second.pid}): {second.prompt_tokens} prompt tokens ({parts})")
    print(f"  reused, exact prefix:          {second.reused_exact:5d} tokens  (lossless)")
    print(
        f"  reused, position-independent:  {second.reused_pi:5d} tokens  "
        f"({second.reused_chunks} chunks moved to new positions)"
    )
    print(
        f"  recomputed of those:            {_layer_runs(second.recomputed_per_layer)} "
        f"({second.recompute_fraction:.0%} of reused token-layers, policy {second.policy})"
    )
    print(
        f"  computed as misses:            "
        f"{second.prompt_tokens - second.reused_exact - second.reused_pi:5d} tokens"
    )
    print(f"  cache lookup + fetch:          {second.fetch_s * 1e3:7.0f} ms")
    print(f"  prefill with the cache:        {second.prefill_cached_s * 1e3:7.0f} ms")
    print(
        f"  prefill without the cache:     {second.prefill_nocache_s * 1e3:7.0f} ms  "
        f"(saved {saved:.0%}; {saved_with_fetch:.0%} counting the fetch)"
    )
    saved_s = second.prefill_nocache_s - second.prefill_cached_s
    print(
        f"  prefill time the cache saved:  {saved_s * 1e3:7.0f} ms  beside lookup + fetch "
        f"{second.fetch_s * 1e3:.0f} ms: net {(saved_s - second.fetch_s) * 1e3:+.0f} ms"
    )
    return print_answers(second.answer, second.nocache_answer)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; the exit status."""
    interrupt_on_signals()  # Ctrl-C and SIGTERM end the demo through the cleanup
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter report, fewer tokens")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="answer length")
    args = parser.parse_args(argv)
    new_tokens = args.max_new_tokens or (12 if args.quick else 30)
    runs = 1 if args.quick else 3
    try:
        with tempfile.TemporaryDirectory(prefix="nopecache-demo-") as tmp:
            print("starting the nopecache server (CPU tier)", flush=True)
            with embedded_server(Path(tmp)) as (address, server_pid):
                print(f"server pid {server_pid} listening on {address}", flush=True)
                print("engine 1: a chat whose system prompt sits at position 0", flush=True)
                first = run_engine(EngineJob(1, address, args.quick, new_tokens, runs))
                print("engine 1 exited; the KV it stored lives only in the server", flush=True)
                print("engine 2: an uploaded report precedes the same system prompt", flush=True)
                second = run_engine(EngineJob(2, address, args.quick, new_tokens, runs))
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted; server and engines stopped", file=sys.stderr)
        return 130
    same = print_summary(first, second)
    print(
        f"DEMO reused_exact={second.reused_exact} reused_pi={second.reused_pi} "
        f"recomputed_first_layer={second.recomputed_per_layer[0]} "
        f"recomputed_last_layer={second.recomputed_per_layer[-1]} "
        f"recompute_fraction={second.recompute_fraction:.3f} "
        f"prefill_cached_ms={second.prefill_cached_s * 1e3:.0f} "
        f"prefill_nocache_ms={second.prefill_nocache_s * 1e3:.0f} "
        f"lookup_fetch_ms={second.fetch_s * 1e3:.0f} "
        f"net_saved_ms={(second.prefill_nocache_s - second.prefill_cached_s - second.fetch_s) * 1e3:.0f} "
        f"same_answer={'yes' if same else 'no'} "
        f"server_pid={server_pid} engine_pids={first.pid},{second.pid}"
    )
    if second.reused_exact + second.reused_pi == 0:
        print("demo failed: engine 2 reused no cached tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
