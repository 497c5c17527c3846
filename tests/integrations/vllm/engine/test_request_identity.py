"""Request identity against vLLM's own ``Request`` objects and block hashes (no engine started).

Keys must separate exactly what vLLM's own prefix cache separates: every pair of requests
below has equal exact-prefix keys at a block exactly when vLLM's block hashes are equal
there. Then, through the connector's two halves over a real server: a block stored under
one adapter, salt or image is never claimed under another; requests the connector cannot
key are skipped and counted; a contiguous claim salts vLLM's hashes from its first
position-independent block; KV events name the adapter and extra keys as vLLM's do.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from nopecache.client import ChunkSpan, FixedChunker, InputIdentity, prefix_chunks
from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.identity import KNOWN_TAGS, request_identity
from nopecache.integrations.vllm.scheduler import SchedulerSide
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, _Engine, _identity

N = 6 * BS  # a prompt of six blocks
TOKENS = [7 + (i * 37) % 900 for i in range(N)]
init_none_hash(sha256_cbor)
_ids = itertools.count()


def _image(identifier: str, offset: int, length: int = 2 * BS) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def _request(tokens: list[int] = TOKENS, **kwargs: Any) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256_cbor),
        **kwargs,
    )


LORA_A = LoRARequest("adapter-a", 1, "/adapters/a")
LORA_B = LoRARequest("adapter-b", 2, "/adapters/b")
IDENTITIES: dict[str, dict[str, Any]] = {
    "plain": {},
    "lora a": {"lora_request": LORA_A},
    "lora b": {"lora_request": LORA_B},
    "lora a moved": {"lora_request": LoRARequest("adapter-a", 1, "/adapters/a2")},
    "salt 1": {"cache_salt": "tenant-1"},
    "salt 2": {"cache_salt": "tenant-2"},
    "image 1": {"mm_features": [_image("img-1", BS + 2)]},
    "image 2": {"mm_features": [_image("img-2", BS + 2)]},
    "image 1 later": {"mm_features": [_image("img-1", 3 * BS + 2)]},
    "lora a + image 1": {"lora_request": LORA_A, "mm_features": [_image("img-1", BS + 2)]},
}


def _keys(request: Request) -> list[bytes]:
    identity = request_identity(request)
    assert isinstance(identity, InputIdentity)
    spans = FixedChunker(BS).split(TOKENS)
    return [
        bytes(c.key) for c in prefix_chunks(_identity().fingerprint, "", TOKENS, spans, identity)
    ]


def test_prefix_keys_separate_exactly_what_vllm_block_hashes_separate() -> None:
    requests = {name: _request(**kwargs) for name, kwargs in IDENTITIES.items()}
    keys = {name: _keys(r) for name, r in requests.items()}
    for a, b in itertools.combinations(requests, 2):
        vllm_equal = [
            x == y for x, y in zip(requests[a].block_hashes, requests[b].block_hashes, strict=True)
        ]
        ours_equal = [x == y for x, y in zip(keys[a], keys[b], strict=True)]
        assert ours_equal == vllm_equal, (a, b)


def test_every_tag_vllm_keys_on_is_known() -> None:
    """A vLLM upgrade that folds a new input into its block hash fails here first."""
    embeds = torch.randn(N, 8)
    request = _request(
        lora_request=LORA_A,
        cache_salt="s",
        mm_features=[_image("img-1", 2)],
        prompt_embeds=embeds,
        prompt_is_token_ids=[i % 5 != 0 for i in range(N)],
    )
    tags = {key[0] for key in compat.extra_keys(request, 0, N)}
    assert tags == KNOWN_TAGS
    assert compat.has_extra_inputs(request)
    assert compat.extra_keys(_request(), 0, N) == ()
    assert not compat.has_extra_inputs(_request())


def test_mixed_prompt_embeds_are_keyed_by_their_values() -> None:
    mask = [not (BS <= i < 2 * BS + 3) for i in range(N)]  # one embedded run
    gen = torch.Generator().manual_seed(0)
    one, two = torch.randn(N, 8, generator=gen), torch.randn(N, 8, generator=gen)
    twin = one.clone()
    twin[0] += 1  # a token position: its row is not an input
    keys = {
        name: _keys(_request(prompt_embeds=e, prompt_is_token_ids=mask))
        for name, e in (("one", one), ("two", two), ("twin", twin))
    }
    assert keys["one"][0] == keys["two"][0]  # before the run
    assert all(a != b for a, b in zip(keys["one"][1:], keys["two"][1:], strict=True))
    assert keys["one"] == keys["twin"]


def test_an_embeds_only_prompt_and_an_unknown_key_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    only = Request(
        request_id="embeds",
        prompt_token_ids=None,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=torch.randn(N, 8),
    )
    assert request_identity(only) == "embeds_only"
    real = compat.extra_keys
    monkeypatch.setattr(
        compat, "extra_keys", lambda r, s, e: (*real(r, s, e), ("a_new_input", "x"))
    )
    assert request_identity(_request(cache_salt="s")) == "unknown_extra_key"


@pytest.fixture()
def pair(cache_server: CacheServerProc) -> Iterator[tuple[_Engine, _Engine]]:
    engines = (_Engine(cache_server, seed=1), _Engine(cache_server, seed=2))
    yield engines
    for engine in engines:
        engine.close()


def _blocks(n: int = N) -> list[int]:
    return list(range(n // BS + 1))


@pytest.mark.parametrize(
    ("stored", "asked"),
    [
        ("lora a", "plain"),
        ("plain", "lora a"),
        ("lora a", "lora b"),
        ("lora a", "lora a moved"),
        ("salt 1", "salt 2"),
        ("salt 1", "plain"),
        ("image 1", "image 2"),
    ],
)
def test_a_block_stored_under_one_identity_is_never_claimed_under_another(
    pair: tuple[_Engine, _Engine], stored: str, asked: str
) -> None:
    first, second = pair
    first.step(_request(**IDENTITIES[stored]), _blocks(), 0)
    assert second.matched(_request(**IDENTITIES[stored]), 0) > 0  # the same identity hits
    claimed = second.matched(_request(**IDENTITIES[asked]), 0)
    if asked == "image 2":  # the blocks before the image are the same text
        assert claimed == BS
    else:
        assert claimed == 0


def test_skipped_requests_are_counted_once_and_never_stored(
    pair: tuple[_Engine, _Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = pair
    real = compat.extra_keys
    monkeypatch.setattr(
        compat, "extra_keys", lambda r, s, e: (*real(r, s, e), ("a_new_input", "x"))
    )
    request = _request(cache_salt="s")
    first.step(request, _blocks(), 0)
    assert first.matched(request, 0) == 0
    assert first.scheduler.take_counters()["skipped_unknown_extra_key"] == 1
    monkeypatch.setattr(compat, "extra_keys", real)
    assert second.matched(_request(cache_salt="s"), 0) == 0  # nothing was stored


def test_a_contiguous_claim_salts_vllm_hashes_from_its_first_pi_block(
    cache_server: CacheServerProc,
) -> None:
    """Regression: contiguous claims left vLLM's hashes as they were, so the engine's own
    prefix cache filed approximate blocks as exact for the next turn to reuse and store."""
    small = "?lookup_timeout=300ms&chunk_min_tokens=2&chunk_avg_tokens=4&chunk_max_tokens=8"
    writer = _Engine(cache_server, 1, small, segment_token_ids=[1])
    reader = _Engine(cache_server, 2, small, segment_token_ids=[1], pi_reuse="contiguous")
    try:
        head = [1, *range(90, 97)]  # two blocks, stored as an exact prefix
        segment = [1, *range(50, 62)]  # a message, stored at position 0
        writer.step(_request([*segment, 1, 70, 71]), _blocks(), 0)
        writer.step(_request([*head, 5, 5, 5, 5]), _blocks(), 0)
        request = _request([*head, *segment, 1, 80, 81, 82])  # the message moved to 8..21
        original = list(request.block_hashes)
        claimed = reader.matched(request, 0)
        assert claimed == 20  # 8 exact tokens, then the message's hits, block aligned
        assert request.block_hashes[:2] == original[:2]
        assert all(a != b for a, b in zip(request.block_hashes[2:], original[2:], strict=True))
        # The request stores only its exact prefix (the blocks before the salt).
        reader.scheduler.after_alloc(request, _blocks(), claimed)
        assert reader.scheduler._tracked[request.request_id].approximate_from == 8
    finally:
        writer.close()
        reader.close()


def test_kv_events_name_the_adapter_and_extra_keys(pair: tuple[_Engine, _Engine]) -> None:
    first, _ = pair
    request = _request(lora_request=LORA_A, mm_features=[_image("img-1", BS + 2)])
    scheduler: SchedulerSide = first.scheduler
    first.step(request, _blocks(), 0)
    (event,) = list(compat.kv_events(scheduler.announced.take(), "STORAGE"))
    assert (event.lora_id, event.lora_name) == (1, "adapter-a")
    assert event.extra_keys is not None and len(event.extra_keys) == N // BS
    assert event.extra_keys[0] == ("adapter-a",)
    assert event.extra_keys[1] == ("adapter-a", ("img-1", 2))
    assert event.extra_keys[3] == ("adapter-a", ("img-1", -6))  # the image ends in it
    assert event.extra_keys[4] == ("adapter-a",)


def test_chunk_spans_are_whole_blocks() -> None:
    assert FixedChunker(BS).split(TOKENS)[1] == ChunkSpan(BS, 2 * BS)
