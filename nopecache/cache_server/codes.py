"""The gRPC wire forms of the transfer rules' results, shared by both codecs.

A :class:`~.refusal.RefusalKind` is a gRPC status code on the wire in two places: the
status of an aborted call (``service.py``) and ``PutResult.code`` of a refused block,
which the bulk stream carries too (its PUT answers a serialized PutReply, proto/bulk.py).
The table is here, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from nopecache.cache_server.refusal import RefusalKind
from nopecache.cache_server.store import PutOutcome
from nopecache.cache_server.transfer_put import BlockResult
from nopecache.proto import cache_pb2 as pb

__all__ = ["STATUS", "put_reply"]

STATUS: dict[RefusalKind, grpc.StatusCode] = {
    RefusalKind.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.OVER_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.TOO_SLOW: grpc.StatusCode.DEADLINE_EXCEEDED,
    RefusalKind.STALE_SESSION: grpc.StatusCode.FAILED_PRECONDITION,
    RefusalKind.TIER_DOWN: grpc.StatusCode.UNAVAILABLE,
}
"""The gRPC status of each kind of refusal."""

_STORED = {
    PutOutcome.STORED: pb.PUT_OUTCOME_STORED,
    PutOutcome.ALREADY_PRESENT: pb.PUT_OUTCOME_ALREADY_PRESENT,
}


def put_reply(results: Sequence[BlockResult]) -> pb.PutReply:
    """The PutReply of a finished Put: one PutResult per block, in order."""
    encoded = []
    for result in results:
        refusal = result.refusal
        if refusal is not None:
            encoded.append(
                pb.PutResult(
                    key=result.key,
                    outcome=pb.PUT_OUTCOME_REJECTED,
                    code=STATUS[refusal.kind].value[0],
                    reason=refusal.message,
                )
            )
        elif result.outcome is None:
            encoded.append(pb.PutResult(key=result.key))
        else:
            encoded.append(pb.PutResult(key=result.key, outcome=_STORED[result.outcome]))
    return pb.PutReply(results=encoded)
