"""SGLang's page hashes already separate LoRA adapters, cache salts / extra keys and images,
so the HiCache backend's keys (``engine_page_key(fingerprint, namespace, page hash)``) do.

What SGLang 0.5.23 folds into the hash it hands the storage backend
(``sglang/srt/mem_cache/utils.py``): ``get_storage_hash_str(key, prior_hash)`` chains
``get_hash_str`` (SHA-256 per page over the previous page's digest and the page's token
ids, native ``hash_binding.cpp``), seeding a new chain with
``storage_namespace_seed(key.extra_key, key.cache_salt)`` (length-prefixed, so absent,
empty and joined parts differ). The prefetch (``UnifiedRadixCache.prefetch_from_storage``
builds a ``RadixKey`` with the request's ``extra_key`` and ``cache_salt``), the backup
(``compute_node_hash_values`` over the node's ``RadixKey``) and the decode offload
(``_compute_prefix_hash``) all seed so; a tail continues from the namespaced chain.

- Adapters: ``Req.__init__`` appends the ``lora_id`` to the ``extra_key``.
- Salts: ``cache_salt`` is the seed's second part.
- Images: ``MultimodalDataItem.set_hash`` turns the item's 64-bit hash (``tensor_hash``:
  SHA-256 of the feature's bytes) into four 62-bit sentinels (``_compute_pad_values``) that
  replace the image's placeholder tokens (``pad_mm_tokens``); pages holding a token above
  2**32 are hashed as 64-bit words (``hash_wide_page``), never truncated.
- Prompt embeddings: refused with the radix cache on (``TokenizerManager``); positional
  embedding overrides skip the radix cache (``Req``). Neither is ever hashed into a page.

``schedule_batch``/``mm_utils`` do not import in the CPU environment; their functions run
from SGLang's installed source (``tests/support/sglang_source.py``), and the two statements
the claims rest on are pinned, so an SGLang upgrade that changes them fails here.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array

import pytest
import torch
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed
from sglang.srt.utils import flatten_nested_list

from tests.integrations.sglang.conftest import (
    PAGE_SIZE,
    BackendFactory,
    HostFactory,
    extra_config,
)
from tests.integrations.sglang.test_backend import fill, page_bytes, token_slots, url_of
from tests.support.server_procs import CacheServerProc
from tests.support.sglang_source import method_statements, sglang_function

SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
MM_UTILS = "sglang.srt.managers.mm_utils"

compute_pad_values = sglang_function(SCHEDULE_BATCH, "_compute_pad_values", hashlib=hashlib)
tensor_hash = sglang_function(
    MM_UTILS,
    "tensor_hash",
    hashlib=hashlib,
    torch=torch,
    flatten_nested_list=flatten_nested_list,
    gpu_tensor_hash=None,  # the CUDA path; CPU tensors never reach it
)

TEXT = list(range(100, 100 + 3 * PAGE_SIZE))  # three pages of text
# Adapter ids as SGLang mints them: --lora-paths adapters (uuid5 of name and path) and one
# loaded at run time (uuid4).
LORA_SQL = LoRARef.deterministic_id("sql", "/adapters/sql")
LORA_CHAT = LoRARef.deterministic_id("chat", "/adapters/chat")
LORA_RUNTIME = LoRARef(lora_name="late", lora_path="/adapters/late").lora_id


def page_hashes(
    tokens: list[int],
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
    prior: str | None = None,
) -> list[str]:
    """SGLang's storage page hashes of ``tokens`` for a request of that namespace."""
    key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
    hashes = get_storage_hash_str(key, prior, page_size=PAGE_SIZE)
    assert isinstance(hashes, list)
    return hashes


def request_extra_key(extra_key: str | None, lora_id: str | None) -> str | None:
    """A request's radix/storage ``extra_key`` as ``Req.__init__`` builds it (pinned by
    ``test_sglang_builds_the_key_from_lora_id_and_item_hash``)."""
    return (extra_key or "") + lora_id if lora_id is not None else extra_key


def image_prompt(item_hash: int, start: int, length: int) -> list[int]:
    """``TEXT`` with tokens ``start..start+length`` replaced by the image's sentinels, cycled
    as ``MultimodalDataItem.padding_sequence`` fills a placeholder span."""
    sentinels = compute_pad_values(item_hash.to_bytes(8, byteorder="big"))
    fill = list(itertools.islice(itertools.cycle(sentinels), length))
    return TEXT[:start] + fill + TEXT[start + length :]


def same_size_images() -> tuple[torch.Tensor, torch.Tensor]:
    """Two images' features of the same shape and dtype (different pixels)."""
    gen = torch.Generator().manual_seed(7)
    return torch.rand(16, 24, generator=gen), torch.rand(16, 24, generator=gen)


def assert_disjoint(chains: dict[str, list[str]]) -> None:
    """No page hash of one identity equals any page hash of another."""
    for (a, ha), (b, hb) in itertools.combinations(chains.items(), 2):
        assert not set(ha) & set(hb), f"{a} and {b} share a page hash"


def test_sglang_builds_the_key_from_lora_id_and_item_hash() -> None:
    """The two statements the claims below rest on, as SGLang 0.5.23 writes them."""
    req_init = method_statements(SCHEDULE_BATCH, "Req", "__init__")
    assert "extra_key = (extra_key or '') + lora_id" in req_init
    assert "self.extra_key = extra_key" in req_init
    assert "self.cache_salt = cache_salt or None" in req_init
    set_hash = method_statements(SCHEDULE_BATCH, "MultimodalDataItem", "set_hash")
    assert "self.pad_values = _compute_pad_values(self.hash.to_bytes(8, byteorder='big'))" in (
        set_hash
    )


def test_inputs_the_token_ids_do_not_determine_never_reach_hicache() -> None:
    """Prompt embeddings are refused unless the radix cache (and so HiCache) is off;
    positional embedding overrides skip the radix cache: no page of theirs is hashed."""
    tokenize = method_statements(
        "sglang.srt.managers.tokenizer_manager", "TokenizerManager", "_tokenize_one_request"
    )
    assert any(
        s.startswith("if not get_memory().disable_radix_cache:\n    raise ValueError(")
        for s in tokenize
    )
    req_init = method_statements(SCHEDULE_BATCH, "Req", "__init__")
    assert (
        "self.skip_radix_cache_insert = bootstrap_host == FAKE_BOOTSTRAP_HOST or "
        "positional_embed_overrides is not None" in req_init
    )
    match = method_statements(SCHEDULE_BATCH, "Req", "init_next_round_input")
    assert (
        "if self.positional_embed_overrides is not None:\n    token_ids_to_match = array('q')\n    key_limit = None"
        in match
    )


def test_adapters_separate_every_page() -> None:
    chains = {
        "base": page_hashes(TEXT),
        "sql": page_hashes(TEXT, extra_key=request_extra_key(None, LORA_SQL)),
        "chat": page_hashes(TEXT, extra_key=request_extra_key(None, LORA_CHAT)),
        "runtime": page_hashes(TEXT, extra_key=request_extra_key(None, LORA_RUNTIME)),
    }
    assert all(len(h) == 3 for h in chains.values())
    assert_disjoint(chains)
    # Deterministic: the same adapter and tokens give the same pages (on any server).
    assert page_hashes(TEXT, extra_key=LORA_SQL) == chains["sql"]


def test_salts_and_extra_keys_separate_every_page() -> None:
    chains = {
        "none": page_hashes(TEXT),
        "salt-a": page_hashes(TEXT, cache_salt="tenant-a"),
        "salt-b": page_hashes(TEXT, cache_salt="tenant-b"),
        "extra-a": page_hashes(TEXT, extra_key="tenant-a"),  # same text, other field
        "sql+salt-a": page_hashes(TEXT, extra_key=LORA_SQL, cache_salt="tenant-a"),
        "sql": page_hashes(TEXT, extra_key=LORA_SQL),
        "extra-ab": page_hashes(TEXT, extra_key="tenant-ab"),
        "extra-a,salt-b": page_hashes(TEXT, extra_key="tenant-a", cache_salt="b"),
    }
    assert_disjoint(chains)
    # The seed is length-prefixed per part: moving bytes between the parts changes it.
    assert storage_namespace_seed("ab", "c") != storage_namespace_seed("a", "bc")
    assert storage_namespace_seed(None, None) is None  # unnamespaced chains unchanged


def test_a_continued_chain_keeps_its_namespace() -> None:
    """Prefetch and backup hash a tail from the last hash before it: the tail of a salted
    (or adapter) request stays apart from the same tail of another namespace."""
    salted = page_hashes(TEXT, cache_salt="tenant-a")
    plain = page_hashes(TEXT)
    tail = TEXT[PAGE_SIZE:]
    assert page_hashes(tail, prior=salted[0]) == salted[1:]
    assert page_hashes(tail, prior=plain[0]) == plain[1:]
    assert not set(salted[1:]) & set(plain[1:])


def test_images_of_the_same_size_separate_the_pages_that_hold_them() -> None:
    first, second = same_size_images()
    hash_a, hash_b = tensor_hash([first]), tensor_hash([second])
    assert hash_a != hash_b
    pad_a = compute_pad_values(hash_a.to_bytes(8, byteorder="big"))
    pad_b = compute_pad_values(hash_b.to_bytes(8, byteorder="big"))
    assert len(pad_a) == len(pad_b) == 4 and not set(pad_a) & set(pad_b)

    # The image starts at the last slot of page 0: even that one token separates page 0.
    chains = {
        "a": page_hashes(image_prompt(hash_a, PAGE_SIZE - 1, 6)),
        "b": page_hashes(image_prompt(hash_b, PAGE_SIZE - 1, 6)),
        "text": page_hashes(TEXT),
    }
    assert_disjoint(chains)
    # An image from page 1 on: page 0 (text only) is shared, as it should be.
    late_a = page_hashes(image_prompt(hash_a, PAGE_SIZE, 2))
    late_b = page_hashes(image_prompt(hash_b, PAGE_SIZE, 2))
    assert late_a[0] == late_b[0] == chains["text"][0]
    assert not set(late_a[1:]) & set(late_b[1:])


def test_wide_tokens_are_hashed_whole() -> None:
    """Sentinels are 62-bit: a page is hashed as 64-bit words, so two sentinels that agree
    in their low 32 bits (or 16: the LMCache#3301 cut) still give different pages."""
    low = 0x0123_4567
    one = [low + (1 << 40)] * PAGE_SIZE
    two = [low + (2 << 40)] * PAGE_SIZE
    assert page_hashes(one) != page_hashes(two)
    # And no wide page meets the u32 page of its low bits.
    assert page_hashes(one) != page_hashes([low] * PAGE_SIZE)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_each_identity_reads_back_only_its_own_pages(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    layout: str,
) -> None:
    """Through the backend and a real server: the same tokens stored under every identity
    land under different keys; each identity reads back exactly its own pages."""
    first, second = same_size_images()
    image_a = image_prompt(tensor_hash([first]), PAGE_SIZE - 1, 6)
    image_b = image_prompt(tensor_hash([second]), PAGE_SIZE - 1, 6)
    identities = {
        "base": page_hashes(TEXT),
        "sql": page_hashes(TEXT, extra_key=LORA_SQL),
        "chat": page_hashes(TEXT, extra_key=LORA_CHAT),
        "salt-a": page_hashes(TEXT, cache_salt="tenant-a"),
        "salt-b": page_hashes(TEXT, cache_salt="tenant-b"),
        "sql+salt-a": page_hashes(TEXT, extra_key=LORA_SQL, cache_salt="tenant-a"),
        "image-a": page_hashes(image_a),
        "image-b": page_hashes(image_b),
    }
    writer_host, reader_host = host_pool(layout), host_pool(layout)
    fill(writer_host, seed=11)
    writer = backends(writer_host, extra_config(url_of(cache_server)))
    reader = backends(reader_host, extra_config(url_of(cache_server)))
    src = {name: [3 * i, 3 * i + 1, 3 * i + 2] for i, name in enumerate(identities)}

    # Only base is stored: no other identity finds a page of it.
    assert writer.batch_set_v1(identities["base"], token_slots(src["base"])) == [True] * 3
    for name, keys in identities.items():
        assert reader.batch_exists(keys) == (3 if name == "base" else 0), name

    for name, keys in identities.items():
        assert writer.batch_set_v1(keys, token_slots(src[name])) == [True] * 3
    for i, (name, keys) in enumerate(identities.items()):
        dst = [32 - i, 24 - i, 16 - i]
        assert reader.batch_exists(keys) == 3
        assert reader.batch_get_v1(keys, token_slots(dst)) == [True] * 3
        for s, d in zip(src[name], dst, strict=True):
            assert page_bytes(reader_host, d) == page_bytes(writer_host, s), name
