"""Prefill/decode disaggregation through the shared cache (``kv_role`` producer/consumer).

::

    client --> proxy --(max_tokens=1)--> prefill engine (kv_producer)
                 |                          stores the prompt's blocks; request_finished
                 |                          answers kv_transfer_params = HandOff (digest of
                 |                          the keys, count) and holds the blocks until the
                 |                          servers acknowledged the store (StoreAcks)
                 +--(kv_transfer_params)--> decode engine (kv_consumer)
                                            waits for exactly those blocks (wait_for_prefix,
                                            bounded by handoff_deadline_ms, answering "not
                                            yet" meanwhile), claims and loads them; missing
                                            at the deadline: recomputed, counted, logged once

    handoff.py   the kv_transfer_params both engines agree on (HandOff)
    acks.py      the producer's worker: which requests' stores finished (StoreAcks)
    waiting.py   the consumer's scheduler: look up until the named blocks landed
    proxy.py     the OpenAI-compatible proxy in front of both (``nopecache-pd-proxy``)

Nothing here imports vLLM: the halves call it with plain values.
"""

from __future__ import annotations

from nopecache.integrations.vllm.pd.acks import StoreAcks
from nopecache.integrations.vllm.pd.handoff import PARAMS_KEY, HandOff, keys_digest
from nopecache.integrations.vllm.pd.waiting import Backoff, wait_for_prefix

__all__ = ["PARAMS_KEY", "Backoff", "HandOff", "StoreAcks", "keys_digest", "wait_for_prefix"]
