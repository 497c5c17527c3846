"""Start-up LoRA adapters scope a server's pages by their files (``adapters.py``).

SGLang names a ``--lora-paths`` adapter by a uuid5 of its name and path, so two servers that
load different files under one name and path hash the adapter's pages alike. Each test
publishes SGLang's own ``ServerArgs`` in this process as its launcher does (and puts the
previous configuration back after it); backends are built by SGLang's factory and meet
through a real server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang.srt import runtime_context
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.server_args import ServerArgs

from nopecache.integrations.sglang import compat
from nopecache.integrations.sglang.adapters import adapter_digest, adapter_scope
from nopecache.integrations.sglang.backend import NopecacheStorage
from tests.integrations.sglang.conftest import BackendFactory, HostFactory, extra_config
from tests.integrations.sglang.test_backend import fill, token_slots, url_of
from tests.integrations.sglang.test_page_identity import TEXT, page_hashes
from tests.support.server_procs import CacheServerProc
from tests.support.tiny_llama import CONFIG

Publish = Callable[..., None]


@pytest.fixture
def publish(tmp_path: Path) -> Iterator[Publish]:
    """``publish(**server_args)``: SGLang's configuration for a tiny model, published in this
    process as a scheduler's; the previous one is restored after the test."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    saved = runtime_context.snapshot_context()

    def run(**fields: Any) -> None:
        args = ServerArgs(model_path=str(model), device="cpu", **fields)
        runtime_context.publish(args, role="scheduler")

    yield run
    runtime_context.restore_context(saved)


def write_adapter(path: Path, weights: bytes) -> Path:
    """A PEFT-shaped adapter folder: its config and a weights file of ``weights``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA"}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def sql_pages(path: Path) -> list[str]:
    """SGLang's page hashes of ``TEXT`` for a request on the start-up adapter ``sql=path``
    (its id as SGLang mints it, its ``extra_key`` as ``Req`` builds it)."""
    return page_hashes(TEXT, extra_key=LoRARef.deterministic_id("sql", str(path)))


def store(backend: NopecacheStorage, host: Any, keys: list[str]) -> None:
    fill(host, seed=5)
    assert backend.batch_set_v1(keys, token_slots([0, 1, 2])) == [True] * 3


def test_startup_adapters_read_every_form_sglang_accepts(publish: Publish) -> None:
    assert compat.startup_adapters() == []  # nothing published: a backend outside a server
    publish(
        enable_lora=True,
        lora_paths=[
            "sql=/adapters/sql",
            "/adapters/bare",
            {"lora_name": "chat", "lora_path": "/adapters/chat"},
        ],
    )
    assert compat.startup_adapters() == [
        ("sql", "/adapters/sql"),
        ("/adapters/bare", "/adapters/bare"),
        ("chat", "/adapters/chat"),
    ]
    # As the launcher hands them to the scheduler: normalized to LoRARef records.
    ref = LoRARef(
        lora_id=LoRARef.deterministic_id("sql", "/adapters/sql"),
        lora_name="sql",
        lora_path="/adapters/sql",
    )
    publish(enable_lora=True, lora_paths=[ref])
    assert compat.startup_adapters() == [("sql", "/adapters/sql")]
    publish(lora_paths={"sql": "/adapters/sql"})  # enable_lora unset: on with paths
    assert compat.startup_adapters() == [("sql", "/adapters/sql")]
    publish(enable_lora=False, lora_paths=["sql=/adapters/sql"])  # SGLang ignores them
    assert compat.startup_adapters() == []
    publish(enable_lora=True)  # adapters loaded at run time only: uuid4 ids
    assert compat.startup_adapters() == []


def test_an_adapter_retrained_in_place_shares_no_page_with_the_old_one(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    publish: Publish,
    tmp_path: Path,
) -> None:
    """Same name, same path, other weights: the regression (without the scope the new
    server found all three pages of the old adapter)."""
    adapter = write_adapter(tmp_path / "sql", b"weights v1" * 100)
    publish(enable_lora=True, lora_paths=[f"sql={adapter}"])
    old_host = host_pool("page_first")
    old = backends(old_host, extra_config(url_of(cache_server)))
    store(old, old_host, sql_pages(adapter))
    same = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert same.batch_exists(sql_pages(adapter)) == 3  # same files: shared

    write_adapter(adapter, b"weights v2" * 100)  # same size, other bytes
    publish(enable_lora=True, lora_paths=[f"sql={adapter}"])
    new = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert new.batch_exists(sql_pages(adapter)) == 0
    assert old.adapter_scope is not None and new.adapter_scope is not None
    assert old.adapter_scope != new.adapter_scope


def test_servers_with_the_same_adapter_files_share_pages(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    publish: Publish,
    tmp_path: Path,
) -> None:
    """Two copies of one adapter: under the same path the adapter's pages are shared; under
    another path SGLang's id (and so its page hashes) differ, the base pages are shared."""
    first = write_adapter(tmp_path / "a" / "sql", b"same weights")
    second = write_adapter(tmp_path / "b" / "sql", b"same weights")
    publish(enable_lora=True, lora_paths=[f"sql={first}"])
    host = host_pool("page_first")
    writer = backends(host, extra_config(url_of(cache_server)))
    store(writer, host, sql_pages(first))
    publish(enable_lora=True, lora_paths=[f"sql={first}"])
    reader = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert reader.batch_exists(sql_pages(first)) == 3

    fill(host, seed=6)
    assert writer.batch_set_v1(page_hashes(TEXT), token_slots([3, 4, 5])) == [True] * 3
    publish(enable_lora=True, lora_paths=[f"sql={second}"])
    elsewhere = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert elsewhere.adapter_scope == writer.adapter_scope
    assert elsewhere.batch_exists(page_hashes(TEXT)) == 3


def test_without_startup_adapters_keys_are_unscoped(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    publish: Publish,
) -> None:
    """LoRA on with run-time adapters only: base pages are shared with LoRA-less servers."""
    host = host_pool("page_first")
    plain = backends(host, extra_config(url_of(cache_server)))
    assert plain.adapter_scope is None
    store(plain, host, page_hashes(TEXT))
    publish(enable_lora=True, max_loras_per_batch=2)
    lora_on = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert lora_on.adapter_scope is None
    assert lora_on.batch_exists(page_hashes(TEXT)) == 3


def test_an_adapter_whose_files_are_not_here_shares_nothing(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    publish: Publish,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    missing = tmp_path / "not-downloaded"
    publish(enable_lora=True, lora_paths=[f"sql={missing}"])
    host = host_pool("page_first")
    with caplog.at_level(logging.WARNING, logger="nopecache.integrations.sglang.adapters"):
        first = backends(host, extra_config(url_of(cache_server)))
    assert f"no files at {str(missing)!r}" in caplog.text
    store(first, host, sql_pages(missing))
    assert first.batch_exists(sql_pages(missing)) == 3
    second = backends(host_pool("page_first"), extra_config(url_of(cache_server)))
    assert second.batch_exists(sql_pages(missing)) == 0


def hub_adapter(cache: Path, repo: str, revision: str, weights: bytes) -> None:
    """An adapter as ``huggingface_hub`` leaves a download in its cache: a snapshot per
    revision, ``refs/main`` naming the current one."""
    root = cache / f"models--{repo.replace('/', '--')}"
    write_adapter(root / "snapshots" / revision, weights)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)


def test_a_hub_adapter_is_scoped_by_its_downloaded_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--lora-paths sql=org/sql-lora``: SGLang downloads it before it builds the backend;
    the scope reads the files of the revision in the hub cache."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub_adapter(cache, "org/sql-lora", "a" * 40, b"revision one")
    one = adapter_scope([("sql", "org/sql-lora")])
    assert one is not None
    assert adapter_digest("org/sql-lora") == adapter_digest(
        str(cache / "models--org--sql-lora" / "snapshots" / ("a" * 40))
    )
    hub_adapter(cache, "org/sql-lora", "b" * 40, b"revision two")
    two = adapter_scope([("sql", "org/sql-lora")])
    assert two is not None and two != one
    assert adapter_digest("org/other-lora") is None  # not downloaded
