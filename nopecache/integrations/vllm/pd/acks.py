"""The producer's worker: which requests' stores the servers acknowledged.

A prefill engine (``kv_role="kv_producer"``) returns ``delay_free_blocks=True`` from
``request_finished`` for every request it stored, so vLLM keeps the request's blocks until
the worker reports it in ``get_finished``'s ``finished_sending``. vLLM allows that only for
ids it has passed to ``get_finished`` as finished (this call or an earlier one): a request
is reported once its store futures are all done *and* vLLM said it finished, never before
(its blocks are still in use) and exactly once.

Concurrency: ``add`` and ``finished`` run on the worker's model-runner thread; the futures
complete on the client's loop thread and are only read here.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable

from nopecache.client.storing import StoreReport

__all__ = ["StoreAcks"]

log = logging.getLogger(f"vllm.{__name__}")


class StoreAcks:
    """Store futures per request, reported once vLLM finished the request too."""

    def __init__(self) -> None:
        """No stores pending."""
        self._stores: dict[str, list[concurrent.futures.Future[StoreReport]]] = {}
        self._finished: set[str] = set()  # vLLM finished them, stores maybe pending
        self.failed = 0  # stores that raised or left blocks unstored

    def add(self, req_id: str, future: concurrent.futures.Future[StoreReport]) -> None:
        """Track one store of ``req_id`` (a request has one per head group)."""
        self._stores.setdefault(req_id, []).append(future)

    def ensure(self, req_id: str) -> None:
        """Track ``req_id`` as stored (nothing pending) unless a store of it is tracked:
        a producer's save that could not start still has to free its blocks."""
        if req_id not in self._stores:
            done: concurrent.futures.Future[StoreReport] = concurrent.futures.Future()
            done.set_result(StoreReport(failed=1))
            self._stores[req_id] = [done]

    def pending(self) -> int:
        """Requests with a store not yet reported."""
        return len(self._stores)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose every store is done and that vLLM finished (now or before)."""
        self._finished.update(r for r in finished_req_ids if r in self._stores)
        done = {r for r in self._finished if all(f.done() for f in self._stores[r])}
        for req_id in done:
            self._finished.discard(req_id)
            for future in self._stores.pop(req_id):
                self._check(req_id, future)
        return done

    def _check(self, req_id: str, future: concurrent.futures.Future[StoreReport]) -> None:
        # A failed store still frees the blocks: the decode engine finds them missing at
        # its deadline and recomputes them.
        if future.cancelled():
            self.failed += 1
            return
        err = future.exception()
        if err is not None:
            self.failed += 1
            log.warning("nopecache: store of %s failed: %s", req_id, err)
        elif future.result().failed:
            self.failed += 1
            log.warning("nopecache: %d blocks of %s not stored", future.result().failed, req_id)
