"""The vLLM connector's pure parts: cache layouts, extra-config validation, claims.

Layouts are checked on CPU tensors built by hand in each backend's layout, against plain
indexing of the layout as its docstring draws it (vLLM itself is not needed here; the
CPU layout is also checked against vLLM's own cache writer in tests/integrations/vllm/engine/).
"""

from __future__ import annotations

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.keys import BlockKey
from nopecache.client.plan import Hit, HitKind, ReusePlan
from nopecache.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from nopecache.integrations.vllm.layout import (
    CpuAttnLayout,
    FlashAttnLayout,
    UnsupportedLayoutError,
    detect_layout,
)
from nopecache.integrations.vllm.metadata import slots_for
from nopecache.integrations.vllm.scheduler import claim_end, trim_plan
from nopecache.proto.block import StoredForm

NB, BS, H, D = 5, 4, 3, 8


def _ref_cpu_put(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Plain indexing of the CPU_ATTN page: K^T [D, BS] then V [BS, D] per (block, head)."""
    b, t = divmod(slot, BS)
    for h in range(H):
        page = cache[b, h].reshape(-1)
        for d in range(D):
            page[d * BS + t] = k[h, d]
            page[BS * D + t * D + d] = v[h, d]


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def test_cpu_layout_writes_where_plain_indexing_does() -> None:
    layout = detect_layout(
        "model.layers.0.attn",
        torch.zeros(NB, H, BS, 2 * D),
        block_size=BS,
        num_kv_heads=H,
        head_dim=D,
    )
    assert isinstance(layout, CpuAttnLayout)
    slots = torch.tensor([7, 0, 19, 8, 13])
    k, v = _rows(len(slots), 1)
    got, want = torch.zeros(NB, H, BS, 2 * D), torch.zeros(NB, H, BS, 2 * D)
    layout.write(got, slots, k, v)
    for i, s in enumerate(slots.tolist()):
        _ref_cpu_put(want, s, k[i], v[i])
    assert torch.equal(got, want)
    rk, rv = layout.read(got, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_cpu_layout_reads_whole_blocks_into_outputs() -> None:
    layout = CpuAttnLayout(BS, H, D)
    cache = torch.zeros(NB, H, BS, 2 * D)
    k, v = _rows(NB * BS, 2)
    layout.write(cache, torch.arange(NB * BS), k, v)
    ids = torch.tensor([3, 1])
    k_out, v_out = torch.empty(2 * BS, H, D), torch.empty(2 * BS, H, D)
    layout.read_blocks_into(cache, ids, k_out, v_out)
    want = torch.cat([torch.arange(3 * BS, 4 * BS), torch.arange(BS, 2 * BS)])
    assert torch.equal(k_out, k[want]) and torch.equal(v_out, v[want])


def test_flash_attention_layout_matches_plain_indexing() -> None:
    cache = torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16)
    layout = detect_layout("layers.3", cache, block_size=BS, num_kv_heads=H, head_dim=D)
    assert isinstance(layout, FlashAttnLayout)
    slots = torch.tensor([5, 18, 2])
    k, v = _rows(3, 3)
    layout.write(cache, slots, k, v)
    want = torch.zeros_like(cache)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, BS)
        want[0, b, t] = k[i].to(torch.bfloat16)
        want[1, b, t] = v[i].to(torch.bfloat16)
    assert torch.equal(cache, want)
    k_out, v_out = (
        torch.empty(BS, H, D, dtype=torch.bfloat16),
        torch.empty(BS, H, D, dtype=torch.bfloat16),
    )
    layout.read_blocks_into(cache, torch.tensor([4]), k_out, v_out)
    assert torch.equal(k_out, want[0, 4]) and torch.equal(v_out, want[1, 4])


@pytest.mark.parametrize(
    ("cache", "needle"),
    [
        (torch.zeros(NB, BS, H, D), "shape [5, 4, 3, 8], stride [96, 24, 8, 1]"),  # plain NHD
        (torch.zeros(NB, H, BS, D), "is not the CPU_ATTN layout"),  # half the page
        (torch.zeros(NB, H, 2 * BS, D), "is not the CPU_ATTN layout"),
        (torch.zeros(2, NB, H, BS, D), "is not the FlashAttention layout"),  # HND
        (torch.zeros(NB, H, BS, 2 * D).transpose(0, 1), "is not the CPU_ATTN layout"),
        (torch.zeros(NB * BS * H * D), "matches no known layout"),
    ],
)
def test_unknown_layouts_are_refused_naming_shape_and_stride(
    cache: torch.Tensor, needle: str
) -> None:
    with pytest.raises(UnsupportedLayoutError) as err:
        detect_layout("model.layers.0.attn", cache, block_size=BS, num_kv_heads=H, head_dim=D)
    assert "model.layers.0.attn" in str(err.value)
    assert "stride" in str(err.value)
    assert needle in str(err.value)


URL = "nopecache://127.0.0.1:50551"


def test_extra_config_defaults_and_values() -> None:
    cfg = ConnectorConfig.from_extra_config({"url": URL})
    assert (cfg.pi_reuse, cfg.namespace, cfg.load, cfg.save) == ("off", "", True, True)
    assert cfg.client.servers == ("127.0.0.1:50551",)
    cfg = ConnectorConfig.from_extra_config(
        {
            "url": URL + "?lookup_timeout=200ms",
            "pi_reuse": "contiguous",
            "namespace": "a",
            "save": False,
        }
    )
    assert (cfg.pi_reuse, cfg.namespace, cfg.save, cfg.client.lookup_timeout_s) == (
        "contiguous",
        "a",
        False,
        0.2,
    )


def test_url_namespace_is_honoured() -> None:
    # Regression: the connector passed its own namespace default ("") on every call,
    # which overrode the url's ?namespace= and keyed the engine into the shared one.
    cfg = ConnectorConfig.from_extra_config({"url": URL + "?namespace=team-a"})
    assert (cfg.namespace, cfg.client.namespace) == ("team-a", "team-a")
    cfg = ConnectorConfig.from_extra_config(
        {"url": URL + "?namespace=team-a", "namespace": "team-a"}
    )
    assert (cfg.namespace, cfg.client.namespace) == ("team-a", "team-a")
    cfg = ConnectorConfig.from_extra_config({"url": URL, "namespace": "team-b"})
    assert (cfg.namespace, cfg.client.namespace) == ("team-b", "team-b")


def test_url_and_extra_namespaces_that_differ_are_refused() -> None:
    with pytest.raises(ConnectorConfigError) as err:
        ConnectorConfig.from_extra_config({"url": URL + "?namespace=team-a", "namespace": "team-b"})
    assert str(err.value) == (
        "kv_connector_extra_config['namespace']: 'team-b' differs from the url's "
        "?namespace='team-a'; give one of them, or the same value in both"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config['url']: is required"),
        ({"url": URL, "pii_reuse": "off"}, "kv_connector_extra_config['pii_reuse']: unknown key"),
        ({"url": 5}, "kv_connector_extra_config['url']: must be a string, got 5"),
        ({"url": "http://x:1"}, "kv_connector_extra_config['url']: "),
        (
            {"url": URL, "pi_reuse": "blended"},
            "['pi_reuse']: must be one of off, contiguous, blend, got 'blended'",
        ),
        ({"url": URL, "save": "yes"}, "kv_connector_extra_config['save']: must be true or false"),
        (
            {"url": URL, "layerwise": 1},
            "kv_connector_extra_config['layerwise']: must be true or false",
        ),
        ({"url": URL, "namespace": 3}, "kv_connector_extra_config['namespace']: must be a string"),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        ConnectorConfig.from_extra_config(extra)
    assert message in str(err.value)


def _hit(kind: HitKind, start: int, end: int) -> Hit:
    form = StoredForm.ROPE if kind is HitKind.PREFIX else StoredForm.NOPE
    key = BlockKey(bytes([start % 256]) * 16)
    return Hit(key, ChunkSpan(start, end), ChunkSpan(0, end - start), form, kind)


def test_claim_end_is_block_aligned_and_contiguous_only() -> None:
    pre = (_hit(HitKind.PREFIX, 0, 128), _hit(HitKind.PREFIX, 128, 256))
    pi = (
        _hit(HitKind.POSITION_INDEPENDENT, 256, 330),
        _hit(HitKind.POSITION_INDEPENDENT, 330, 420),
    )
    gap = _hit(HitKind.POSITION_INDEPENDENT, 500, 600)
    plan = ReusePlan(700, pre, (*pi, gap), (ChunkSpan(420, 500), ChunkSpan(600, 700)))
    assert claim_end(plan, contiguous=False, limit=640, block_size=128) == 256
    assert claim_end(plan, contiguous=True, limit=640, block_size=128) == 384  # 420 aligned
    assert claim_end(plan, contiguous=True, limit=300, block_size=128) == 256  # the limit
    assert claim_end(ReusePlan.all_miss(700), contiguous=True, limit=640, block_size=128) == 0


def test_trimmed_plans_fetch_only_what_a_claim_uses() -> None:
    pre = (_hit(HitKind.PREFIX, 0, 128),)
    a, b = (
        _hit(HitKind.POSITION_INDEPENDENT, 128, 200),
        _hit(HitKind.POSITION_INDEPENDENT, 300, 400),
    )
    plan = ReusePlan(500, pre, (a, b), (ChunkSpan(200, 300), ChunkSpan(400, 500)))
    trimmed = trim_plan(plan, 256)
    assert trimmed.prefix == pre and trimmed.hits == (a,)
    assert trimmed.misses == (ChunkSpan(200, 500),)
    assert trim_plan(plan, 384) == plan


def test_slots_follow_the_block_table() -> None:
    assert slots_for([7, 2, 9], 4, 2, 10) == [30, 31, 8, 9, 10, 11, 36, 37]


def test_segment_tokens_cut_messages() -> None:
    cfg = ConnectorConfig.from_extra_config({"url": URL, "segment_token_ids": [1]})
    assert cfg.segments([1, 5, 6, 2, 1, 7, 1]) == [0, 4, 6]
    assert ConnectorConfig.from_extra_config({"url": URL}).segments([1, 5]) is None
    with pytest.raises(ConnectorConfigError, match=r"\['segment_token_ids'\]: must be a list"):
        ConnectorConfig.from_extra_config({"url": URL, "segment_token_ids": [1, "a"]})
