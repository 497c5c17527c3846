"""How a client cuts a prompt into blocks and keys them: one place for the client and its
stand-ins (the transformers adapter's in-process store plans through this too).

A prompt gets two key sets::

    prefix chain   FixedChunker(prefix_block_tokens) from position 0, chained keys
    content keys   the content chunker (or, with ``segments``, each segment content-
                   chunked from its own start), keyed by their tokens alone

Position-independent blocks are always NOPE (MLA keeps its own latent form), whatever
form the exact-prefix blocks are stored in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from nopecache.client.chunking import (
    Chunker,
    ContentChunker,
    FixedChunker,
    SegmentChunker,
    TokenArray,
)
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.identity import InputIdentity
from nopecache.client.keys import KeyedChunk, Namespace, content_chunks, prefix_chunks
from nopecache.proto.block import StoredForm


def pi_fingerprint(fingerprint: ModelFingerprint) -> ModelFingerprint:
    """The fingerprint position-independent blocks are keyed under (NOPE, or MLA's own)."""
    if fingerprint.form in (StoredForm.NOPE, StoredForm.MLA):
        return fingerprint
    return replace(fingerprint, form=StoredForm.NOPE)


@dataclass(frozen=True, slots=True)
class KeyPlanner:
    """The chunkers and fingerprints a client keys prompts with (see the module doc).

    ``content`` is the content chunker segments are cut with when ``chunker`` is not one.
    """

    fingerprint: ModelFingerprint
    namespace: Namespace
    prefix_chunker: FixedChunker
    chunker: Chunker
    content: ContentChunker

    @property
    def pi_fingerprint(self) -> ModelFingerprint:
        """Fingerprint of the position-independent keys."""
        return pi_fingerprint(self.fingerprint)

    def pi_chunker(self, chunking: Chunker | None, segments: Sequence[int] | None) -> Chunker:
        """The chunker for content keys: ``chunking``, segments content-chunked, or the default."""
        if segments is None:
            return self.chunker if chunking is None else chunking
        if chunking is not None:
            raise InvalidArgumentError("segments", "give segments or chunking, not both")
        content = self.chunker if isinstance(self.chunker, ContentChunker) else self.content
        return SegmentChunker(segments, content)

    def keys(
        self,
        tokens: TokenArray,
        namespace: Namespace | None,
        chunker: Chunker,
        *,
        prefix: bool,
        pi: bool,
        identity: InputIdentity | None = None,
        prefix_end: int | None = None,
    ) -> tuple[list[KeyedChunk], list[KeyedChunk]]:
        """The prefix chain and the content keys of ``tokens`` (each empty when not asked);
        ``identity``: what beside the tokens shapes their KV (``identity.py``).

        ``prefix_end``: the chain holds only the blocks that end at or before it (the KV
        after it is approximate: it attended to reused position-independent KV, so it
        gets content keys only); None: the whole prompt.
        """
        ns = self.namespace if namespace is None else namespace
        if prefix_end is not None and (
            isinstance(prefix_end, bool)
            or not isinstance(prefix_end, int)
            or not 0 <= prefix_end <= len(tokens)
        ):
            raise InvalidArgumentError(
                "prefix_end", f"must be an int in [0, {len(tokens)}], got {prefix_end!r}"
            )
        spans = self.prefix_chunker.split(tokens) if prefix else []
        if prefix_end is not None:
            spans = [span for span in spans if span.end <= prefix_end]
        pre = prefix_chunks(self.fingerprint, ns, tokens, spans, identity) if spans else []
        content = (
            content_chunks(self.pi_fingerprint, ns, tokens, chunker.split(tokens), identity)
            if pi
            else []
        )
        return pre, content
