"""Placing verified blocks: PagedKV validation, block verification against a hit, and the
K each stored form leaves in a paged cache or in contiguous tensors (exact, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey
from nopecache.client.placement import (
    PagedKV,
    decode_for_hit,
    place_contiguous,
    place_paged,
    source_positions,
)
from nopecache.client.plan import Hit, HitKind
from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rotate_reference
from nopecache.proto.block import (
    BlockChecksumError,
    BlockMismatchError,
    DecodedBlock,
    StoredForm,
    encode_block,
)

LAYERS, HEADS, DIM = 2, 2, 8
SPEC = RopeSpec.default(DIM)
KEY = BlockKey(bytes(range(16)))
SENTINEL = -7.0


def _fingerprint(form: StoredForm = StoredForm.NOPE) -> ModelFingerprint:
    return ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="r",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.float32,
        form=form,
        rope=SPEC,
    )


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, tokens, HEADS, DIM, generator=g), torch.randn(
        LAYERS, tokens, HEADS, DIM, generator=g
    )


def _block(
    k: torch.Tensor,
    v: torch.Tensor,
    tokens: list[int],
    form: StoredForm = StoredForm.NOPE,
    positions: list[int] | None = None,
) -> bytes:
    return encode_block(
        key=KEY.value,
        fingerprint=_fingerprint(form).to_bytes(),
        form=form,
        k=k,
        v=v,
        token_ids=tokens,
        source_positions=positions,
    )


def _hit(target: tuple[int, int], source: tuple[int, int], form: StoredForm) -> Hit:
    return Hit(KEY, ChunkSpan(*target), ChunkSpan(*source), form, HitKind.POSITION_INDEPENDENT)


def _paged(num_blocks: int, block_size: int, slots: list[int]) -> PagedKV:
    shape = (num_blocks, block_size, HEADS, DIM)
    return PagedKV(
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        torch.tensor(slots, dtype=torch.int64),
    )


def _rotated(k: torch.Tensor, src: object, dst: object) -> torch.Tensor:
    """The reference rotation of every layer of K ``[layers, tokens, heads, dim]``."""
    return torch.stack([rotate_reference(k[i], src, dst, SPEC) for i in range(k.shape[0])])  # type: ignore[arg-type]


# -- PagedKV -------------------------------------------------------------------------------
def test_paged_kv_reports_its_geometry() -> None:
    paged = _paged(3, 4, [0, 5, -1])
    assert (paged.num_layers, paged.num_slots, paged.num_kv_heads) == (LAYERS, 12, HEADS)
    assert (paged.head_dim, paged.v_head_dim, paged.dtype) == (DIM, DIM, torch.float32)
    assert isinstance(paged.k_caches, tuple)
    # The host copy every per-block decision reads (no device sync per block); no stream
    # and no event off CUDA.
    assert paged.slots_host.tolist() == [0, 5, -1]
    assert paged.stream is None and paged.record_ready() is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k_caches": []}, "k_caches: must hold at least one layer"),
        ({"k_caches": torch.zeros(2, 3, 4, HEADS, DIM)}, "k_caches: must be a sequence"),
        ({"k_caches": [torch.zeros(3, 4, HEADS)]}, "k_caches[0]: must be 4-D"),
        (
            {"k_caches": [torch.zeros(3, 4, HEADS, DIM), torch.zeros(3, 4, HEADS, DIM).half()]},
            "k_caches[1]: torch.float16 on cpu differs",
        ),
        (
            {"k_caches": [torch.zeros(3, 4, HEADS, DIM), torch.zeros(2, 4, HEADS, DIM)]},
            "k_caches[1]: shape [2, 4, 2, 8] differs",
        ),
        (
            {
                "k_caches": [
                    torch.zeros(3, 4, HEADS, DIM),
                    torch.zeros(3, 4, DIM, HEADS).transpose(2, 3),
                ]
            },
            "k_caches[1]: strides [64, 16, 1, 2] differ from the first cache's [64, 16, 8, 1]",
        ),
        ({"v_caches": [torch.zeros(3, 4, HEADS, DIM)]}, "v_caches: 1 layers, k_caches has 2"),
        ({"v_caches": [torch.zeros(3, 2, HEADS, DIM)] * 2}, "v_caches[0]: shape [3, 2, 2, 8]"),
        ({"slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping: must be"),
        ({"slot_mapping": torch.tensor([0, 12])}, "values must be -1 or in [0, 12), got range"),
        ({"slot_mapping": torch.tensor([-2, 0])}, "got range [-2, 0]"),
        ({"slot_mapping": [0, 1]}, "slot_mapping: must be a tensor"),
        ({"stream": object()}, "stream: given for caches on cpu"),
    ],
)
def test_paged_kv_rejects_bad_fields_by_name(change: dict[str, object], message: str) -> None:
    paged = _paged(3, 4, [0, 1])
    fields: dict[str, object] = {
        "k_caches": paged.k_caches,
        "v_caches": paged.v_caches,
        "slot_mapping": torch.tensor([0, 1]),
    }
    fields.update(change)
    with pytest.raises(InvalidArgumentError) as err:
        PagedKV(**fields)  # type: ignore[arg-type]
    assert message in str(err.value)


# -- verification ----------------------------------------------------------------------------
def test_decode_for_hit_checks_the_tokens_before_a_trimmed_source() -> None:
    k, v = _kv(6, seed=1)
    blob = _block(k, v, [10, 11, 12, 13, 14, 15])
    prompt = token_array([1, 2, 10, 11, 12, 13, 14, 15, 3])
    # The block's first 2 tokens are already covered: the hit uses tokens 2..6 for 4..8.
    hit = _hit((4, 8), (2, 6), StoredForm.NOPE)
    block = decode_for_hit(blob, hit, prompt, _fingerprint(), DIM)
    assert torch.equal(block.k, k) and block.v is not None and torch.equal(block.v, v)
    other = token_array([1, 2, 99, 11, 12, 13, 14, 15, 3])  # differs inside the trimmed part
    with pytest.raises(BlockMismatchError, match="token_ids: first difference at index 0"):
        decode_for_hit(blob, hit, other, _fingerprint(), DIM)


def test_decode_for_hit_rejects_other_key_fingerprint_form_shape_and_corruption() -> None:
    k, v = _kv(4, seed=2)
    blob = _block(k, v, [5, 6, 7, 8])
    prompt = token_array([5, 6, 7, 8])
    hit = _hit((0, 4), (0, 4), StoredForm.NOPE)
    with pytest.raises(BlockMismatchError, match=r"^key: "):
        decode_for_hit(
            blob, dataclasses.replace(hit, key=BlockKey(bytes(16))), prompt, _fingerprint(), DIM
        )
    with pytest.raises(BlockMismatchError, match=r"^fingerprint: "):
        decode_for_hit(blob, hit, prompt, _fingerprint(StoredForm.ROPE), DIM)
    with pytest.raises(
        BlockMismatchError, match=r"^form: block holds NOPE float32, the hit expects ROPE"
    ):
        decode_for_hit(
            blob, dataclasses.replace(hit, form=StoredForm.ROPE), prompt, _fingerprint(), DIM
        )
    with pytest.raises(BlockMismatchError, match=r"^shape: .* v_head_dim 8, the model needs"):
        decode_for_hit(blob, hit, prompt, _fingerprint(), 4)
    with pytest.raises(BlockMismatchError, match=r"^hit: source"):
        decode_for_hit(blob, _hit((0, 2), (2, 4), StoredForm.NOPE), prompt, _fingerprint(), DIM)
    bad = bytearray(blob)
    bad[-1] ^= 0x01
    with pytest.raises(BlockChecksumError):
        decode_for_hit(bytes(bad), hit, prompt, _fingerprint(), DIM)


def test_source_positions_is_an_int_for_consecutive_positions_else_a_tensor() -> None:
    k, v = _kv(4, seed=3)
    rope = StoredForm.ROPE
    run = decode_for_hit(
        _block(k, v, [1, 2, 3, 4], rope, [7, 8, 9, 10]),
        _hit((0, 4), (0, 4), rope),
        token_array([1, 2, 3, 4]),
        _fingerprint(rope),
        DIM,
    )
    assert source_positions(run, _hit((1, 4), (1, 4), rope)) == 8
    gaps = decode_for_hit(
        _block(k, v, [1, 2, 3, 4], rope, [0, 5, 6, 9]),
        _hit((0, 4), (0, 4), rope),
        token_array([1, 2, 3, 4]),
        _fingerprint(rope),
        DIM,
    )
    got = source_positions(gaps, _hit((0, 3), (1, 4), rope))
    assert isinstance(got, torch.Tensor) and got.tolist() == [5, 6, 9]
    nope = decode_for_hit(
        _block(k, v, [1, 2, 3, 4]),
        _hit((0, 4), (0, 4), StoredForm.NOPE),
        token_array([1, 2, 3, 4]),
        _fingerprint(),
        DIM,
    )
    assert source_positions(nope, _hit((0, 4), (0, 4), StoredForm.NOPE)) is None


# -- paged placement -----------------------------------------------------------------------
def _decoded(
    form: StoredForm,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: list[int] | None,
    hit: Hit,
    prompt: list[int],
) -> DecodedBlock:
    tokens = prompt[hit.target.start - hit.source.start : hit.target.end]
    blob = _block(k, v, tokens, form, pos)
    return decode_for_hit(blob, hit, token_array(prompt), _fingerprint(form), DIM)


def _slots_of(paged: PagedKV, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    k = paged.k_caches[layer].view(-1, HEADS, DIM)[slots]
    assert paged.v_caches is not None
    return k, paged.v_caches[layer].view(-1, HEADS, DIM)[slots]


def _untouched(paged: PagedKV, written: set[int]) -> bool:
    keep = [s for s in range(paged.num_slots) if s not in written]
    assert paged.v_caches is not None
    caches = [*paged.k_caches, *paged.v_caches]
    return all(bool((c.view(-1, HEADS, DIM)[keep] == SENTINEL).all()) for c in caches)


@pytest.mark.parametrize("slots", [[9, 10, 11, 12], [14, 2, -1, 7]], ids=["run", "scattered"])
def test_nope_block_is_rotated_to_the_target_and_written_to_exactly_its_slots(
    slots: list[int],
) -> None:
    k, v = _kv(6, seed=4)
    prompt = list(range(100, 110))
    hit = _hit((5, 9), (2, 6), StoredForm.NOPE)  # block tokens 2..6 land at positions 5..9
    block = _decoded(StoredForm.NOPE, k, v, None, hit, prompt)
    paged = _paged(4, 4, [-1] * 5 + slots + [-1])
    place_paged(block, hit, paged, SPEC)
    want_k = _rotated(k[:, 2:6], None, 5)
    written = [(i, s) for i, s in enumerate(slots) if s >= 0]
    for layer in range(LAYERS):
        got_k, got_v = _slots_of(paged, layer, [s for _, s in written])
        rows = [i for i, _ in written]
        assert torch.equal(got_k, want_k[layer, rows])
        assert torch.equal(got_v, v[layer, 2:6][rows])
    assert _untouched(paged, {s for _, s in written})


@pytest.mark.parametrize("slots", [[3, 4, 5], [8, -1, 0]], ids=["run", "scattered"])
def test_rope_block_at_its_own_positions_is_copied_bit_exactly(slots: list[int]) -> None:
    k, v = _kv(3, seed=5)
    prompt = [4, 5, 6]
    hit = _hit((0, 3), (0, 3), StoredForm.ROPE)
    block = _decoded(StoredForm.ROPE, k, v, [0, 1, 2], hit, prompt)
    paged = _paged(3, 4, slots)
    place_paged(block, hit, paged, SPEC)
    written = [(i, s) for i, s in enumerate(slots) if s >= 0]
    for layer in range(LAYERS):
        got_k, got_v = _slots_of(paged, layer, [s for _, s in written])
        assert torch.equal(got_k, k[layer, [i for i, _ in written]])
        assert torch.equal(got_v, v[layer, [i for i, _ in written]])
    assert _untouched(paged, {s for _, s in written})


@pytest.mark.parametrize("slots", [[3, 4, 5], [8, -1, 0]], ids=["run", "scattered"])
def test_rope_block_at_other_positions_is_rotated_by_the_delta_once(slots: list[int]) -> None:
    k, v = _kv(4, seed=6)
    prompt = [9, 1, 2, 3, 4]
    hit = _hit((2, 5), (1, 4), StoredForm.ROPE)
    source = [40, 41, 43, 44]  # not consecutive: positions travel as a tensor
    block = _decoded(StoredForm.ROPE, k, v, source, hit, prompt)
    paged = _paged(3, 4, [-1, -1, *slots])
    place_paged(block, hit, paged, SPEC)
    want = _rotated(k[:, 1:4], torch.tensor(source[1:4]), torch.arange(2, 5))
    written = [(i, s) for i, s in enumerate(slots) if s >= 0]
    for layer in range(LAYERS):
        got_k, _ = _slots_of(paged, layer, [s for _, s in written])
        assert torch.equal(got_k, want[layer, [i for i, _ in written]])
    assert _untouched(paged, {s for _, s in written})


def test_mla_block_without_v_rotates_only_the_rope_part() -> None:
    spec = RopeSpec.mla(kv_lora_rank=4, qk_rope_head_dim=4)
    fp = ModelFingerprint.from_rope_spec(
        model="mla",
        revision="r",
        num_layers=1,
        num_kv_heads=1,
        dtype=torch.float32,
        form=StoredForm.MLA,
        rope=spec,
    )
    latent = torch.randn(1, 3, 1, 8, generator=torch.Generator().manual_seed(7))
    blob = encode_block(
        key=KEY.value,
        fingerprint=fp.to_bytes(),
        form=StoredForm.MLA,
        k=latent,
        v=None,
        token_ids=[1, 2, 3],
    )
    hit = Hit(KEY, ChunkSpan(2, 5), ChunkSpan(0, 3), StoredForm.MLA, HitKind.POSITION_INDEPENDENT)
    block = decode_for_hit(blob, hit, token_array([0, 0, 1, 2, 3]), fp, 0)
    paged = PagedKV([torch.zeros(2, 4, 1, 8)], None, torch.tensor([0, 0, 5, 6, 7]))
    place_paged(block, hit, paged, spec)
    got = paged.k_caches[0].view(-1, 1, 8)[5:8]
    assert torch.equal(got, rotate_reference(latent[0], None, 2, spec))
    assert torch.equal(got[..., :4], latent[0, ..., :4])


# -- contiguous placement --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("form", "positions", "rotated_from"),
    [
        (StoredForm.NOPE, None, None),
        (StoredForm.ROPE, [3, 4, 5, 6], 4),  # source token 1 sits at 4, lands at 2
        (StoredForm.ROPE, [1, 2, 3, 4], "copy"),  # source token 1 sits at 2: no rotation
    ],
    ids=["nope", "rope-moved", "rope-same"],
)
def test_contiguous_placement_fills_only_the_target_rows(
    form: StoredForm, positions: list[int] | None, rotated_from: int | str | None
) -> None:
    k, v = _kv(4, seed=8)
    hit = _hit((2, 5), (1, 4), form)
    block = _decoded(form, k, v, positions, hit, [9, 1, 2, 3, 4])
    k_out = torch.full((LAYERS, 5, HEADS, DIM), SENTINEL)
    v_out = torch.full((LAYERS, 5, HEADS, DIM), SENTINEL)
    place_contiguous(block, hit, k_out, v_out, SPEC)
    want = k[:, 1:4] if rotated_from == "copy" else _rotated(k[:, 1:4], rotated_from, 2)
    assert torch.equal(k_out[:, 2:5], want)
    assert torch.equal(v_out[:, 2:5], v[:, 1:4])
    assert bool((k_out[:, :2] == SENTINEL).all()) and bool((v_out[:, :2] == SENTINEL).all())
