"""A block arriving in several gRPC frames is copied into one buffer as each frame comes
(issue 36, finding 4): no frame's message stays referenced until the block is complete,
and completing it does not join the frames into a second copy of the block."""

from __future__ import annotations

import sys

import pytest

from nopecache.cache_server.refusal import Refusal
from nopecache.cache_server.transfer_put import PartialBlock


def test_a_partial_block_keeps_no_frame_once_it_is_copied() -> None:
    frames = [bytes([i]) * 1000 for i in range(3)]
    before = [sys.getrefcount(f) for f in frames]
    block = PartialBlock(b"k" * 16, 3000, memoryview(frames[0]), position=0)
    assert not block.add(memoryview(frames[1]))
    assert block.add(memoryview(frames[2]))
    # Each frame's message can be freed as soon as its data is in (a view kept until
    # the block completes would hold it, and a join would copy the block a second time).
    assert [sys.getrefcount(f) for f in frames] == before
    blob = block.blob()
    assert blob.nbytes == 3000 and bytes(blob) == b"".join(frames)
    assert blob.obj is block.buffer  # the one buffer, not a joined copy


def test_a_partial_block_refuses_bytes_past_its_size() -> None:
    block = PartialBlock(b"k" * 16, 10, memoryview(b"x" * 8), position=3)
    with pytest.raises(Refusal) as err:
        block.add(memoryview(b"yyy"))
    assert err.value.message == (
        "PutFrame.data: block #3 got 11 bytes, more than its total_size 10"
    )
