"""The server's one typed configuration object and where its values come from.

Every option is a field of :class:`ServerConfig` and has exactly one spelling per source,
derived mechanically from the field name (so deploy manifests can be checked against it):

    field            max_block_bytes
    command line     --max-block-bytes 64MiB
    environment      NOPECACHE_MAX_BLOCK_BYTES=64MiB
    TOML file        max_block_bytes = "64MiB"      (file given by --config / NOPECACHE_CONFIG)

Lists (``tiers``) are a repeated flag (``--tier URL --tier URL``), a whitespace-separated
environment value (URLs may contain commas: ``redis+cluster://a:1,b:2``) or a TOML array.
Booleans are ``--write-through`` / ``--no-write-through``, ``1/0/true/false/yes/no/on/off``
in the environment, and TOML booleans. Sizes take ``8GiB``, ``512MiB``, ``10MB`` or a byte
count.
"""

from __future__ import annotations

import argparse
import logging
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from nopecache.cache_server.faults import FaultSpec, FaultSpecError, parse_fault_spec
from nopecache.proto.contract import DEFAULT_PORT
from nopecache.proto.sizes import SizeError, format_size, parse_size

__all__ = [
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "FRAME_OVERHEAD_BYTES",
    "ConfigError",
    "ServerConfig",
    "build_parser",
    "env_name",
    "flag_name",
    "load_config",
    "split_listen",
]

ENV_PREFIX = "NOPECACHE_"
DEFAULT_METRICS_PORT = 9464
# Room kept in every message for the non-payload fields of a frame (index, tier, sizes,
# tier names), so that a frame with max_frame_data_bytes of data fits max_message_bytes.
FRAME_OVERHEAD_BYTES = 4096
# gRPC lengths are signed 32-bit.
_GRPC_MAX_MESSAGE = (1 << 31) - 1
_MIN_MESSAGE = 64 * 1024
# min_stream_rate: a slower floor cuts nobody in time, a faster one cuts real links.
_MIN_RATE = 1024
_MAX_RATE = 1024**3
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """An option has an invalid value; the message names the option and its source."""


# Kinds of option value; each converts a raw value (str from flags/env, native from TOML).
_STR, _INT, _FLOAT, _BOOL, _SIZE, _URLS = "str", "int", "float", "bool", "size", "urls"
_FAULTS = "faults"
_RATE = "rate"


def _opt(kind: str, help_text: str, metavar: str | None = None) -> dict[str, str | None]:
    """Field metadata: how the option is parsed and its --help text."""
    return {"kind": kind, "help": help_text, "metavar": metavar}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Configuration of one nopecache server process.

    Precedence, highest first: command-line flags > ``NOPECACHE_*`` environment variables >
    the TOML file named by ``--config`` (or ``NOPECACHE_CONFIG``) > the defaults below.
    A source only overrides the options it sets. The defaults are the embedded mode: one
    CPU tier of 1 GiB, gRPC on 127.0.0.1:50551, metrics on 127.0.0.1:9464.
    """

    host: str = field(
        default="127.0.0.1",
        metadata=_opt(_STR, "address the gRPC server binds to (0.0.0.0 for all interfaces)"),
    )
    port: int = field(default=DEFAULT_PORT, metadata=_opt(_INT, "gRPC port; 0 picks a free port"))
    tiers: tuple[str, ...] = field(
        default=("cpu://?capacity=1GiB",),
        metadata=_opt(
            _URLS,
            "storage tier URL, fastest first; repeat for several (cuda://0?capacity=..., "
            "cpu://?capacity=..., file:///dir?capacity=..., redis://host:port/db, rediss://..., "
            "redis+cluster://...)",
            "URL",
        ),
    )
    write_through: bool = field(
        default=False,
        metadata=_opt(_BOOL, "also write every stored block to the last tier (shared Redis)"),
    )
    # gRPC's own default: a client with stock channel options can talk to the server, and
    # measured on loopback, 1-4 MiB messages move faster than 8-16 MiB ones (cache reuse).
    max_message_bytes: int = field(
        default=4 * 1024**2,
        metadata=_opt(
            _SIZE, "largest gRPC message sent or received; blocks travel in frames below it"
        ),
    )
    max_block_bytes: int = field(
        default=64 * 1024**2, metadata=_opt(_SIZE, "largest block accepted by Put")
    )
    max_request_bytes: int = field(
        default=256 * 1024**2,
        metadata=_opt(_SIZE, "largest total of block bytes in one Put stream (held until it ends)"),
    )
    max_keys_per_request: int = field(
        default=65536,
        metadata=_opt(_INT, "most keys in one Lookup/Get/Delete, or blocks in one Put"),
    )
    metrics: bool = field(default=True, metadata=_opt(_BOOL, "serve Prometheus metrics over HTTP"))
    metrics_host: str = field(
        default="127.0.0.1", metadata=_opt(_STR, "address the metrics HTTP server binds to")
    )
    metrics_port: int = field(
        default=DEFAULT_METRICS_PORT,
        metadata=_opt(_INT, "metrics HTTP port; 0 picks a free port"),
    )
    metrics_tenant_labels: bool = field(
        default=False,
        metadata=_opt(
            _BOOL,
            "also serve the per-tenant series (nopecache_tenant_*, they name tenants) on the "
            "metrics port, which has no authentication: only where only operators reach it",
        ),
    )
    shutdown_grace_s: float = field(
        default=10.0,
        metadata=_opt(
            _FLOAT, "seconds in-flight requests get to finish after SIGTERM/SIGINT", "SECONDS"
        ),
    )
    tune_malloc: bool = field(
        default=True,
        metadata=_opt(
            _BOOL,
            "keep freed block-sized buffers in the process (glibc mallopt) instead of "
            "returning each to the kernel: 2-3x block throughput, RSS stays at its peak",
        ),
    )
    log_level: str = field(
        default="INFO", metadata=_opt(_STR, f"log level, one of {', '.join(_LOG_LEVELS)}")
    )
    # -- security (see docs/security.md): all off in the embedded default ----------------
    tls_cert_file: str = field(
        default="",
        metadata=_opt(
            _STR,
            "PEM certificate chain the gRPC port serves; with --tls-key-file turns TLS on",
            "FILE",
        ),
    )
    tls_key_file: str = field(
        default="", metadata=_opt(_STR, "PEM private key of --tls-cert-file", "FILE")
    )
    tls_client_ca_file: str = field(
        default="",
        metadata=_opt(
            _STR,
            "PEM CA bundle that client certificates must chain to; when set, every client "
            "must present one (mutual TLS)",
            "FILE",
        ),
    )
    auth_tokens_file: str = field(
        default="",
        metadata=_opt(
            _STR,
            "bearer tokens: lines 'TOKEN TENANT', or TOML [tenants.NAME] tokens = [...] "
            "quota = '1GiB'; any token turns auth on (health and reflection stay open)",
            "FILE",
        ),
    )
    # Secret: kept out of repr; a flag would show in `ps`, so prefer the environment.
    auth_tokens: str = field(
        default="",
        repr=False,
        metadata=_opt(
            _STR,
            "bearer tokens inline, 'TOKEN TENANT' entries separated by ';' or newlines "
            "(prefer the environment variable or the file: flags show in ps)",
            "SPEC",
        ),
    )
    tenant_quota: int = field(
        default=0,
        metadata=_opt(
            _SIZE,
            "byte quota of every tenant (0: none); a TOML tokens file may set one per tenant",
        ),
    )
    admin_tokens_file: str = field(
        default="",
        metadata=_opt(
            _STR,
            "bearer tokens of the admin role (nopecache-admin: flush all, quotas, drain), one "
            "per line; any admin token locks the Admin service to tokens",
            "FILE",
        ),
    )
    # Secret, like auth_tokens.
    admin_tokens: str = field(
        default="",
        repr=False,
        metadata=_opt(
            _STR,
            "admin bearer tokens inline, separated by ';' or newlines (prefer the environment "
            "variable or the file: flags show in ps)",
            "SPEC",
        ),
    )
    admin_listen: str = field(
        default="",
        metadata=_opt(
            _STR,
            "where the Admin service (flush, drain, quotas) listens: '' (auto: on the gRPC "
            "port when a token is configured or host is 127.0.0.1/::1/localhost, else off), "
            "'port' (on the gRPC port, even open), 'off', or HOST:PORT (a listener of its "
            "own; 0 picks a free port); open without tokens beyond loopback logs a warning",
            "WHERE",
        ),
    )
    health_listen: str = field(
        default="",
        metadata=_opt(
            _STR,
            "HOST:PORT of a listener serving grpc.health.v1 only, outside the gRPC port's "
            "connection and call caps (point probes at it); '' for none",
            "HOST:PORT",
        ),
    )
    bulk_listen: str = field(
        default="",
        metadata=_opt(
            _STR,
            "HOST:PORT the bulk byte stream listens on; '' for the gRPC host and a free "
            "port (a front proxy needs a fixed one to forward to)",
            "HOST:PORT",
        ),
    )
    bulk_advertise_port: int = field(
        default=0,
        metadata=_opt(
            _INT,
            "the bulk port OpenBulk tells clients to dial (on the host they dialled for "
            "gRPC); 0 for the port it listens on. Behind a front proxy: the proxy's bulk port",
        ),
    )
    max_health_watches_per_peer: int = field(
        default=2,
        metadata=_opt(
            _INT,
            "Health.Watch streams one address may hold open (each listener); more are "
            "refused RESOURCE_EXHAUSTED",
        ),
    )
    pin_max_ttl_s: float = field(
        default=86400.0,
        metadata=_opt(
            _FLOAT, "the longest a soft pin lasts; longer TTLs asked for are cut to it", "SECONDS"
        ),
    )
    max_streams_per_client: int = field(
        default=256,
        metadata=_opt(
            _INT,
            "most RPCs one client may have in flight (per tenant with auth, per connection "
            "without); more are refused RESOURCE_EXHAUSTED",
        ),
    )

    # -- bounded memory (see docs/security.md, hardening) -------------------------------------------
    max_inflight_bytes: int = field(
        default=512 * 1024**2,
        metadata=_opt(
            _SIZE,
            "block bytes all Put and Get streams together may hold in flight; streams wait "
            "(back-pressure) when it is full",
        ),
    )
    max_inflight_bytes_per_client: int = field(
        default=256 * 1024**2,
        metadata=_opt(
            _SIZE,
            "share of max_inflight_bytes one client may hold (its tenant with auth, its "
            "connection without); at least max_request_bytes",
        ),
    )
    stream_idle_timeout_s: float = field(
        default=30.0,
        metadata=_opt(
            _FLOAT,
            "a Put that sends no frame, a Get whose reader takes no frame, or a stream "
            "that waits for the in-flight budget this long is cut",
            "SECONDS",
        ),
    )
    min_stream_rate: int = field(
        default=64 * 1024,
        metadata=_opt(
            _RATE,
            "bytes per second a stream holding in-flight budget (a Put, a Get being sent) "
            "must move while the server waits for its peer, over each min_rate_window_s; "
            "a slower one is cut and its budget returned (64KiB/s, 1MiB/s or bytes)",
            "RATE",
        ),
    )
    min_rate_window_s: float = field(
        default=5.0,
        metadata=_opt(
            _FLOAT,
            "the window min_stream_rate is measured over, and the grace a block or frame "
            "gets beyond its size at that rate",
            "SECONDS",
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=_opt(
            _INT, "most client connections the gRPC port holds open; more are closed at once"
        ),
    )
    max_concurrent_rpcs: int = field(
        default=1024,
        metadata=_opt(
            _INT,
            "RPCs the server serves at once, all clients together; past it a client is "
            "admitted only within its fair share (this / clients holding calls)",
        ),
    )
    max_probe_calls_per_peer: int = field(
        default=8,
        metadata=_opt(
            _INT,
            "calls without a token (health, reflection) one address may have in flight",
        ),
    )
    connection_idle_timeout_s: float = field(
        default=60.0,
        metadata=_opt(
            _FLOAT,
            "a gRPC connection with no call in flight this long is closed (clients "
            "reconnect on their next call)",
            "SECONDS",
        ),
    )
    handshake_timeout_s: float = field(
        default=5.0,
        metadata=_opt(
            _FLOAT,
            "a connection that has not finished its TLS/HTTP2 handshake this long is closed",
            "SECONDS",
        ),
    )

    # -- same-host zero copy (docs/data-plane.md) ---------------------------------------------
    zero_copy: bool = field(
        default=True,
        metadata=_opt(
            _BOOL,
            "offer same-host clients of the only tenant a read-only mapping of the cpu:// "
            "tier's pool (the cuda:// tier's over CUDA IPC) and read leases of its pages "
            "(auth with several tenants: never)",
        ),
    )
    zero_copy_share: float = field(
        default=0.25,
        metadata=_opt(
            _FLOAT,
            "most of the cpu:// (or cuda://) tier's pool that clients' read leases may hold at once, in "
            "(0, 0.5]; past it a Get takes the copying paths",
            "FRACTION",
        ),
    )
    zero_copy_lease_ttl_s: float = field(
        default=30.0,
        metadata=_opt(
            _FLOAT,
            "a client's read lease ends this long after it was granted unless released "
            "first (a crashed client's pages come back then), in [0.05, 3600]",
            "SECONDS",
        ),
    )

    # -- testing and staging only (faults.py, docs/operations.md) ------------------------------
    fault_injection: FaultSpec | None = field(
        default=None,
        metadata=_opt(
            _FAULTS,
            "TESTING AND STAGING ONLY: damage a seeded share of the blocks Get, the bulk "
            "stream and zero copy send (never what is stored), e.g. 'seed=7,rate=0.2,"
            "kinds=flip,truncate,drop,delay,delay_ms=50'; kinds: flip_payload, flip_header, "
            "flip, truncate, drop, delay; 'off' to disable",
            "SPEC",
        ),
    )

    def __post_init__(self) -> None:
        if self.fault_injection is not None and not isinstance(self.fault_injection, FaultSpec):
            raise ConfigError(
                f"fault_injection: must be a FaultSpec or None, got {self.fault_injection!r}"
            )
        if not 0 < self.zero_copy_share <= 0.5:
            raise ConfigError(
                f"zero_copy_share: must be in (0, 0.5] (the tier lends at most half its "
                f"pool), got {self.zero_copy_share}"
            )
        if not 0.05 <= self.zero_copy_lease_ttl_s <= 3600:
            raise ConfigError(
                f"zero_copy_lease_ttl_s: must be in [0.05, 3600] seconds, got "
                f"{self.zero_copy_lease_ttl_s}"
            )
        for name in ("host", "metrics_host"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: must not be empty")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name}: must be in [0, 65535], got {value}")
        if not self.tiers:
            raise ConfigError("tiers: at least one tier URL is required")
        for url in self.tiers:
            if "://" not in url:
                raise ConfigError(f"tiers: {url!r} is not a URL (expected scheme://...)")
        if not _MIN_MESSAGE <= self.max_message_bytes <= _GRPC_MAX_MESSAGE:
            raise ConfigError(
                f"max_message_bytes: must be in [{format_size(_MIN_MESSAGE)}, "
                f"{_GRPC_MAX_MESSAGE}], got {self.max_message_bytes}"
            )
        if self.max_block_bytes <= 0:
            raise ConfigError(f"max_block_bytes: must be positive, got {self.max_block_bytes}")
        if self.max_request_bytes < self.max_block_bytes:
            raise ConfigError(
                f"max_request_bytes: {self.max_request_bytes} is below max_block_bytes "
                f"{self.max_block_bytes}; one block must fit in a request"
            )
        if self.max_keys_per_request <= 0:
            raise ConfigError(
                f"max_keys_per_request: must be positive, got {self.max_keys_per_request}"
            )
        if self.pin_max_ttl_s <= 0:
            raise ConfigError(f"pin_max_ttl_s: must be > 0, got {self.pin_max_ttl_s}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not one of {_LOG_LEVELS}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError(f"{missing}: tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(
                "tls_client_ca_file: client certificates need TLS; set tls_cert_file and "
                "tls_key_file too"
            )
        if not self.max_request_bytes <= self.max_inflight_bytes_per_client:
            raise ConfigError(
                f"max_inflight_bytes_per_client: {self.max_inflight_bytes_per_client} is below "
                f"max_request_bytes {self.max_request_bytes}; one client's largest Put must fit"
            )
        if self.max_inflight_bytes < self.max_inflight_bytes_per_client:
            raise ConfigError(
                f"max_inflight_bytes: {self.max_inflight_bytes} is below "
                f"max_inflight_bytes_per_client {self.max_inflight_bytes_per_client}"
            )
        if not self.stream_idle_timeout_s > 0:
            raise ConfigError(
                f"stream_idle_timeout_s: must be > 0, got {self.stream_idle_timeout_s}"
            )
        if not _MIN_RATE <= self.min_stream_rate <= _MAX_RATE:
            raise ConfigError(
                f"min_stream_rate: must be in [{format_size(_MIN_RATE)}/s, "
                f"{format_size(_MAX_RATE)}/s], got {self.min_stream_rate} bytes/s"
            )
        if not 0.1 <= self.min_rate_window_s <= 3600:
            raise ConfigError(
                f"min_rate_window_s: must be in [0.1, 3600] seconds, got {self.min_rate_window_s}"
            )
        if self.max_connections < 1:
            raise ConfigError(f"max_connections: must be >= 1, got {self.max_connections}")
        if self.max_concurrent_rpcs < 1:
            raise ConfigError(f"max_concurrent_rpcs: must be >= 1, got {self.max_concurrent_rpcs}")
        if self.max_probe_calls_per_peer < 1:
            raise ConfigError(
                f"max_probe_calls_per_peer: must be >= 1, got {self.max_probe_calls_per_peer}"
            )
        for name in ("connection_idle_timeout_s", "handshake_timeout_s"):
            value = getattr(self, name)
            if not 0.001 <= value <= 86400:
                raise ConfigError(f"{name}: must be in [0.001, 86400] seconds, got {value}")
        if self.admin_listen not in ("", "port", "off"):
            split_listen(self.admin_listen, "admin_listen")
        if self.health_listen:
            split_listen(self.health_listen, "health_listen")
        if self.bulk_listen:
            split_listen(self.bulk_listen, "bulk_listen")
        if not 0 <= self.bulk_advertise_port <= 65535:
            raise ConfigError(
                f"bulk_advertise_port: must be in [0, 65535], got {self.bulk_advertise_port}"
            )
        if self.max_health_watches_per_peer < 1:
            raise ConfigError(
                f"max_health_watches_per_peer: must be >= 1, got {self.max_health_watches_per_peer}"
            )
        if self.max_streams_per_client < 1:
            raise ConfigError(
                f"max_streams_per_client: must be >= 1, got {self.max_streams_per_client}"
            )

    @property
    def max_frame_data_bytes(self) -> int:
        """The most payload bytes one PutFrame/GetFrame carries."""
        return self.max_message_bytes - FRAME_OVERHEAD_BYTES

    @property
    def tls_enabled(self) -> bool:
        """Whether the gRPC port speaks TLS."""
        return bool(self.tls_cert_file)

    @property
    def admin_auth_enabled(self) -> bool:
        """Whether the Admin service needs an admin or tenant token (admin tokens set)."""
        return bool(self.admin_tokens_file or self.admin_tokens)

    @property
    def auth_enabled(self) -> bool:
        """Whether calls need a bearer token (any token source configured)."""
        return bool(self.auth_tokens_file or self.auth_tokens)

    @property
    def log_level_number(self) -> int:
        """``log_level`` as a ``logging`` level number."""
        return int(logging.getLevelName(self.log_level.upper()))

    @property
    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel arguments both sides must share (message size limits)."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


def split_listen(value: str, option: str) -> tuple[str, int]:
    """(host, port) of a ``HOST:PORT`` option value (``[::1]:PORT`` for IPv6)."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{option}: expected HOST:PORT (port in [0, 65535]), got {value!r}")
    return host, int(port)


def flag_name(field_name: str) -> str:
    """The command-line flag of a ServerConfig field (``max_block_bytes`` -> ``--max-block-bytes``)."""
    # A repeated flag reads better singular: --tier A --tier B.
    if field_name == "tiers":
        return "--tier"
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """The environment variable of a ServerConfig field (``port`` -> ``NOPECACHE_PORT``)."""
    return ENV_PREFIX + field_name.upper()


def _convert(kind: str, raw: Any, where: str) -> Any:
    """A raw option value (str from flags/env, native from TOML) as the field's type."""
    try:
        if kind == _FAULTS:
            if not isinstance(raw, str):
                raise ConfigError(f"{where}: expected a string like 'seed=7,rate=0.2', got {raw!r}")
            return parse_fault_spec(raw)
        if kind == _SIZE:
            return parse_size(raw, field=where)
        if kind == _RATE:
            return _parse_rate(raw, where)
        if kind == _URLS:
            items: Iterable[Any] = raw.split() if isinstance(raw, str) else raw
            urls = tuple(items)
            if not all(isinstance(u, str) for u in urls):
                raise ConfigError(f"{where}: expected a list of URL strings, got {raw!r}")
            return urls
        if kind == _BOOL:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
                return raw.strip().lower() in _TRUE
            raise ConfigError(f"{where}: expected a boolean (true/false), got {raw!r}")
        if kind == _INT:
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise ConfigError(f"{where}: expected an integer, got {raw!r}")
            return int(raw)
        if kind == _FLOAT:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ConfigError(f"{where}: expected a number, got {raw!r}")
            return float(raw)
        if not isinstance(raw, str):
            raise ConfigError(f"{where}: expected a string, got {raw!r}")
        return raw
    except SizeError as e:
        raise ConfigError(str(e)) from e
    except FaultSpecError as e:
        raise ConfigError(f"{where}: {e}") from e
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: cannot parse {raw!r}: {e}") from e


def _parse_rate(raw: Any, where: str) -> int:
    """Bytes per second from ``64KiB/s``, ``64KiB`` or a byte count."""
    if isinstance(raw, str) and raw.strip().lower().endswith("/s"):
        raw = raw.strip()[:-2]
    return parse_size(raw, field=where)


def _kinds() -> dict[str, str]:
    """Field name -> option kind, for every ServerConfig field."""
    return {f.name: f.metadata["kind"] for f in fields(ServerConfig)}


def _from_toml(path: Path) -> dict[str, Any]:
    """The options set in a TOML file, converted."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML: {e}") from e
    kinds = _kinds()
    unknown = sorted(set(data) - set(kinds))
    if unknown:
        raise ConfigError(
            f"config: {path} sets unknown option(s) {unknown}; known: {sorted(kinds)}"
        )
    return {k: _convert(kinds[k], v, f"{k} (in {path})") for k, v in data.items()}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The options set in ``NOPECACHE_*`` variables, converted."""
    out = {}
    for name, kind in _kinds().items():
        var = env_name(name)
        if var in env:
            out[name] = _convert(kind, env[var], var)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: one flag per ServerConfig field, plus --config."""
    parser = argparse.ArgumentParser(
        prog="nopecache-server",
        description="nopecache KV-block cache server (gRPC). "
        "Precedence: flags > NOPECACHE_* environment > --config TOML file > defaults.",
        # Unset flags must be absent from the namespace so lower-precedence sources show.
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"TOML file with options named like the fields below (env {ENV_PREFIX}CONFIG)",
    )
    for f in fields(ServerConfig):
        kind = f.metadata["kind"]
        default = f.default if f.default is not MISSING else None
        shown = format_size(default) if kind == _SIZE and isinstance(default, int) else default
        if kind == _RATE and isinstance(default, int):
            shown = f"{format_size(default)}/s"
        if kind == _URLS and isinstance(default, tuple):
            shown = " ".join(default)
        if kind == _FAULTS:
            shown = "off"
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}; default: {shown}]"
        if kind == _BOOL:
            parser.add_argument(
                flag_name(f.name), action=argparse.BooleanOptionalAction, help=help_text
            )
        elif kind == _URLS:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                action="append",
                metavar=f.metadata["metavar"],
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(f.name), dest=f.name, metavar=f.metadata["metavar"], help=help_text
            )
    return parser


def load_config(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    parser_factory: Callable[[], argparse.ArgumentParser] = build_parser,
) -> ServerConfig:
    """Builds the ServerConfig from flags, environment and TOML file (see ServerConfig)."""
    env = os.environ if env is None else env
    args = vars(parser_factory().parse_args(argv))
    config_path = args.pop("config", None)
    if config_path is None and env.get(ENV_PREFIX + "CONFIG"):
        config_path = Path(env[ENV_PREFIX + "CONFIG"])
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(_from_toml(Path(config_path)))
    values.update(_from_env(env))
    kinds = _kinds()
    values.update({k: _convert(kinds[k], v, flag_name(k)) for k, v in args.items()})
    return ServerConfig(**values)
