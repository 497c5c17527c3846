"""Layer-wise loads and saves (``layerwise=true``, layerwise.py), without vLLM.

The connector's halves run against a real server as in test_halves.py; ``_forward``
calls the worker's hooks in the order vLLM's attention wrapper does
(``maybe_transfer_kv_layer``): the loads start, then for each layer ``wait_for_layer``
before its attention and ``save_layer`` after it, then the step's save. Each layer-wise
result is compared with the same step on an engine with the synchronous path
(``layerwise=false``) and the same starting caches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nopecache.integrations.vllm.layerwise import LayerLoads, LoadStaging
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import LAYERS, _Engine, _request

PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks
SYNC: dict[str, Any] = {"load_async": False}
LAYERED: dict[str, Any] = {"load_async": False, "layerwise": True}
SMALL_CHUNKS = "?lookup_timeout=300ms&chunk_min_tokens=2&chunk_avg_tokens=4&chunk_max_tokens=8"


def _name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def _forward(
    engine: _Engine, plan: Any, *, saved_layers: range | None = None, before_save: Any = None
) -> list[torch.Tensor]:
    """One step as vLLM runs it with a layer-wise connector; each layer's cache as it was
    when ``wait_for_layer`` returned for it. ``saved_layers``: the layers whose
    ``save_layer`` runs (default all); ``before_save()`` runs after the forward."""
    worker = engine.worker
    worker.begin_step(plan)
    worker.load(plan)
    seen = []
    for layer in range(LAYERS):
        worker.wait_for_layer(_name(layer))
        seen.append(engine.cache(layer).clone())
        if saved_layers is None or layer in saved_layers:
            worker.save_layer(_name(layer))
    if before_save is not None:
        before_save()
    worker.save(plan)
    engine.client.drain()
    return seen


@pytest.fixture
def engines(cache_server: CacheServerProc) -> Iterator[tuple[_Engine, _Engine, _Engine]]:
    """A writer, and two readers with the same starting caches: layer-wise, synchronous."""
    made = [
        _Engine(cache_server, 1),
        _Engine(cache_server, 2, **LAYERED),
        _Engine(cache_server, 2, **SYNC),
    ]
    yield made[0], made[1], made[2]
    for engine in made:
        engine.close()


def test_each_layer_is_written_before_its_wait_returns(engines: Any) -> None:
    writer, layered, sync = engines
    writer.step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    request = [*PROMPT[:12], 7, 8, 9]
    out = layered.plan_step(_request("r", request), [5, 6, 7, 8], 0)
    assert out.claimed == 12 and not out.plan.loads[0].asynchronous
    seen = _forward(layered, out.plan)
    for layer in range(LAYERS):  # vLLM's post-RoPE K and V, copied without a change
        assert torch.equal(seen[layer][:, [5, 6, 7]], writer.cache(layer)[:, [3, 0, 2]])
    assert layered.worker.take_errors() == set()
    report = layered.worker.take_report()
    assert report is not None
    assert (report.loaded_exact_tokens, report.load_failures) == (12, 0)
    assert report.fetched_bytes > 0 and report.load_seconds > 0
    assert report.layer_wait_seconds > 0  # the first layer waited for the fetch
    assert report.layer_loaded_tokens == 12
    assert report.layer_saved_tokens == report.saved_tokens == 15  # every layer copied

    sync.step(_request("r", request), [5, 6, 7, 8], 0)
    for layer in range(LAYERS):  # every slot, claimed or not, as the synchronous path left it
        assert torch.equal(layered.cache(layer), sync.cache(layer))


def test_a_moved_message_is_rotated_into_each_layer_as_the_synchronous_path_does(
    cache_server: CacheServerProc,
) -> None:
    """Position-independent hits land rotated to their new positions in the staging,
    then layer by layer: the same bits as the synchronous path's direct placement."""
    writer = _Engine(cache_server, 1, SMALL_CHUNKS, segment_token_ids=[1])
    readers = [
        _Engine(cache_server, 2, SMALL_CHUNKS, segment_token_ids=[1], pi_reuse="contiguous", **kw)
        for kw in (LAYERED, SYNC)
    ]
    try:
        head = [1, *range(90, 97)]
        segment = [1, *range(50, 62)]
        writer.step(_request("w1", [*segment, 1, 70, 71]), [0, 1, 2, 3], 0)
        writer.step(_request("w2", [*head, 5, 5, 5, 5]), [4, 5, 6], 0)
        prompt = [*head, *segment, 1, *range(80, 87)]  # the message moved to 8..21
        layered, sync = readers
        out = layered.plan_step(_request("r1", prompt), list(range(8)), 0)
        assert out.claimed == 20
        _forward(layered, out.plan)
        assert sync.step(_request("r1", prompt), list(range(8)), 0).claimed == 20
        for layer in range(LAYERS):
            assert torch.equal(layered.cache(layer), sync.cache(layer))
        reports = [reader.worker.take_report() for reader in readers]
        assert [(r.loaded_exact_tokens, r.loaded_pi_tokens) for r in reports if r] == [
            (8, 12),
            (8, 12),
        ]
    finally:
        writer.close()
        for reader in readers:
            reader.close()


def test_a_failed_fetch_releases_every_layer_and_writes_nothing(
    engines: Any, cache_server: CacheServerProc
) -> None:
    writer, layered, _ = engines
    writer.step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    out = layered.plan_step(_request("r", PROMPT), [5, 6, 7, 8], 0)
    assert out.claimed == 12
    cache_server.kill()
    before = [layered.cache(i).clone() for i in range(LAYERS)]
    seen = _forward(layered, out.plan)
    assert layered.worker.take_errors() == {5, 6, 7}  # vLLM recomputes them
    assert all(torch.equal(seen[i], before[i]) for i in range(LAYERS))


def test_a_layer_that_fails_to_write_fails_the_whole_claim(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, layered, _ = engines
    writer.step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    out = layered.plan_step(_request("r", PROMPT), [5, 6, 7, 8], 0)
    real = LoadStaging.write_layer

    def write_layer(self: LoadStaging, layout: Any, cache: torch.Tensor, layer: int) -> None:
        if layer == LAYERS - 1:
            raise RuntimeError("injected: the last layer's write fails")
        real(self, layout, cache, layer)

    monkeypatch.setattr(LoadStaging, "write_layer", write_layer)
    _forward(layered, out.plan)
    # The first layers were written, the last was not: every claimed block is a failed
    # load, so vLLM recomputes the request instead of attending to half-loaded KV.
    assert layered.worker.take_errors() == {5, 6, 7}
    report = layered.worker.take_report()
    assert report is not None
    assert (report.load_failures, report.loaded_exact_tokens) == (1, 0)


def test_saves_copy_each_layer_during_the_forward(engines: Any) -> None:
    """Nothing is gathered at the step's end: what the store holds is what each layer
    held right after its attention ran (the pages change after that here)."""
    _, layered, sync = engines
    out = layered.plan_step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    written = [layered.cache(i)[:, [3, 0, 2, 1]].clone() for i in range(LAYERS)]

    def scribble() -> None:
        for layer in range(LAYERS):
            layered.cache(layer)[:, [3, 0, 2, 1]] = 0.0

    _forward(layered, out.plan, before_save=scribble)
    got = sync.step(_request("r", [*PROMPT, 9]), [8, 9, 10, 11], 0)
    assert got.claimed == 12
    for layer in range(LAYERS):
        assert torch.equal(sync.cache(layer)[:, [8, 9, 10]], written[layer][:, :3])


def test_a_save_some_layer_never_copied_is_gathered_at_the_end(engines: Any) -> None:
    _, layered, sync = engines
    out = layered.plan_step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    _forward(layered, out.plan, saved_layers=range(LAYERS - 1))
    report = layered.worker.take_report()
    assert report is not None and (report.saved_tokens, report.layer_saved_tokens) == (14, 0)
    assert sync.step(_request("r", [*PROMPT, 9]), [8, 9, 10, 11], 0).claimed == 12
    for layer in range(LAYERS):
        assert torch.equal(sync.cache(layer)[:, [8, 9, 10]], layered.cache(layer)[:, [3, 0, 2]])


def test_a_layer_waits_for_the_fetch_and_is_written_by_the_waiting_thread() -> None:
    loads: LayerLoads[str] = LayerLoads(3)
    fetched, release = threading.Event(), threading.Event()
    written: list[tuple[str, int, str]] = []
    finished: list[str] = []

    def stage() -> list[str]:
        fetched.set()
        release.wait()
        return ["a", "b"]

    def write(item: str, layer: int) -> None:
        written.append((item, layer, threading.current_thread().name))

    returned = threading.Event()

    def forward() -> None:
        loads.wait(0)
        returned.set()

    loads.start(stage, write, finished.append)
    thread = threading.Thread(target=forward, name="forward")
    thread.start()
    fetched.wait()
    assert not returned.is_set() and written == []  # the fetch has not returned yet
    release.set()
    thread.join()
    assert written == [("a", 0, "forward"), ("b", 0, "forward")]  # layer 0 only
    loads.wait(2)  # layer 1 was never asked for: written first, in order
    assert [(i, layer) for i, layer, _ in written] == [
        (i, layer) for layer in range(3) for i in ("a", "b")
    ]
    assert loads.waited > 0 and loads.finish() > 0
    assert finished == ["a", "b"]
    loads.close()


def test_layers_no_wait_asked_for_are_written_when_the_step_ends() -> None:
    loads: LayerLoads[str] = LayerLoads(2)
    written: list[tuple[str, int]] = []
    loads.start(lambda: ["a"], lambda item, layer: written.append((item, layer)), lambda item: None)
    loads.wait(0)
    loads.finish()
    assert written == [("a", 0), ("a", 1)]
    loads.close()


def test_an_error_out_of_the_fetch_writes_nothing_and_holds_no_layer() -> None:
    loads: LayerLoads[str] = LayerLoads(4)
    written: list[int] = []

    def stage() -> list[str]:
        raise RuntimeError("a bug")

    loads.start(stage, lambda item, layer: written.append(layer), lambda item: None)
    loads.wait(3)  # returns, nothing to write
    with pytest.raises(RuntimeError, match="a bug"):
        loads.finish()
    assert written == []
    loads.wait(3)  # nothing in flight: returns at once
    loads.close()


@pytest.mark.gpu
def test_on_cuda_caches_loads_and_saves_match_the_synchronous_path(
    cache_server: CacheServerProc,
) -> None:
    """The CUDA path: host staging written into device pages layer by layer, layers
    copied out through a device staging on the current stream."""
    made = [
        _Engine(cache_server, 1, device="cuda"),
        _Engine(cache_server, 2, device="cuda", **LAYERED),
        _Engine(cache_server, 2, device="cuda", **SYNC),
    ]
    writer, layered, sync = made
    try:
        writer.step(_request("w", PROMPT), [3, 0, 2, 1], 0)
        out = layered.plan_step(_request("r", [*PROMPT[:12], 7, 8, 9]), [5, 6, 7, 8], 0)
        seen = _forward(layered, out.plan)
        for layer in range(LAYERS):
            assert torch.equal(seen[layer][:, [5, 6, 7]], writer.cache(layer)[:, [3, 0, 2]])
        sync.step(_request("r", [*PROMPT[:12], 7, 8, 9]), [5, 6, 7, 8], 0)
        for layer in range(LAYERS):
            assert torch.equal(layered.cache(layer), sync.cache(layer))
        # The layered engine's save of a new prompt, loaded back by the synchronous one.
        fresh = list(range(300, 314))
        _forward(layered, layered.plan_step(_request("s", fresh), [9, 10, 11, 0], 0).plan)
        assert sync.step(_request("t", [*fresh, 1]), [4, 1, 2, 3], 0).claimed == 12
        for layer in range(LAYERS):
            assert torch.equal(
                sync.cache(layer)[:, [4, 1, 2]], layered.cache(layer)[:, [9, 10, 11]]
            )
    finally:
        for engine in made:
            engine.close()
