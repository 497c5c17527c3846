"""The content behind SGLang's adapter ids: what scopes a server's pages when it loads LoRA
adapters at start-up.

SGLang folds a request's ``lora_id`` into its page hashes (``tests/integrations/sglang/
test_page_identity.py``). For the adapters it loads at start-up (``--lora-paths``) that id
is ``LoRARef.deterministic_id(name, path)``, a uuid5 of the name and the path: the same on
every server that names an adapter alike, whatever its files hold. Two servers sharing one
nopecache would then serve each other KV of different adapters under one id: an adapter
retrained in place and rolled out to some servers, a path that holds other files on another
machine, a hub id that resolved to another revision. (Adapters loaded at run time get a
fresh uuid4: never shared, never confused; they need nothing here.)

So when SGLang loads adapters at start-up, every page key of the server is scoped by
:func:`adapter_scope`, a digest of each such adapter's name and file bytes: servers whose
start-up adapters agree byte for byte share pages; any other pair shares none, base model
pages included (a page hash does not say whether an adapter computed it). Within one
scope an adapter id (name and path) names one content, as SGLang assumes. An adapter
whose files this process cannot read scopes the server to itself (a random scope, logged).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import xxhash

__all__ = ["adapter_digest", "adapter_scope", "scoped_page_hash"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


def _hub_snapshot(path: str) -> Path | None:
    """The local snapshot of hub id ``path`` already downloaded (SGLang loads adapters
    before it builds the storage backend), None if there is none."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:
        return None


def adapter_digest(path: str) -> bytes | None:
    """xxh3-128 of the adapter's files (names and bytes) at a local ``path`` or in the hub
    cache; None when its files are not on this machine."""
    root = Path(path)
    if not root.exists():
        snapshot = _hub_snapshot(path)
        if snapshot is None:
            return None
        root = snapshot
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = xxhash.xxh3_128()
    for f in files:
        name = f.relative_to(root).as_posix().encode("utf-8") if f != root else b""
        digest.update(len(name).to_bytes(8, "little") + name)
        digest.update(f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
    return digest.digest()


def adapter_scope(adapters: Sequence[tuple[str, str]]) -> bytes | None:
    """The scope of a server's page keys for its start-up ``(name, path)`` adapters: None
    when there are none (keys unscoped), random when one's files cannot be read."""
    if not adapters:
        return None
    digest = xxhash.xxh3_128(b"nopecache-sglang-adapters-v1")
    for name, path in sorted(adapters):
        content = adapter_digest(path)
        if content is None:
            log.warning(
                "nopecache: LoRA adapter %r: no files at %r on this machine; this server's "
                "pages are shared with no other server",
                name,
                path,
            )
            return os.urandom(16)
        # Not the path: SGLang's id holds it already, and servers that keep the same files
        # elsewhere may share their base-model pages.
        part = name.encode("utf-8")
        digest.update(len(part).to_bytes(8, "little") + part + content)
    return digest.digest()


def scoped_page_hash(scope: bytes | None, page_hash: str) -> str | bytes:
    """SGLang's ``page_hash`` as the backend keys it: as is without a scope, else the
    16-byte scope before it (binary before hex: never an SGLang page hash itself)."""
    return page_hash if scope is None else scope + page_hash.encode("utf-8")
