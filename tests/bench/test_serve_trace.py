"""bench/vllm_serve.py's pure parts: the content bound, the /metrics reader, the trace.

The bound is the bench's denominator for ``hit_vs_bound``: a token counts when it lies in
a message seen before or in a 16-token run seen before, in trace order, and nothing else.
"""

from __future__ import annotations

import sys

from tests.support.bench_runs import BENCH, ROOT

for folder in (BENCH, ROOT / "examples"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from _serve_procs import parse_metrics  # noqa: E402
from _serve_trace import QUICK, RUN, Prompt, Size, build_trace, content_bound  # noqa: E402
from _traces import Segment  # noqa: E402


def _words(seg: Segment) -> int:
    return len(seg.rendered().split())


def test_content_bound_counts_messages_and_runs_seen_before() -> None:
    a = tuple(range(100, 140))  # 40 tokens, one message
    b = tuple(range(200, 220))  # 20 tokens
    first = Prompt(a, (0,))
    # a again, moved behind b: all of a is a message seen before; b is new.
    moved = Prompt(b + a, (0, len(b)))
    # 17 tokens of a inside another message: one 16-token run (plus one more) seen before.
    inner = Prompt((1, 2, 3, *a[5:22], 9), (0,))
    # 15 tokens of a: shorter than a run, nothing counts.
    short = Prompt((7, *a[:15], 8), (0,))
    assert content_bound([first, moved, inner, short]) == [0, 40, 17, 0]
    assert RUN == 16


def test_content_bound_counts_a_repeated_short_message() -> None:
    msg = (5, 6, 7)  # shorter than a run, but a whole message seen before
    assert content_bound([Prompt((*msg, 1, 2), (0, 3)), Prompt((9, *msg), (0, 1))]) == [0, 3]


def test_parse_metrics_sums_labels_and_drops_total_and_created() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits",
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0',
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
            'vllm:request_success_total{finished_reason="stop"} 3.0',
            'vllm:request_success_total{finished_reason="length"} 4.0',
            'vllm:time_to_first_token_seconds_sum{engine="0"} 2.5',
        ]
    )
    assert parse_metrics(text) == {
        "vllm:prefix_cache_hits": 128.0,
        "vllm:request_success": 7.0,
        "vllm:time_to_first_token_seconds_sum": 2.5,
    }


def test_trace_has_every_situation_and_the_chat_is_truncated() -> None:
    sessions = build_trace(Size(), 23, _words)
    names = [s.name for s in sessions]
    assert names[:2] == ["ferry_chat", "corpus_chat"]
    assert {"tool_first", "tool_again"} <= set(names)
    assert names.index("tool_again") == len(names) - 1  # pasted again after everything else
    assert sum(n.startswith("agent_") for n in names) == 4
    assert sum(n.startswith("rag_") for n in names) == 4
    ferry = sessions[0].requests
    # Grows by one turn (two messages) until the window of 5 turns, then stays at 5.
    lengths = [len(r.messages) for r in ferry]
    assert lengths == [4, 6, 8, 10, 12, 12, 12, 12, 12, 12]
    assert ferry[5].messages[1] != ferry[4].messages[1]  # the oldest turn was dropped
    assert all(r.fact is not None for r in ferry)
    tool = [s for s in sessions if s.name.startswith("tool_")]
    pasted = {m for s in tool for m in s.requests[0].messages if m[0] == "tool"}
    assert len(pasted) == 1  # the same tool result in both


def test_quick_trace_is_small() -> None:
    sessions = build_trace(QUICK, 23, _words)
    assert sum(len(s.requests) for s in sessions) == 11
    assert all(r.max_tokens == 4 for s in sessions for r in s.requests)
