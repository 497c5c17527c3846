"""Cost-aware fetch: keep a cache hit only when fetching it beats recomputing it.

A remote fetch is not free. Over a slow link or a loaded shared Redis, fetching a block
can take longer than the engine needs to prefill its tokens again, and then the cache
makes time-to-first-token worse. :class:`CostModel` compares two estimates per hit::

    fetch_s   = rtt(server) + block_bytes / bandwidth(server)     measured on this client
    prefill_s = hit_tokens / prefill_tokens_per_s                  reported or learned

and keeps the hit when ``fetch_s * safety_factor <= prefill_s``. It keeps every hit of a
server it has not measured often enough yet (``min_samples``): without data, dropping a
hit would throw work away on a guess, and the first fetches are the measurements.

Estimators, per server, over its last ``window`` samples younger than ``max_age_s``:

* ``rtt``: the mean latency of small calls (:meth:`CostModel.observe_rtt`; a Lookup is
  one), exponentially weighted with ``ewma_alpha``.
* ``bandwidth``: a ratio of sums, ``sum(bytes) / sum(seconds - rtt)`` over the window's
  fetches. A ratio of sums (not a mean of per-fetch rates) weighs large transfers by
  their size and cannot blow up on a fetch that took almost no time beyond its round
  trip. Every sample of the window weighs the same, so a cold first fetch (channel
  set-up, page faults) is one of ``window`` and ages out of it, never the estimate's
  starting point that later samples only nudge.
* ``prefill``: ``prefill_tokens_per_s`` from the config when set, else
  ``sum(tokens) / sum(seconds)`` of the engine's :meth:`CostModel.observe_prefill` over
  the same kind of window once there are ``min_samples`` of them, else
  ``default_prefill_tokens_per_s``. The adapters report every prefill they run.

It keeps learning. A dropped hit is never fetched, so it measures nothing; a model that
only dropped would never see a server get faster. Three rules prevent that lock-out:

* samples expire after ``max_age_s``: a server unmeasured again is tried again;
* a server whose hits are dropped gets one hit in ``1 / probe_share`` kept anyway
  (reason ``"probe"``), whose fetch is a fresh sample;
* the window is short (``window``), so a few fast probes outvote the slow past.

So a server that was slow and is fast again gets its hits back within about
``window / probe_share`` dropped hits (tests pin the bound). :meth:`CostModel.snapshot`
shows both estimates and the last decision per server; the client's ``stats().cost``
is that snapshot.

Prefill time is modelled as linear in tokens. Attention makes long prefills superlinear,
so the model errs toward dropping hits on very long prompts, the safe direction for
latency. A fetch moves the whole block even when the plan uses only the tail of it (a
hit trimmed at the front), so the bytes are the block's and the tokens are the hit's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey
from nopecache.client.plan import Hit
from nopecache.proto.block import DTYPE_ITEMSIZE, StoredForm
from nopecache.proto.kv_codec import CodecError, payload_layout

__all__ = [
    "CostConfig",
    "CostFilter",
    "CostModel",
    "CostSnapshot",
    "FetchDecision",
    "ServerCost",
    "bytes_per_token",
]

# A 7-8B model on one datacenter GPU prefills on the order of 10^4 tokens/s; this is the
# guess used until the engine reports or the client learns the real rate.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0


def _check_number(name: str, value: object, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(name, f"must be a number, got {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidArgumentError(name, f"must be finite, got {value}")
    if positive and value <= 0:
        raise InvalidArgumentError(name, f"must be > 0, got {value}")
    if value < 0:
        raise InvalidArgumentError(name, f"must be >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class CostConfig:
    """How the client decides whether a hit is worth fetching (see the module docstring)."""

    enabled: bool = True
    # The engine's prefill rate when it reports one; None: learn it from observe_prefill.
    prefill_tokens_per_s: float | None = None
    # The rate assumed before anything is reported or learned.
    default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    # A hit is kept when fetch_s * safety_factor <= prefill_s. Above 1 because the fetch
    # estimate is noisy and a wrong keep costs latency directly, while a wrong drop only
    # costs the compute the cache would have saved.
    safety_factor: float = 1.2
    # Fetches of a server (and prefills) needed before their estimate is trusted.
    min_samples: int = 3
    # Weight of the newest sample in the round-trip average.
    ewma_alpha: float = 0.2
    # Samples an estimate is made of (the newest ones): short, so the model follows change.
    window: int = 8
    # Samples older than this are forgotten (a server unmeasured again is tried again).
    max_age_s: float = 120.0
    # Share of a server's would-be-dropped hits kept anyway, to measure it again.
    probe_share: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidArgumentError("cost.enabled", f"must be a bool, got {self.enabled!r}")
        if self.prefill_tokens_per_s is not None:
            rate = _check_number("cost.prefill_tokens_per_s", self.prefill_tokens_per_s)
            object.__setattr__(self, "prefill_tokens_per_s", rate)
        object.__setattr__(
            self,
            "default_prefill_tokens_per_s",
            _check_number("cost.default_prefill_tokens_per_s", self.default_prefill_tokens_per_s),
        )
        object.__setattr__(
            self, "safety_factor", _check_number("cost.safety_factor", self.safety_factor)
        )
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int):
            raise InvalidArgumentError(
                "cost.min_samples", f"must be an int, got {self.min_samples!r}"
            )
        if self.min_samples < 1:
            raise InvalidArgumentError("cost.min_samples", f"must be >= 1, got {self.min_samples}")
        alpha = _check_number("cost.ewma_alpha", self.ewma_alpha)
        if alpha > 1:
            raise InvalidArgumentError("cost.ewma_alpha", f"must be in (0, 1], got {alpha}")
        object.__setattr__(self, "ewma_alpha", alpha)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise InvalidArgumentError("cost.window", f"must be an int >= 1, got {self.window!r}")
        if self.window < self.min_samples:
            raise InvalidArgumentError(
                "cost.window", f"{self.window} is less than min_samples {self.min_samples}"
            )
        object.__setattr__(self, "max_age_s", _check_number("cost.max_age_s", self.max_age_s))
        share = _check_number("cost.probe_share", self.probe_share)
        if share > 1:
            raise InvalidArgumentError("cost.probe_share", f"must be in (0, 1], got {share}")
        object.__setattr__(self, "probe_share", share)


def bytes_per_token(fingerprint: ModelFingerprint, v_head_dim: int | None = None) -> int:
    """Payload bytes one token adds to a block: K and V of every layer and KV head.

    ``layers * kv_heads * (head_dim + v_head_dim) * itemsize`` (itemsize 1 for what a
    ``kv_codec`` holds in fp8); ``v_head_dim`` defaults
    to ``head_dim`` (0 for MLA, whose block holds no V). The block header (key, token
    ids, checksum) is left out: it is a few bytes per token against kilobytes of KV.
    """
    if not isinstance(fingerprint, ModelFingerprint):
        raise InvalidArgumentError(
            "fingerprint", f"must be a ModelFingerprint, got {type(fingerprint).__name__}"
        )
    if v_head_dim is None:
        v_head_dim = 0 if fingerprint.form is StoredForm.MLA else fingerprint.head_dim
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim < 0:
        raise InvalidArgumentError("v_head_dim", f"must be an int >= 0, got {v_head_dim!r}")
    itemsize = DTYPE_ITEMSIZE[fingerprint.dtype]
    one = (fingerprint.num_layers, 1, fingerprint.num_kv_heads, fingerprint.head_dim)
    try:  # a compact form's elements; its per-block scales are left out like the header
        lay = payload_layout(fingerprint.codec, itemsize, one, v_head_dim)
    except CodecError as e:
        raise InvalidArgumentError("kv_codec", str(e)) from e
    return lay.k_nbytes + lay.v_nbytes


@dataclass(frozen=True, slots=True)
class FetchDecision:
    """Why a hit was kept or dropped: the two estimates the decision compared.

    ``fetch_s`` is None when the server has too few samples to estimate (the hit is
    then kept untested); ``prefill_s`` is the recompute time of the hit's tokens.
    """

    keep: bool
    server: str
    nbytes: int
    tokens: int
    fetch_s: float | None
    prefill_s: float
    # "disabled", "unmeasured", "cheaper_to_fetch", "cheaper_to_recompute" or "probe" (a
    # hit kept although recomputing looked cheaper, to measure the server again)
    reason: str


class _Ewma:
    """An exponentially weighted mean that starts at its first sample."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1


class _Window:
    """The newest ``size`` (amount, seconds) samples, each stamped with when it was taken."""

    __slots__ = ("_samples",)

    def __init__(self, size: int) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=size)

    def add(self, now: float, amount: float, seconds: float) -> None:
        self._samples.append((now, amount, seconds))

    def live(self, now: float, max_age_s: float) -> list[tuple[float, float, float]]:
        """The samples younger than ``max_age_s`` (older ones are dropped for good)."""
        samples = self._samples
        while samples and now - samples[0][0] > max_age_s:
            samples.popleft()
        return list(samples)


class _ServerStats:
    """RTT average, fetch window, probe counter and last decision of one server."""

    __slots__ = ("drops", "fetches", "last", "probes", "rtt")

    def __init__(self, config: CostConfig) -> None:
        self.rtt = _Ewma(config.ewma_alpha)
        self.fetches = _Window(config.window)
        self.drops = 0  # hits dropped since the last probe
        self.probes = 0  # probes taken in all
        self.last: FetchDecision | None = None


@dataclass(frozen=True, slots=True)
class ServerCost:
    """What the model believes about one server (None: not measured, hits are kept)."""

    rtt_s: float | None
    bandwidth_bytes_per_s: float | None
    samples: int  # live fetch samples in the window
    probes: int  # hits kept as probes so far
    last_decision: FetchDecision | None


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    """Both sides of the decision, as a client's ``stats().cost`` shows them."""

    enabled: bool
    prefill_tokens_per_s: float
    prefill_source: str  # "config", "engine" (learned from observe_prefill) or "default"
    prefill_samples: int
    servers: Mapping[str, ServerCost] = field(default_factory=dict)


class CostModel:
    """Per-server fetch estimates and the engine's prefill rate; thread-safe.

    Concurrency: one ``threading.Lock`` guards every estimator (the per-server table and
    the prefill window). Each method holds it for a few arithmetic operations and never
    across I/O, so fetch threads may record samples while the planner asks for decisions.
    ``clock`` (seconds, monotonic) dates samples; injectable for tests.
    """

    def __init__(
        self, config: CostConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """A model with no samples yet, configured by ``config`` (defaults if None)."""
        if config is None:
            config = CostConfig()
        if not isinstance(config, CostConfig):
            raise InvalidArgumentError(
                "config", f"must be a CostConfig, got {type(config).__name__}"
            )
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._servers: dict[str, _ServerStats] = {}
        self._prefills = _Window(config.window)

    def _server(self, server: str) -> _ServerStats:
        # Caller holds self._lock.
        stats = self._servers.get(server)
        if stats is None:
            stats = self._servers[server] = _ServerStats(self.config)
        return stats

    # -- samples ----------------------------------------------------------------------
    def observe_fetch(self, server: str, nbytes: int, seconds: float) -> None:
        """Record that fetching ``nbytes`` from ``server`` took ``seconds`` (whole call)."""
        _check_server(server)
        _check_number("nbytes", nbytes, positive=False)
        seconds = _check_number("seconds", seconds, positive=False)
        with self._lock:
            self._server(server).fetches.add(self._clock(), float(nbytes), seconds)

    def observe_rtt(self, server: str, seconds: float) -> None:
        """Record the latency of a call to ``server`` that moved almost no payload."""
        _check_server(server)
        seconds = _check_number("seconds", seconds, positive=False)
        with self._lock:
            self._server(server).rtt.add(seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Record that the engine prefilled ``tokens`` tokens in ``seconds``."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidArgumentError("tokens", f"must be an int >= 1, got {tokens!r}")
        seconds = _check_number("seconds", seconds)
        with self._lock:
            self._prefills.add(self._clock(), float(tokens), seconds)

    # -- estimates --------------------------------------------------------------------
    def rtt_s(self, server: str) -> float | None:
        """The averaged round trip to ``server``, or None before any sample."""
        with self._lock:
            stats = self._servers.get(server)
            if stats is None or stats.rtt.count == 0:
                return None
            return stats.rtt.value

    def bandwidth_bytes_per_s(self, server: str) -> float | None:
        """Measured transfer rate from ``server`` (None: too few live samples)."""
        with self._lock:
            return self._bandwidth(self._servers.get(server))

    def _bandwidth(self, stats: _ServerStats | None) -> float | None:
        # Caller holds self._lock.
        if stats is None:
            return None
        samples = stats.fetches.live(self._clock(), self.config.max_age_s)
        if len(samples) < self.config.min_samples:
            return None
        rtt = stats.rtt.value if stats.rtt.count else 0.0
        nbytes = sum(s[1] for s in samples)
        seconds = sum(s[2] for s in samples)
        transfer_s = seconds - rtt * len(samples)
        if transfer_s <= 0.0:
            # Fetches finished within one averaged round trip (small blocks, or shared
            # memory beating the RTT): the payload time is not separable, so the whole
            # call time counts as transfer. A lower bound on bandwidth, never "free": an
            # infinite rate would price any later fetch, however large, at one RTT.
            return nbytes / seconds if seconds > 0.0 else float("inf")
        return nbytes / transfer_s

    def estimate_fetch_s(self, server: str, nbytes: int, *, with_rtt: bool = True) -> float | None:
        """Estimated seconds to fetch ``nbytes`` from ``server``; None with too few samples.

        ``with_rtt=False`` leaves the round trip out, for a block that rides in a Get
        stream whose round trip another block already paid.
        """
        _check_number("nbytes", nbytes, positive=False)
        with self._lock:
            stats = self._servers.get(server)
            bandwidth = self._bandwidth(stats)
            if stats is None or bandwidth is None:
                return None
            rtt = stats.rtt.value if (with_rtt and stats.rtt.count) else 0.0
        return rtt + nbytes / bandwidth

    def _prefill_rate(self) -> tuple[float, str, int]:
        # Caller holds self._lock.
        samples = self._prefills.live(self._clock(), self.config.max_age_s)
        if self.config.prefill_tokens_per_s is not None:
            return self.config.prefill_tokens_per_s, "config", len(samples)
        if len(samples) >= self.config.min_samples:
            return sum(s[1] for s in samples) / sum(s[2] for s in samples), "engine", len(samples)
        return self.config.default_prefill_tokens_per_s, "default", len(samples)

    def prefill_tokens_per_s(self) -> float:
        """The prefill rate used: configured, else learned from the engine, else default."""
        with self._lock:
            return self._prefill_rate()[0]

    def estimate_prefill_s(self, tokens: int) -> float:
        """Estimated seconds for the engine to prefill ``tokens`` tokens."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidArgumentError("tokens", f"must be an int >= 0, got {tokens!r}")
        return tokens / self.prefill_tokens_per_s()

    # -- decisions --------------------------------------------------------------------
    def decide(self, hit: Hit, nbytes: int, server: str, *, with_rtt: bool = True) -> FetchDecision:
        """The keep/drop decision for fetching ``hit`` (``nbytes`` of block) from ``server``
        (a query: no probing, nothing recorded; :class:`CostFilter` does both)."""
        if not isinstance(hit, Hit):
            raise InvalidArgumentError("hit", f"must be a Hit, got {type(hit).__name__}")
        _check_server(server)
        prefill_s = self.estimate_prefill_s(hit.num_tokens)
        if not self.config.enabled:
            return FetchDecision(True, server, nbytes, hit.num_tokens, None, prefill_s, "disabled")
        fetch_s = self.estimate_fetch_s(server, nbytes, with_rtt=with_rtt)
        if fetch_s is None:
            return FetchDecision(
                True, server, nbytes, hit.num_tokens, None, prefill_s, "unmeasured"
            )
        keep = fetch_s * self.config.safety_factor <= prefill_s
        reason = "cheaper_to_fetch" if keep else "cheaper_to_recompute"
        return FetchDecision(keep, server, nbytes, hit.num_tokens, fetch_s, prefill_s, reason)

    def keep(self, hit: Hit, nbytes: int, server: str) -> bool:
        """True when ``hit`` is worth fetching from ``server`` (see :meth:`decide`)."""
        return self.decide(hit, nbytes, server).keep

    def record(self, decision: FetchDecision) -> FetchDecision:
        """Note a decision taken for a plan, turning every ``1 / probe_share``-th drop of
        its server into a probe (kept to measure the server again); the final decision."""
        with self._lock:
            stats = self._server(decision.server)
            if not decision.keep and decision.reason == "cheaper_to_recompute":
                stats.drops += 1
                if stats.drops * self.config.probe_share >= 1.0:
                    stats.drops = 0
                    stats.probes += 1
                    decision = replace(decision, keep=True, reason="probe")
            stats.last = decision
        return decision

    def snapshot(self) -> CostSnapshot:
        """Both estimates and the last decision per server, now."""
        with self._lock:
            rate, source, count = self._prefill_rate()
            servers = {}
            for name, stats in self._servers.items():
                servers[name] = ServerCost(
                    rtt_s=stats.rtt.value if stats.rtt.count else None,
                    bandwidth_bytes_per_s=self._bandwidth(stats),
                    samples=len(stats.fetches.live(self._clock(), self.config.max_age_s)),
                    probes=stats.probes,
                    last_decision=stats.last,
                )
        return CostSnapshot(self.config.enabled, rate, source, count, servers)

    def hit_filter(self, bytes_per_token: int, owner: Callable[[bytes], str]) -> CostFilter:
        """A ``keep`` filter for one :func:`~nopecache.client.plan.plan_reuse` call."""
        return CostFilter(self, bytes_per_token, owner)


class CostFilter:
    """A ``plan_reuse`` keep filter that records each decision it makes.

    One filter serves one plan. A plan's blocks travel in one Get stream per server, so
    only the first block kept from a server is charged the round trip; the rest cost
    their bytes. ``decisions`` maps each block key to the decision taken for it (probes
    included, see :meth:`CostModel.record`).
    """

    def __init__(
        self, model: CostModel, bytes_per_token: int, owner: Callable[[bytes], str]
    ) -> None:
        """A filter deciding with ``model``; ``owner`` maps a key's bytes to its server."""
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int):
            raise InvalidArgumentError(
                "bytes_per_token", f"must be an int, got {bytes_per_token!r}"
            )
        if bytes_per_token < 1:
            raise InvalidArgumentError("bytes_per_token", f"must be >= 1, got {bytes_per_token}")
        if not callable(owner):
            raise InvalidArgumentError("owner", f"must be callable, got {owner!r}")
        self.model = model
        self.bytes_per_token = bytes_per_token
        self.owner = owner
        self.decisions: dict[BlockKey, FetchDecision] = {}
        self._charged: set[str] = set()

    def __call__(self, hit: Hit) -> bool:
        """True to keep ``hit`` in the plan."""
        server = self.owner(bytes(hit.key))
        # The whole stored block travels, even when the plan uses only its tail.
        nbytes = hit.source.end * self.bytes_per_token
        decision = self.model.record(
            self.model.decide(hit, nbytes, server, with_rtt=server not in self._charged)
        )
        if decision.keep:
            self._charged.add(server)
        self.decisions[hit.key] = decision
        return decision.keep

    def dropped(self) -> list[FetchDecision]:
        """Decisions that dropped a hit, in the order they were taken."""
        return [d for d in self.decisions.values() if not d.keep]


def _check_server(server: object) -> None:
    if not isinstance(server, str) or not server:
        raise InvalidArgumentError("server", f"must be a non-empty str, got {server!r}")
