"""ClientConfig: validation, the URL form, the gRPC service config on real channels, and
clients agreeing on keys through the URL (against a real server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace

import grpc
import pytest
import torch

from nopecache.cache_server.config import ServerConfig
from nopecache.client import CacheClient, ModelFingerprint
from nopecache.client.cache_client import DEFAULT_CHUNKER
from nopecache.client.chunking import ContentChunker, FixedChunker
from nopecache.client.config import (
    DEFAULT_PORT,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    ENV_URL,
    METHODS,
    SERVICE,
    URL_PARAMS,
    ClientConfig,
    RetryPolicy,
    config_fields,
    normalize_server,
    split_server,
    url_fields,
)
from nopecache.client.cost import CostConfig
from nopecache.client.errors import InvalidArgumentError
from nopecache.kernels import RopeSpec
from nopecache.proto import cache_pb2
from nopecache.proto.block import StoredForm
from nopecache.proto.sizes import parse_size
from tests.support.server_procs import CacheServerProc

# -- defaults and agreement with the server ---------------------------------------------


def test_defaults() -> None:
    cfg = ClientConfig(servers=("cache:50551",))
    assert cfg.lookup_timeout_s == 0.5
    assert cfg.get_timeout_s == 5.0
    assert cfg.put_timeout_s == 10.0
    assert cfg.control_timeout_s == 2.0
    assert cfg.connect_timeout_s == 1.0
    assert cfg.retry == RetryPolicy(3, 0.05, 0.5, 2.0, ("UNAVAILABLE",), 10, 0.1)
    assert cfg.shm == "auto"
    assert cfg.max_message_bytes == 64 * 1024**2
    assert cfg.store_queue_blocks == 256
    assert cfg.down_backoff_s == 1.0
    assert cfg.cost == CostConfig()
    assert cfg.namespace == ""
    assert cfg.discover == "off"
    assert cfg.dns_refresh_s == 30.0
    assert cfg.dns_min_interval_s == 1.0
    assert cfg.dns_family == "any"
    assert cfg.prefix_block_tokens == 256
    assert (cfg.chunk_min_tokens, cfg.chunk_avg_tokens, cfg.chunk_max_tokens) == (16, 64, 256)
    assert (cfg.tls, cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file) == (
        False,
        None,
        None,
        None,
    )
    assert cfg.token is None
    assert cfg.use_tls is False


def test_client_receives_whatever_a_default_server_sends() -> None:
    server = ServerConfig()
    # The client must receive any frame a default server sends.
    assert ClientConfig(("h:1",)).max_message_bytes >= server.max_message_bytes
    assert ClientConfig(("h:1",)).max_message_bytes >= server.max_block_bytes


def test_every_field_has_exactly_one_url_parameter() -> None:
    assert url_fields() == config_fields()
    assert len(URL_PARAMS) == len(config_fields())


# -- server addresses -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("cache:7000", "cache:7000"),
        ("Cache-0.Cache-Headless.NS.svc:7000", "cache-0.cache-headless.ns.svc:7000"),
        ("cache", f"cache:{DEFAULT_PORT}"),
        ("10.0.0.1:1", "10.0.0.1:1"),
        ("[::1]:65535", "[::1]:65535"),
        ("[::1]", f"[::1]:{DEFAULT_PORT}"),
        ("[2001:DB8:0:0::1]:9", "[2001:db8::1]:9"),
        (" h:5 ", "h:5"),
    ],
)
def test_normalize_server(address: str, expected: str) -> None:
    assert normalize_server(address) == expected


@pytest.mark.parametrize(
    "address",
    ["", "h:", "h:0", "h:65536", "h:x", "::1:5", "[::1", "[::1]5", "[zz]:5", "-h:5", "h h:5"],
)
def test_bad_server_names_servers(address: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig(servers=(address,))
    assert err.value.argument == "servers"


def test_servers_are_normalized_and_distinct() -> None:
    listed = ClientConfig(servers=["B:1", "a"])  # type: ignore[arg-type]
    assert listed.servers == ("b:1", f"a:{DEFAULT_PORT}")
    with pytest.raises(InvalidArgumentError, match=r"^servers: h:1 is listed twice$"):
        ClientConfig(servers=("h:1", "H:1"))
    with pytest.raises(InvalidArgumentError, match=r"^servers: at least one"):
        ClientConfig(servers=())
    with pytest.raises(InvalidArgumentError, match=r"^servers: must be a tuple"):
        ClientConfig(servers="h:1")  # type: ignore[arg-type]


# -- field validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
        ({"get_timeout_s": -1.0}, "get_timeout_s"),
        ({"put_timeout_s": float("inf")}, "put_timeout_s"),
        ({"control_timeout_s": "1"}, "control_timeout_s"),
        ({"connect_timeout_s": True}, "connect_timeout_s"),
        ({"down_backoff_s": -0.1}, "down_backoff_s"),
        ({"dns_refresh_s": float("nan")}, "dns_refresh_s"),
        ({"dns_min_interval_s": -1}, "dns_min_interval_s"),
        ({"discover": "srv"}, "discover"),
        ({"discover": True}, "discover"),
        ({"dns_family": "inet"}, "dns_family"),
        ({"prefix_block_tokens": 0}, "prefix_block_tokens"),
        ({"prefix_block_tokens": 16.0}, "prefix_block_tokens"),
        ({"chunk_min_tokens": 0}, "chunk_min_tokens"),
        ({"chunk_min_tokens": 128}, "chunk_min_tokens"),
        ({"chunk_avg_tokens": 300}, "chunk_avg_tokens"),
        ({"chunk_avg_tokens": 20}, "chunk_avg_tokens"),
        ({"chunk_max_tokens": 0}, "chunk_max_tokens"),
        ({"chunk_max_tokens": "256"}, "chunk_max_tokens"),
        ({"retry": {"max_attempts": 3}}, "retry"),
        ({"shm": "yes"}, "shm"),
        ({"max_message_bytes": 1024}, "max_message_bytes"),
        ({"max_message_bytes": 1 << 31}, "max_message_bytes"),
        ({"store_queue_blocks": 0}, "store_queue_blocks"),
        ({"cost": None}, "cost"),
        ({"namespace": b"tenant"}, "namespace"),
        ({"tls": "true"}, "tls"),
        ({"tls_ca_file": ""}, "tls_ca_file"),
        ({"tls_cert_file": "c.pem"}, "tls_key_file"),
        ({"tls_key_file": "k.pem"}, "tls_cert_file"),
        ({"token": ""}, "token"),
        ({"token": "two words"}, "token"),
        ({"token": "line\n"}, "token"),
    ],
)
def test_bad_field_is_named(changes: dict[str, object], argument: str) -> None:
    base = ClientConfig(servers=("h:1",))
    with pytest.raises(InvalidArgumentError) as err:
        replace(base, **changes)  # type: ignore[arg-type]
    assert err.value.argument == argument


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"max_attempts": 0}, "retry.max_attempts"),
        ({"max_attempts": 6}, "retry.max_attempts"),
        ({"initial_backoff_s": 0}, "retry.initial_backoff_s"),
        ({"max_backoff_s": 0.01}, "retry.max_backoff_s"),
        ({"backoff_multiplier": -2.0}, "retry.backoff_multiplier"),
        ({"retryable_codes": ()}, "retry.retryable_codes"),
        ({"retryable_codes": ("UNAVAILABLE", "NOPE")}, "retry.retryable_codes"),
        ({"retryable_codes": ("OK",)}, "retry.retryable_codes"),
        ({"retryable_codes": "UNAVAILABLE"}, "retry.retryable_codes"),
        ({"throttle_max_tokens": 0}, "retry.throttle_max_tokens"),
        ({"throttle_token_ratio": 0.0}, "retry.throttle_token_ratio"),
    ],
)
def test_bad_retry_field_is_named(changes: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        RetryPolicy(**changes)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_retry_codes_are_upper_cased() -> None:
    assert RetryPolicy(retryable_codes=("unavailable",)).retryable_codes == ("UNAVAILABLE",)


def test_token_stays_out_of_repr() -> None:
    cfg = ClientConfig(servers=("h:1",), token="s3cr3t")
    assert "s3cr3t" not in repr(cfg)
    assert cfg.token == "s3cr3t"


def test_tls_is_on_with_any_tls_file() -> None:
    assert ClientConfig(("h:1",), tls_ca_file="ca.pem").use_tls
    assert ClientConfig(("h:1",), tls_cert_file="c.pem", tls_key_file="k.pem").use_tls
    assert ClientConfig(("h:1",), tls=True).use_tls


# -- URL form ---------------------------------------------------------------------------


def test_from_url_example() -> None:
    cfg = ClientConfig.from_url("nopecache://h1:7001,h2:7002?lookup_timeout=0.2&shm=off")
    assert cfg == ClientConfig(servers=("h1:7001", "h2:7002"), lookup_timeout_s=0.2, shm="off")


def test_from_url_value_spellings() -> None:
    cfg = ClientConfig.from_url(
        "nopecache://[::1]:7,H?get_timeout=250ms&put_timeout=3s&connect_timeout=2"
        "&max_message_bytes=1MiB&cost_enabled=no&tls=on&retry_codes=unavailable,%20aborted"
        "&namespace=team%20a%2Fb&cost_prefill_tokens_per_s=none"
    )
    assert cfg.servers == ("[::1]:7", f"h:{DEFAULT_PORT}")
    assert cfg.get_timeout_s == 0.25
    assert cfg.put_timeout_s == 3.0
    assert cfg.connect_timeout_s == 2.0
    assert cfg.max_message_bytes == 1024**2
    assert cfg.cost.enabled is False
    assert cfg.tls is True
    assert cfg.retry.retryable_codes == ("UNAVAILABLE", "ABORTED")
    assert cfg.namespace == "team a/b"
    assert cfg.cost.prefill_tokens_per_s is None
    assert ClientConfig.from_url("nopecache://h?max_message_bytes=1MB").max_message_bytes == 10**6


@pytest.mark.parametrize(
    ("text", "size"),
    [("64Mi", 64 * 1024**2), ("1.5GiB", 3 * 1024**3 // 2), ("1TB", 10**12), ("2gb", 2 * 10**9)],
)
def test_sizes_read_as_the_server_reads_them(text: str, size: int) -> None:
    # One parser (proto/sizes.py) for client URLs and server options alike.
    assert parse_size(text, field="x") == size
    if size < 1 << 31:
        url = f"nopecache://h?max_message_bytes={text}"
        assert ClientConfig.from_url(url).max_message_bytes == size
    else:  # over gRPC's message limit: refused by range, not by the parser
        with pytest.raises(InvalidArgumentError, match="max_message_bytes"):
            ClientConfig.from_url(f"nopecache://h?max_message_bytes={text}")


def test_a_size_that_is_not_one_names_the_parameter() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url("nopecache://h?max_message_bytes=1.3B")
    assert err.value.argument == "max_message_bytes"
    assert "not a whole number of bytes" in err.value.reason


def _everything_changed() -> ClientConfig:
    return ClientConfig(
        servers=("a:1", "[::1]:2", "b.c:3"),
        lookup_timeout_s=0.125,
        get_timeout_s=1.5,
        put_timeout_s=2.5,
        control_timeout_s=0.75,
        connect_timeout_s=0.3,
        retry=RetryPolicy(
            max_attempts=5,
            initial_backoff_s=0.01,
            max_backoff_s=0.2,
            backoff_multiplier=1.5,
            retryable_codes=("UNAVAILABLE", "RESOURCE_EXHAUSTED"),
            throttle_max_tokens=20,
            throttle_token_ratio=0.5,
        ),
        shm="on",
        bulk="off",
        zero_copy=False,
        bulk_streams=4,
        max_message_bytes=16 * 1024**2,
        store_queue_blocks=8,
        down_backoff_s=0.0,
        cost=CostConfig(
            enabled=False,
            prefill_tokens_per_s=1234.5,
            default_prefill_tokens_per_s=999.0,
            safety_factor=2.0,
            min_samples=7,
            ewma_alpha=0.5,
            window=9,
            max_age_s=30.0,
            probe_share=0.25,
        ),
        namespace="tenant/α&b=c",
        kv_codec="fp8",
        discover="dns",
        dns_refresh_s=0.0,
        dns_min_interval_s=0.25,
        dns_family="ipv6",
        prefix_block_tokens=16,
        chunk_min_tokens=4,
        chunk_avg_tokens=16,
        chunk_max_tokens=32,
        tls=True,
        tls_ca_file="/etc/ca dir/ca.pem",
        tls_cert_file="/c.pem",
        tls_key_file="/k.pem",
        token="tok+en/=",
    )


def test_url_round_trip_of_every_field() -> None:
    cfg = _everything_changed()
    url = cfg.to_url()
    assert url.startswith("nopecaches://a:1,[::1]:2,b.c:3?")
    assert ClientConfig.from_url(url) == cfg
    # Every field differs from its default, so every parameter but tls (the scheme says
    # it) appears exactly once.
    names = [part.split("=")[0] for part in url.split("?", 1)[1].split("&")]
    assert sorted(names) == sorted(set(URL_PARAMS) - {"tls"})


def test_url_of_defaults_has_no_query() -> None:
    cfg = ClientConfig(servers=("h:1",))
    assert cfg.to_url() == "nopecache://h:1"
    assert ClientConfig.from_url(cfg.to_url()) == cfg
    assert ClientConfig.from_url("nopecache://h:1/") == cfg


def test_unknown_and_repeated_parameters_are_named() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url("nopecache://h:1?lookup_timeout_s=1")
    assert err.value.argument == "lookup_timeout_s"
    assert "unknown URL parameter" in err.value.reason
    with pytest.raises(InvalidArgumentError, match=r"^shm: given twice"):
        ClientConfig.from_url("nopecache://h:1?shm=on&shm=off")


# One bad value per URL parameter; the error names the parameter as written in the URL.
BAD_VALUES = {
    "lookup_timeout": "0",
    "get_timeout": "5 minutes",
    "put_timeout": "-1",
    "control_timeout": "",
    "connect_timeout": "1h",
    "shm": "sometimes",
    "bulk": "always",
    "zero_copy": "maybe",
    "bulk_streams": "17",
    "max_message_bytes": "1KiB",
    "store_queue_blocks": "many",
    "down_backoff": "-5ms",
    "namespace": None,  # any text is a valid namespace
    "kv_codec": "int4",
    "discover": "srv",
    "dns_refresh": "nan",
    "dns_min_interval": "soon",
    "dns_family": "v4",
    "prefix_block_tokens": "0",
    "chunk_min_tokens": "-4",
    "chunk_avg_tokens": "1000",
    "chunk_max_tokens": "sixteen",
    "tls": "maybe",
    "tls_ca_file": "",
    "tls_cert_file": "",
    "tls_key_file": "",
    "token": "a b",
    "retry_max_attempts": "9",
    "retry_initial_backoff": "0",
    "retry_max_backoff": "1ms",
    "retry_backoff_multiplier": "x",
    "retry_codes": "UNAVAILABLE,NOT_A_CODE",
    "retry_throttle_max_tokens": "0",
    "retry_throttle_token_ratio": "-1",
    "cost_enabled": "2",
    "cost_prefill_tokens_per_s": "0",
    "cost_default_prefill_tokens_per_s": "inf",
    "cost_safety_factor": "0",
    "cost_min_samples": "0",
    "cost_ewma_alpha": "1.5",
    "cost_window": "0",
    "cost_max_age": "-1s",
    "cost_probe_share": "2",
}


def test_bad_values_cover_every_parameter() -> None:
    assert set(BAD_VALUES) == set(URL_PARAMS)


@pytest.mark.parametrize("name", sorted(n for n, v in BAD_VALUES.items() if v is not None))
def test_bad_url_value_is_named(name: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url(f"nopecache://h:1?{name}={BAD_VALUES[name]}")
    assert err.value.argument == name


@pytest.mark.parametrize(
    ("url", "argument"),
    [
        ("redis://h:1", "url"),
        ("h:1,h:2", "url"),
        ("nopecache://h:1/db", "url"),
        ("nopecache://user@h:1", "url"),
        ("nopecache://h:1?shm", "url"),
        ("nopecache://?shm=off", "servers"),
        ("nopecache://h:1,h:x", "servers"),
        ("nopecaches://h:1?tls=false", "tls"),
        ("nopecache://h:1?tls_cert_file=/c.pem", "tls_key_file"),
    ],
)
def test_bad_url(url: str, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url(url)
    assert err.value.argument == argument


def test_discovery_and_chunking_from_url() -> None:
    cfg = ClientConfig.from_url(
        "nopecache://nopecache-headless.ns.svc.cluster.local:50551?discover=dns"
        "&dns_refresh=10s&dns_min_interval=250ms&dns_family=ipv4"
        "&prefix_block_tokens=16&chunk_min_tokens=4&chunk_avg_tokens=16&chunk_max_tokens=32"
    )
    assert cfg.servers == ("nopecache-headless.ns.svc.cluster.local:50551",)
    assert (cfg.discover, cfg.dns_refresh_s, cfg.dns_min_interval_s, cfg.dns_family) == (
        "dns",
        10.0,
        0.25,
        "ipv4",
    )
    assert cfg.prefix_block_tokens == 16
    assert cfg.content_chunker() == ContentChunker(min_size=4, avg_size=16, max_size=32)
    assert ClientConfig(("h:1",)).content_chunker() == DEFAULT_CHUNKER


def test_chunk_size_errors_name_the_url_parameters() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url("nopecache://h:1?chunk_min_tokens=100")
    assert str(err.value) == "chunk_min_tokens: 100 exceeds chunk_avg_tokens 64"
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url("nopecache://h:1?chunk_max_tokens=48")
    assert str(err.value) == "chunk_avg_tokens: 64 exceeds chunk_max_tokens 48"


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("h:1", ("h", 1)),
        ("H", ("h", DEFAULT_PORT)),
        ("[::1]:7", ("::1", 7)),
        ("1.2.3.4:5", ("1.2.3.4", 5)),
    ],
)
def test_split_server(address: str, expected: tuple[str, int]) -> None:
    assert split_server(address) == expected


def _tiny_client(url: str, **overrides: object) -> CacheClient:
    spec = RopeSpec.default(8)
    fp = ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="1",
        num_layers=2,
        num_kv_heads=2,
        dtype=torch.float32,
        form=StoredForm.NOPE,
        rope=spec,
    )
    return CacheClient(url, fingerprint=fp, rope=spec, v_head_dim=8, **overrides)  # type: ignore[arg-type]


def test_clients_agree_on_keys_through_the_url(cache_server: CacheServerProc) -> None:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5000, (96,), generator=g)
    kv = (torch.randn(2, 96, 2, 8, generator=g), torch.randn(2, 96, 2, 8, generator=g))
    base = f"nopecache://{cache_server.address}?namespace=agree&cost_enabled=false"
    url = (
        base + "&prefix_block_tokens=16&chunk_min_tokens=4&chunk_avg_tokens=16&chunk_max_tokens=32"
    )
    with _tiny_client(url) as storing, _tiny_client(url) as looking:
        assert looking.core.prefix_chunker == FixedChunker(16)
        assert looking.core.chunker == ContentChunker(min_size=4, avg_size=16, max_size=32)
        report = storing.store(tokens, kv)
        assert report.stored > 6 and report.failed == 0
        plan = looking.lookup(tokens)
        assert plan.prefix_end == 96  # six blocks of 16
        assert looking.lookup(tokens[8:]).hits  # content chunks found at another offset
        stored_spans = set(storing.core.chunker.split(tokens))
    # A client with other sizes cuts elsewhere: only chunks both cut alike are found.
    with _tiny_client(base) as other:
        assert other.core.prefix_chunker == FixedChunker(DEFAULT_PREFIX_BLOCK_TOKENS)
        assert other.core.chunker == DEFAULT_CHUNKER
        spans = set(other.core.chunker.split(tokens))
        assert spans != stored_spans
        plan = other.lookup(tokens)
        assert plan.prefix_end == 0
        assert {h.target for h in plan.hits} == spans & stored_spans
    # Arguments given in code win over the URL.
    chunker = ContentChunker(min_size=8, avg_size=32, max_size=64)
    with _tiny_client(url, prefix_block_tokens=32, chunker=chunker) as explicit:
        assert explicit.core.prefix_chunker == FixedChunker(32)
        assert explicit.core.chunker == chunker


def test_from_env() -> None:
    env = {ENV_URL: "nopecache://e:1?namespace=t"}
    assert ClientConfig.from_env(env) == ClientConfig(("e:1",), namespace="t")
    assert ClientConfig.from_env({}, default_url="nopecache://d:2").servers == ("d:2",)
    assert ClientConfig.from_env(env, default_url="nopecache://d:2").servers == ("e:1",)
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_env({})
    assert err.value.argument == ENV_URL


def test_code_overrides_url() -> None:
    cfg = replace(ClientConfig.from_url("nopecache://h:1?get_timeout=1"), get_timeout_s=2.0)
    assert cfg.get_timeout_s == 2.0
    with pytest.raises(InvalidArgumentError):
        replace(cfg, get_timeout_s=0.0)  # replace validates again


# -- gRPC service config ----------------------------------------------------------------


def test_service_and_methods_match_the_proto() -> None:
    service = cache_pb2.DESCRIPTOR.services_by_name["KVCache"]
    assert service.full_name == SERVICE
    assert sorted(m.name for m in service.methods) == sorted(METHODS)
    # Every call has a deadline except the removal feed, a stream that stays open for the
    # client's life (nopecache/client/removals.py).
    unbounded = {"WatchRemovals"}
    assert sorted(ClientConfig(("h:1",)).method_timeouts()) == sorted(set(METHODS) - unbounded)


def test_service_config_json() -> None:
    cfg = ClientConfig(servers=("h:1",))
    parsed = json.loads(cfg.service_config_json())
    policy = {
        "maxAttempts": 3,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    assert parsed == {
        "methodConfig": [
            {"name": [{"service": SERVICE, "method": m}], "retryPolicy": policy} for m in METHODS
        ],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
    assert cfg.method_timeouts() == {
        "Lookup": 0.5,
        "Get": 5.0,
        "Put": 10.0,
        "Delete": 2.0,
        "AttachShm": 2.0,
        "DetachShm": 2.0,
        "OpenBulk": 2.0,
        "Stats": 2.0,
        "OpenArena": 2.0,
        "LeaseGet": 5.0,
        "ReleaseLeases": 2.0,
    }
    assert cfg.service_config_json() == RetryPolicy().service_config_json()
    other = json.loads(cfg.service_config_json("test.Svc"))
    assert {n["service"] for mc in other["methodConfig"] for n in mc["name"]} == {"test.Svc"}


def test_service_config_without_retries() -> None:
    cfg = ClientConfig(servers=("h:1",), retry=RetryPolicy(max_attempts=1))
    assert json.loads(cfg.service_config_json()) == {
        "methodConfig": [{"name": [{"service": SERVICE, "method": m}]} for m in METHODS]
    }
    assert ("grpc.enable_retries", 0) in cfg.channel_options()


def test_durations_in_service_config() -> None:
    retry = RetryPolicy(initial_backoff_s=0.000001, max_backoff_s=12.5)
    body = retry.retry_policy_json()
    assert body is not None
    assert (body["initialBackoff"], body["maxBackoff"]) == ("0.000001s", "12.5s")


def _first_code(options: list[tuple[str, int | str]]) -> grpc.StatusCode:
    with grpc.insecure_channel("127.0.0.1:1", options=options) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Stats", None, None)
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=0.2)
    code = err.value.code()
    assert isinstance(code, grpc.StatusCode)
    return code


def test_grpc_accepts_the_service_config() -> None:
    # Nothing listens on port 1: a valid config fails the call for want of a server; an
    # invalid one fails the channel itself with INVALID_ARGUMENT (checked first, so the
    # test can tell the two apart).
    assert _first_code([("grpc.service_config", '{"methodConfig": 5}')]) is (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    for cfg in (ClientConfig(("h:1",)), _everything_changed()):
        code = _first_code(cfg.channel_options())
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _FlakyService:
    """A loopback KVCache whose Stats fails with ``code`` ``failures`` times, then answers."""

    def __init__(self, failures: int, code: grpc.StatusCode) -> None:
        self.failures = failures
        self.code = code
        self.attempts = 0
        self._lock = threading.Lock()

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.attempts += 1
            fail = self.attempts <= self.failures
        if fail:
            context.abort(self.code, "injected failure")
        return b"stats"


@pytest.fixture
def flaky() -> Iterator[tuple[_FlakyService, str]]:
    service = _FlakyService(failures=2, code=grpc.StatusCode.UNAVAILABLE)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Stats": grpc.unary_unary_rpc_method_handler(service.stats)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _stats(cfg: ClientConfig, address: str) -> bytes:
    with grpc.insecure_channel(address, options=cfg.channel_options()) as channel:
        reply = channel.unary_unary(f"/{SERVICE}/Stats", None, None)(
            b"", timeout=cfg.method_timeouts()["Stats"]
        )
    assert isinstance(reply, bytes)
    return reply


def test_grpc_retries_by_the_policy(flaky: tuple[_FlakyService, str]) -> None:
    service, address = flaky
    cfg = ClientConfig((address,), retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01))
    assert _stats(cfg, address) == b"stats"
    assert service.attempts == 3  # two injected UNAVAILABLE, then the answer


def test_grpc_gives_up_after_max_attempts(flaky: tuple[_FlakyService, str]) -> None:
    service, address = flaky
    cfg = ClientConfig((address,), retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01))
    with pytest.raises(grpc.RpcError) as err:
        _stats(cfg, address)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert service.attempts == 2


def test_grpc_does_not_retry_other_codes(flaky: tuple[_FlakyService, str]) -> None:
    service, address = flaky
    service.code = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        _stats(ClientConfig((address,)), address)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert service.attempts == 1
