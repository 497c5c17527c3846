"""InputIdentity: what besides a prompt's token ids shapes its KV, in a form keys can fold.

Two prompts with the same token ids can have different KV: an engine runs them under
different LoRA adapters, per-request cache salts (a tenant's isolation), images behind
identical placeholder tokens, or prompt embeddings at sentinel token ids. Every key of a
block folds in what shapes that block (``keys.py``), so such blocks are never shared:

    request     bytes applying to every block of the prompt (adapter, salt): an engine
                integration encodes them canonically (the vLLM connector: CBOR of vLLM's
                own tagged keys)
    features    runs of positions whose KV depends on an input beside the token ids: an
                image's placeholder (identified by the engine's item hash) or a run of
                prompt embeddings (by the digest of their bytes)

A block over ``[start, end)`` is keyed by the request bytes and by every feature it
overlaps, each as ``(kind, digest, feature.start - start, feature.end - feature.start)``:
offsets relative to the block, so the same image at the same place in a moved chunk
keeps its content key, and a chunk that holds part of an image is keyed by the whole
image and where it sits. An empty identity (plain text, no adapter, no salt) adds
nothing: such keys equal those of a client that knows no identity.

Encoding (all integers little-endian)::

    span_bytes = u32 len(request) + request
               + u32 n + n * (u8 len(kind) + kind + u32 len(digest) + digest
                              + i64 relative start + u32 length)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from nopecache.client.errors import InvalidArgumentError

__all__ = ["InputFeature", "InputIdentity"]

_U32 = struct.Struct("<I")
_PLACE = struct.Struct("<qI")
_U32_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class InputFeature:
    """Positions ``[start, end)`` whose KV depends on an input named by ``digest``."""

    start: int
    end: int
    kind: str  # "mm" (a multimodal item's placeholder), "prompt_embeds"
    digest: bytes  # the input's identity: the engine's item hash, or a digest of the bytes

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, f"must be an int >= 0, got {value!r}")
        if self.end <= self.start or self.end > _U32_MAX:
            raise InvalidArgumentError("end", f"must be in ({self.start}, 2**32), got {self.end}")
        if not isinstance(self.kind, str) or not self.kind or len(self.kind.encode()) > 255:
            raise InvalidArgumentError("kind", f"must be a short non-empty str, got {self.kind!r}")
        if not isinstance(self.digest, bytes) or not self.digest:
            raise InvalidArgumentError("digest", f"must be non-empty bytes, got {self.digest!r}")

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the feature shares a position with ``[start, end)``."""
        return self.start < end and start < self.end

    def encode(self, block_start: int) -> bytes:
        """The feature as seen from a block starting at ``block_start``."""
        kind = self.kind.encode()
        return b"".join(
            (
                bytes((len(kind),)),
                kind,
                _U32.pack(len(self.digest)),
                self.digest,
                _PLACE.pack(self.start - block_start, self.end - self.start),
            )
        )


@dataclass(frozen=True, slots=True)
class InputIdentity:
    """What shapes a prompt's KV besides its token ids (see the module docstring)."""

    request: bytes = b""
    features: tuple[InputFeature, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request, bytes):
            raise InvalidArgumentError("request", f"must be bytes, got {self.request!r}")
        features = tuple(self.features)
        for feature in features:
            if not isinstance(feature, InputFeature):
                raise InvalidArgumentError(
                    "features", f"must be InputFeatures, got {type(feature).__name__}"
                )
        object.__setattr__(self, "features", tuple(sorted(features, key=_order)))

    @property
    def empty(self) -> bool:
        """True when nothing beside the token ids shapes the KV (keys as for plain text)."""
        return not self.request and not self.features

    def span_bytes(self, start: int, end: int) -> bytes:
        """What a block over ``[start, end)`` folds into its key (b"": nothing)."""
        seen = [f.encode(start) for f in self.features if f.overlaps(start, end)]
        if not self.request and not seen:
            return b""
        return b"".join((_U32.pack(len(self.request)), self.request, _U32.pack(len(seen)), *seen))


def _order(feature: InputFeature) -> tuple[int, int, str, bytes]:
    return feature.start, feature.end, feature.kind, feature.digest
