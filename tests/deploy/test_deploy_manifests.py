"""deploy/k8s: every overlay renders, validates against the Kubernetes schema, and agrees
with the server it deploys.

Rendering uses ``kubectl kustomize`` (kustomize built into kubectl); without kubectl these
tests skip and say so. Each overlay is rendered once per module, plus one composition of
the cluster overlay with the optional ``gpu`` and ``servicemonitor`` components. Every
rendered object is checked by ``kubernetes-validate`` against the schema of
``K8S_VERSION`` in strict mode (unknown fields are errors); the ServiceMonitor is a CRD
with no schema there, so its shape is checked by hand.

Drift between code and manifests is checked against the server itself: the container's
environment and the mounted TOML go through ``load_config`` (unknown keys or bad values
fail), ports and probe ports are compared with the resulting ServerConfig, tier URLs are
built by the tier factory, the front proxy's ports and forwarding addresses are compared
with haproxy.cfg's defaults and the server's options, its rendered config goes through
``haproxy -c``, the probes' health service names are asked of a real server,
and the Redis configs and the cluster-init script run against real redis-server
processes on loopback.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.config import (
    ENV_PREFIX,
    ServerConfig,
    env_name,
    load_config,
    split_listen,
)
from nopecache.cache_server.service import server_version
from nopecache.cache_server.sizes import parse_size
from nopecache.cache_server.tiers import Tier, tier_from_url
from nopecache.proto.contract import SERVICE_NAME
from tests.support.haproxy_proc import CONFIG as PROXY_CONFIG
from tests.support.haproxy_proc import check_config
from tests.support.redis_procs import RedisProc, free_ports
from tests.support.server_procs import CacheServerProc

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# Where the proxy image (haproxy) reads its config.
PROXY_CONFIG_PATH = "/usr/local/etc/haproxy/haproxy.cfg"
# The oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27).
K8S_VERSION = "1.31"
OVERLAYS = ("single", "cluster")
COMPOSED = "cluster+gpu+servicemonitor+disk"
PD = "pd"  # the single overlay plus prefill and decode engines and the P/D proxy
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
ENGINE_LABEL = {"nopecache.io/client": "true"}
SERVER_LABELS = {"app.kubernetes.io/name": "nopecache", "app.kubernetes.io/component": "server"}

Obj = dict[str, Any]


def _kustomize(path: Path) -> list[Obj]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every overlay (and the composition with the optional components), rendered once."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is needed to render the kustomize overlays (`kubectl kustomize`)")
    composed = tmp_path_factory.mktemp("composed")
    # kustomize refuses absolute paths to other kustomizations; relative ones may go up.
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "nopecache",
        "resources": [os.path.relpath(K8S / "overlays" / "cluster", composed)],
        "components": [
            os.path.relpath(K8S / "components" / c, composed)
            for c in ("gpu", "servicemonitor", "disk")
        ],
    }
    (composed / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = {name: _kustomize(K8S / "overlays" / name) for name in (*OVERLAYS, PD)}
    out["base"] = _kustomize(K8S / "base")
    out[COMPOSED] = _kustomize(composed)
    return out


# -- helpers -------------------------------------------------------------------------------
def base_name(obj: Obj) -> str:
    """An object's name without the content hash kustomize appends to generated ConfigMaps."""
    name = str(obj["metadata"]["name"])
    return re.sub(r"-[a-z0-9]{10}$", "", name) if obj["kind"] == "ConfigMap" else name


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    """The one object of ``kind`` named ``name`` (a generated ConfigMap: by its base name)."""
    hits = [o for o in objs if o["kind"] == kind and base_name(o) == name]
    assert len(hits) == 1, f"{kind}/{name}: found {len(hits)}"
    return hits[0]


def pod_specs(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    """(kind/name, pod template) of every workload."""
    for o in objs:
        if o["kind"] in ("StatefulSet", "Deployment", "Job"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]


def server_container(objs: list[Obj]) -> Obj:
    """The nopecache server container of the StatefulSet ``nopecache`` (the first)."""
    containers = find(objs, "StatefulSet", "nopecache")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "proxy"]
    return dict(containers[0])


def proxy_container(objs: list[Obj]) -> Obj:
    """The front proxy (HAProxy) sidecar of the StatefulSet ``nopecache``."""
    containers = find(objs, "StatefulSet", "nopecache")["spec"]["template"]["spec"]["containers"]
    return dict(containers[1])


def proxy_defaults(cfg: str) -> dict[str, str]:
    """The addresses haproxy.cfg defaults to (its ``presetenv`` lines): name -> value."""
    found = re.findall(r'^\s+presetenv (\S+)\s+"([^"]*)"$', cfg, flags=re.MULTILINE)
    return dict(found)


def mounted_file(objs: list[Obj], pod: Obj, container: Obj, path: str) -> str:
    """The content of the ConfigMap key mounted at ``path`` in ``container``."""
    where = PurePosixPath(path)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(where.parent)]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    (configmap,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return str(configmap["data"][where.name])


def literal_env(container: Obj) -> dict[str, str]:
    """The container's environment; every NOPECACHE_* variable must be a literal value."""
    env = {}
    for item in container.get("env", []):
        assert "value" in item, f"env {item['name']}: only literal values are checked here"
        env[item["name"]] = item["value"]
    return env


def server_config(objs: list[Obj], tmp_path: Path) -> ServerConfig:
    """The ServerConfig the server container would load: its env, args and mounted TOML."""
    pod = find(objs, "StatefulSet", "nopecache")["spec"]["template"]
    container = server_container(objs)
    assert "command" not in container, "the image's entrypoint (nopecache-server) must run"
    env = literal_env(container)
    config_file = tmp_path / "nopecache.toml"
    config_file.write_text(mounted_file(objs, pod, container, env[ENV_PREFIX + "CONFIG"]))
    return load_config(container.get("args", []), {**env, ENV_PREFIX + "CONFIG": str(config_file)})


def k8s_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``5Gi``, ``512Mi``, ``1G``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G)?", quantity)
    assert match, f"unsupported quantity {quantity!r}"
    return int(match[1]) * units.get(match[2] or "", 1)


def redis_conf(text: str) -> dict[str, str]:
    """redis.conf directives: name -> value (quotes removed; ``save ""`` -> "")."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, *values = shlex.split(line)
            out[name] = " ".join(values)
    return out


def redis_bytes(value: str) -> int:
    """A redis.conf memory size (``3gb`` = 3 GiB, ``3g`` = 3 GB) in bytes."""
    units = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 10**3, "m": 10**6, "g": 10**9}
    match = re.fullmatch(r"(\d+)(kb|mb|gb|k|m|g)?", value.lower())
    assert match, f"unsupported redis size {value!r}"
    return int(match[1]) * units.get(match[2] or "", 1)


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether matchLabels ``selector`` selects ``labels``."""
    return all(labels.get(k) == v for k, v in selector.items())


def ports_by_name(container: Obj) -> dict[str, int]:
    """Container port name -> number."""
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# -- rendering and schema ------------------------------------------------------------------
EXPECTED = {
    "base": {
        ("ServiceAccount", "nopecache"),
        ("ConfigMap", "nopecache-config"),
        ("ConfigMap", "nopecache-proxy-config"),
        ("Service", "nopecache-headless"),
        ("StatefulSet", "nopecache"),
        ("PodDisruptionBudget", "nopecache"),
        ("NetworkPolicy", "nopecache"),
    },
}
EXPECTED["single"] = EXPECTED["base"] | {
    ("Namespace", "nopecache"),
    ("ConfigMap", "nopecache-redis-config"),
    ("Deployment", "nopecache-redis"),
    ("Service", "nopecache-redis"),
    ("NetworkPolicy", "nopecache-redis"),
}
EXPECTED["cluster"] = EXPECTED["base"] | {
    ("Namespace", "nopecache"),
    ("ConfigMap", "nopecache-redis-cluster-config"),
    ("ConfigMap", "nopecache-redis-cluster-init"),
    ("StatefulSet", "nopecache-redis"),
    ("Service", "nopecache-redis"),
    ("PodDisruptionBudget", "nopecache-redis"),
    ("NetworkPolicy", "nopecache-redis"),
    ("Job", "nopecache-redis-cluster-init"),
}
EXPECTED[COMPOSED] = EXPECTED["cluster"] | {("ServiceMonitor", "nopecache")}
EXPECTED[PD] = EXPECTED["single"] | {
    (kind, name)
    for kind in ("Deployment", "Service")
    for name in ("vllm-prefill", "vllm-decode", "nopecache-pd-proxy")
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_renders_exactly_the_expected_objects(rendered: dict[str, list[Obj]], name: str) -> None:
    got = {(o["kind"], base_name(o)) for o in rendered[name]}
    assert got == EXPECTED[name]
    assert len(rendered[name]) == len(EXPECTED[name])
    if name != "base":
        assert {o["metadata"].get("namespace", "nopecache") for o in rendered[name]} == {
            "nopecache"
        }


def test_every_object_validates_against_the_kubernetes_schema(
    rendered: dict[str, list[Obj]],
) -> None:
    unique = {json.dumps(o, sort_keys=True): o for objs in rendered.values() for o in objs}
    skipped = set()
    for obj in unique.values():
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            skipped.add((obj["apiVersion"], obj["kind"]))
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert skipped == CRDS


def test_the_schema_check_rejects_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    statefulset = copy.deepcopy(find(rendered["single"], "StatefulSet", "nopecache"))
    probe = statefulset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grpc"]["servcie"] = probe["grpc"].pop("service")
    with pytest.raises(kubernetes_validate.ValidationError, match="'servcie' was unexpected"):
        kubernetes_validate.validate(statefulset, K8S_VERSION, strict=True)


def test_servicemonitor_scrapes_the_metrics_port(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered[COMPOSED]
    monitor = find(objs, "ServiceMonitor", "nopecache")
    service = find(objs, "Service", "nopecache-headless")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) == {"port", "path", "interval", "scrapeTimeout"}
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == "metrics"
    assert endpoint["path"] == "/metrics"


def test_gpu_component_requests_a_gpu_and_the_cuda_image(rendered: dict[str, list[Obj]]) -> None:
    container = server_container(rendered[COMPOSED])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == f"nopecache-cuda:{server_version()}"
    plain = server_container(rendered["cluster"])
    assert "nvidia.com/gpu" not in plain["resources"]["limits"]


# -- the server's own options --------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_env_and_toml_keys_are_server_options(
    rendered: dict[str, list[Obj]], name: str, tmp_path: Path
) -> None:
    objs = rendered[name]
    container = server_container(objs)
    env = literal_env(container)
    options = {f.name for f in fields(ServerConfig)}
    known = {env_name(name) for name in options} | {ENV_PREFIX + "CONFIG"}
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= known
    pod = find(objs, "StatefulSet", "nopecache")["spec"]["template"]
    toml = tomllib.loads(mounted_file(objs, pod, container, env[ENV_PREFIX + "CONFIG"]))
    assert set(toml) <= options
    config = server_config(objs, tmp_path)
    # gRPC and bulk on loopback: only the proxy sidecar dials them.
    assert (config.host, config.metrics_host, config.metrics) == ("127.0.0.1", "0.0.0.0", True)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_ports_and_probes_match_the_server_config(
    rendered: dict[str, list[Obj]], name: str, tmp_path: Path
) -> None:
    objs = rendered[name]
    config = server_config(objs, tmp_path)
    container = server_container(objs)
    health_host, health_port = split_listen(config.health_listen, "health_listen")
    assert health_host == "0.0.0.0" and health_port != config.port
    assert ports_by_name(container) == {"metrics": config.metrics_port, "health": health_port}
    # Clients reach gRPC and bulk through the proxy, which forwards to the server's
    # loopback ports; the server announces the proxy's bulk port (issue 36, item 3).
    proxy = proxy_container(objs)
    pod = find(objs, "StatefulSet", "nopecache")["spec"]["template"]
    defaults = proxy_defaults(mounted_file(objs, pod, proxy, PROXY_CONFIG_PATH))
    assert ports_by_name(proxy) == {
        "grpc": int(defaults["NOPECACHE_PROXY_GRPC_BIND"].removeprefix(":")),
        "bulk": config.bulk_advertise_port,
        "proxy-health": int(defaults["NOPECACHE_PROXY_HEALTH_BIND"].removeprefix(":")),
        "proxy-monitor": int(defaults["NOPECACHE_PROXY_MONITOR_BIND"].removeprefix(":")),
    }
    assert defaults["NOPECACHE_PROXY_BULK_BIND"] == f":{config.bulk_advertise_port}"
    assert defaults["NOPECACHE_SERVER_GRPC"] == f"127.0.0.1:{config.port}"
    assert defaults["NOPECACHE_SERVER_BULK"] == config.bulk_listen
    assert split_listen(config.bulk_listen, "bulk_listen")[0] == "127.0.0.1"
    assert defaults["NOPECACHE_SERVER_HEALTH"] == f"127.0.0.1:{health_port}"
    for kind in ("livenessProbe", "readinessProbe"):
        assert proxy[kind]["httpGet"] == {
            "path": "/healthz",
            "port": ports_by_name(proxy)["proxy-monitor"],
        }
    # The probes ask the health listener, outside the gRPC port's caps (issue 36).
    probes = {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["grpc"]["port"] for p in probes.values()} == {health_port}
    # No token is configured: the Admin service listens on loopback only.
    assert config.admin_listen == "127.0.0.1:50553"
    assert not config.admin_auth_enabled and not config.auth_enabled
    service = find(objs, "Service", "nopecache-headless")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("grpc", ports_by_name(proxy)["grpc"], "grpc"),
        ("bulk", config.bulk_advertise_port, "bulk"),
        ("metrics", config.metrics_port, "metrics"),
    }
    statefulset = find(objs, "StatefulSet", "nopecache")
    assert statefulset["spec"]["serviceName"] == "nopecache-headless"
    # Kubernetes must wait for the server's own graceful shutdown before killing it.
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.shutdown_grace_s


def _probe_services(rendered: dict[str, list[Obj]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name in OVERLAYS:
        container = server_container(rendered[name])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            out.setdefault(kind, set()).add(container[kind]["grpc"].get("service", ""))
    return out


def test_probe_service_names_are_served_by_a_real_server(
    rendered: dict[str, list[Obj]], cache_server: CacheServerProc
) -> None:
    services = _probe_services(rendered)
    # Readiness follows the tiers (NOT_SERVING when none answers); liveness only the process.
    assert services == {
        "startupProbe": {""},
        "livenessProbe": {""},
        "readinessProbe": {SERVICE_NAME},
    }
    with grpc.insecure_channel(cache_server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in set().union(*services.values()):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


@pytest.mark.parametrize("name", OVERLAYS)
def test_proxy_sidecar_runs_the_checked_haproxy_config(
    rendered: dict[str, list[Obj]], name: str, tmp_path: Path
) -> None:
    """The ConfigMap the sidecar mounts is deploy/haproxy/haproxy.cfg byte for byte, and
    HAProxy's own check accepts it as rendered."""
    objs = rendered[name]
    pod = find(objs, "StatefulSet", "nopecache")["spec"]["template"]
    proxy = proxy_container(objs)
    assert proxy["image"].startswith("haproxy:2.6.") and "command" not in proxy
    text = mounted_file(objs, pod, proxy, PROXY_CONFIG_PATH)
    assert text == PROXY_CONFIG.read_text()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    assert "Configuration file is valid" in check_config(cfg)


def _close(tier: Tier) -> None:
    asyncio.run(tier.close())


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_tier_urls_build_and_memory_covers_the_cpu_tier(
    rendered: dict[str, list[Obj]], name: str, tmp_path: Path
) -> None:
    objs = rendered[name]
    config = server_config(objs, tmp_path)
    cpu_bytes = 0
    for url in config.tiers:
        parts = urlsplit(url)
        if parts.scheme == "cpu":
            # Build the tier with a tiny pool: the factory checks every other option.
            capacity = re.search(r"capacity=([^&]+)", url)
            assert capacity is not None
            cpu_bytes += parse_size(capacity[1], field="capacity")
            url = url.replace(capacity[0], "capacity=1MiB")
        _close(tier_from_url(url))
    limits = server_container(objs)["resources"]["limits"]
    requests = server_container(objs)["resources"]["requests"]
    assert requests["memory"] == limits["memory"]
    # The pool is allocated whole, and one Put stream may hold max_request_bytes on top.
    assert k8s_bytes(limits["memory"]) >= cpu_bytes + config.max_request_bytes


def test_disk_component_claims_a_volume_per_replica_mounted_where_the_tier_lives(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    sts = find(rendered[COMPOSED], "StatefulSet", "nopecache")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    storage = k8s_bytes(claim["spec"]["resources"]["requests"]["storage"])
    (mount,) = [
        m for m in server_container(rendered[COMPOSED])["volumeMounts"] if m["name"] == "cache"
    ]
    assert mount["mountPath"] == "/var/cache/nopecache" and not mount.get("readOnly")
    # The server runs as a non-root user: the claim is writable through the pod's fsGroup.
    assert sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    assert (
        "volumeClaimTemplates" not in find(rendered["cluster"], "StatefulSet", "nopecache")["spec"]
    )
    # The tier URL the component documents fits its claim and builds (on a small scale).
    doc = (K8S / "components" / "disk" / "kustomization.yaml").read_text()
    match = re.search(r'"(file://(/var/cache/nopecache)\?capacity=([^"&]+))"', doc)
    assert match is not None
    assert parse_size(match[3], field="capacity") <= 0.9 * storage
    _close(tier_from_url(match[1].replace(match[2], str(tmp_path)).replace(match[3], "1MiB")))


def test_single_is_one_replica_over_one_redis(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["single"]
    config = server_config(objs, tmp_path)
    assert find(objs, "StatefulSet", "nopecache")["spec"]["replicas"] == 1
    assert [urlsplit(u).scheme for u in config.tiers] == ["cpu", "redis"]
    assert config.write_through is False
    redis_url = urlsplit(config.tiers[1])
    service = find(objs, "Service", "nopecache-redis")
    assert redis_url.hostname == service["metadata"]["name"]
    assert [p["port"] for p in service["spec"]["ports"]] == [redis_url.port]
    deployment = find(objs, "Deployment", "nopecache-redis")
    assert deployment["spec"]["replicas"] == 1
    assert labels_match(
        service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )


def test_cluster_is_three_replicas_writing_through_to_a_redis_cluster(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["cluster"]
    config = server_config(objs, tmp_path)
    assert find(objs, "StatefulSet", "nopecache")["spec"]["replicas"] == 3
    assert [urlsplit(u).scheme for u in config.tiers] == ["cpu", "redis+cluster"]
    assert config.write_through is True
    redis = find(objs, "StatefulSet", "nopecache-redis")
    service = find(objs, "Service", "nopecache-redis")
    assert redis["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    pods = {
        f"nopecache-redis-{i}.{service['metadata']['name']}:6379"
        for i in range(redis["spec"]["replicas"])
    }
    seeds = urlsplit(config.tiers[1]).netloc.split(",")
    assert len(seeds) >= 3 and set(seeds) <= pods
    job = find(objs, "Job", "nopecache-redis-cluster-init")
    (init,) = job["spec"]["template"]["spec"]["containers"]
    env = literal_env(init)
    assert set(env["NODES"].split()) == pods and len(env["NODES"].split()) == len(pods)
    per_master = int(env["REPLICAS"]) + 1
    assert len(pods) % per_master == 0 and len(pods) // per_master >= 3


@pytest.mark.parametrize("name", OVERLAYS)
def test_redis_config_matches_its_pod(rendered: dict[str, list[Obj]], name: str) -> None:
    objs = rendered[name]
    kind = "Deployment" if name == "single" else "StatefulSet"
    pod = find(objs, kind, "nopecache-redis")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][0] == "redis-server"
    conf = redis_conf(mounted_file(objs, pod, container, container["command"][1]))
    ports = ports_by_name(container)
    assert int(conf["port"]) == ports["redis"]
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert (conf["save"], conf["appendonly"]) == ("", "no")
    assert redis_bytes(conf["maxmemory"]) < k8s_bytes(container["resources"]["limits"]["memory"])
    data = [m for m in container["volumeMounts"] if m["name"] == "data"]
    assert [m["mountPath"] for m in data] == [conf["dir"]]
    if name == "cluster":
        assert conf["cluster-enabled"] == "yes"
        assert int(conf["cluster-port"]) == ports["cluster-bus"]
        assert PurePosixPath(conf["cluster-config-file"]).parent == PurePosixPath(conf["dir"])


# -- security and wiring -------------------------------------------------------------------
@pytest.mark.parametrize("name", [*OVERLAYS, COMPOSED, PD])
def test_every_pod_is_locked_down(rendered: dict[str, list[Obj]], name: str) -> None:
    for where, pod in pod_specs(rendered[name]):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] > 0, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        # Service links would add NOPECACHE_<SERVICE>_PORT=tcp://... variables: the
        # server reads NOPECACHE_* variables as its options.
        assert spec["enableServiceLinks"] is False, where
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            image, _, tag = c["image"].rpartition(":")
            assert image and tag and tag != "latest" and "/" not in tag, c["image"]


def test_server_image_tag_is_the_package_version(rendered: dict[str, list[Obj]]) -> None:
    for name in OVERLAYS:
        assert server_container(rendered[name])["image"] == f"nopecache:{server_version()}"


@pytest.mark.parametrize("name", [*OVERLAYS, COMPOSED, PD])
def test_selectors_select_their_pods(rendered: dict[str, list[Obj]], name: str) -> None:
    objs = rendered[name]
    pods = dict(pod_specs(objs))
    for o in objs:
        kind, spec = o["kind"], o.get("spec", {})
        if kind in ("StatefulSet", "Deployment"):
            assert labels_match(
                spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]
            )
        selector = {
            "Service": lambda s: s["selector"],
            "PodDisruptionBudget": lambda s: s["selector"]["matchLabels"],
            "NetworkPolicy": lambda s: s["podSelector"]["matchLabels"],
        }.get(kind)
        if selector is not None:
            chosen = [
                w for w, p in pods.items() if labels_match(selector(spec), p["metadata"]["labels"])
            ]
            assert len(chosen) == 1 and not chosen[0].startswith("Job/"), (kind, chosen)


@pytest.mark.parametrize("name", OVERLAYS)
def test_network_policies_admit_engines_prometheus_and_servers_only(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    objs = rendered[name]
    ports = ports_by_name(server_container(objs)) | ports_by_name(proxy_container(objs))
    policy = find(objs, "NetworkPolicy", "nopecache")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {p["port"]: r["from"] for r in policy["spec"]["ingress"] for p in r["ports"]}
    # Named ports: they resolve to the containers' ports. The health port and the proxy's
    # monitor have no rule: only the kubelet (not subject to the policy) may reach them, so
    # no pod can hoard them. Engines reach the server only through the proxy.
    assert set(rules) == set(ports) - {"health", "proxy-monitor"}
    engines = [{"namespaceSelector": {}, "podSelector": {"matchLabels": ENGINE_LABEL}}]
    assert rules["grpc"] == rules["bulk"] == rules["proxy-health"] == engines
    (prometheus,) = rules["metrics"]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    redis_policy = find(objs, "NetworkPolicy", "nopecache-redis")
    sources = [
        s["podSelector"]["matchLabels"] for r in redis_policy["spec"]["ingress"] for s in r["from"]
    ]
    assert SERVER_LABELS in sources
    for source in sources:  # nothing but pods of this install
        assert any(labels_match(source, p["metadata"]["labels"]) for _, p in pod_specs(objs))


@pytest.mark.parametrize("name", OVERLAYS)
def test_tls_and_auth_secrets_are_optional_mounts(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    pod = find(rendered[name], "StatefulSet", "nopecache")["spec"]["template"]
    secrets = {v["name"]: v["secret"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert {n: (s["secretName"], s["optional"]) for n, s in secrets.items()} == {
        "tls": ("nopecache-tls", True),
        "auth": ("nopecache-auth", True),
    }
    mounts = {m["name"]: m for m in server_container(rendered[name])["volumeMounts"]}
    assert all(mounts[n]["readOnly"] is True for n in secrets)


# -- Redis configs and the cluster-init script, run for real on loopback --------------------
# Directives that place a node (port, files, bus port) are the test's; every other one is
# the rendered config's.
_PLACEMENT = {"port", "dir", "cluster-config-file", "cluster-port", "bind"}


def _rendered_redis(rendered: dict[str, list[Obj]], name: str) -> dict[str, str]:
    objs = rendered[name]
    kind = "Deployment" if name == "single" else "StatefulSet"
    pod = find(objs, kind, "nopecache-redis")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return redis_conf(mounted_file(objs, pod, container, container["command"][1]))


def _redis_node(workdir: Path, conf: dict[str, str], port: int, bus_port: int) -> RedisProc:
    args = tuple(a for k, v in conf.items() if k not in _PLACEMENT for a in (f"--{k}", v))
    if conf.get("cluster-enabled") == "yes":
        args += ("--cluster-config-file", str(workdir / "nodes.conf"))
        args += ("--cluster-port", str(bus_port))
    return RedisProc(workdir, port, args)


def test_single_redis_config_runs_in_redis_server(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    conf = _rendered_redis(rendered, "single")
    node = _redis_node(tmp_path, conf, *free_ports(2))
    node.start()
    try:
        with node.client() as client:
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
            assert int(client.config_get("maxmemory")["maxmemory"]) == redis_bytes(
                conf["maxmemory"]
            )
    finally:
        node.stop()


def _run_init(
    script: str, nodes: list[RedisProc], replicas: int
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "NODES": " ".join(f"localhost:{n.port}" for n in nodes),
        "REPLICAS": str(replicas),
        "WAIT_S": "20",
    }
    return subprocess.run(
        ["sh", "-c", script, "cluster-init.sh"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cluster_init_creates_the_cluster_once_from_the_rendered_config(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["cluster"]
    script = str(find(objs, "ConfigMap", "nopecache-redis-cluster-init")["data"]["cluster-init.sh"])
    conf = _rendered_redis(rendered, "cluster")
    ports = free_ports(8)
    nodes = [_redis_node(tmp_path / f"n{i}", conf, ports[i], ports[4 + i]) for i in range(4)]
    try:
        for node in nodes:
            node.start()
        created = _run_init(script, nodes[:3], replicas=0)
        assert created.returncode == 0, created.stdout + created.stderr
        assert "cluster_state:ok on every node" in created.stderr
        for node in nodes[:3]:
            with node.client() as client:
                info = client.execute_command("CLUSTER INFO")
            assert (info["cluster_state"], int(info["cluster_known_nodes"])) == ("ok", 3)
            assert int(info["cluster_slots_assigned"]) == 16384
        again = _run_init(script, nodes[:3], replicas=0)
        assert again.returncode == 0, again.stderr
        assert "nothing to do" in again.stderr
        # A blank node among joined ones (a pod that lost its volume) needs a person.
        mixed = _run_init(script, nodes, replicas=0)
        assert mixed.returncode == 1
        assert (
            f"nodes 127.0.0.1:{nodes[3].port} are blank while 3 others form a cluster"
            in mixed.stderr
        )
    finally:
        for node in nodes:
            node.kill()


# -- prefill/decode ------------------------------------------------------------------------
def _arg(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_pd_engines_take_their_roles_and_reach_the_servers(rendered: dict[str, list[Obj]]) -> None:
    from nopecache.integrations.vllm.config import ConnectorConfig

    objs = rendered[PD]
    headless = find(objs, "Service", "nopecache-headless")
    (grpc_port,) = [p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc"]
    policy = find(objs, "NetworkPolicy", "nopecache")
    (grpc_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc"]
    (admitted,) = [source["podSelector"]["matchLabels"] for source in grpc_rule["from"]]
    for name, role in (("vllm-prefill", "kv_producer"), ("vllm-decode", "kv_consumer")):
        pod = find(objs, "Deployment", name)["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        assert container["image"] == f"nopecache-vllm:{server_version()}"
        (raw,) = _arg(container["args"], "--kv-transfer-config")
        transfer = json.loads(raw)
        assert transfer["kv_role"] == role
        assert transfer["kv_connector_module_path"] == "nopecache.integrations.vllm"
        # The connector's own validation: a key contradicting the role would fail here.
        config = ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"], role)
        assert config.role == role and config.client.discover == "dns"
        assert (config.load, config.save) == (role == "kv_consumer", role == "kv_producer")
        host, port = config.client.servers[0].rsplit(":", 1)
        assert host == f"{headless['metadata']['name']}.nopecache.svc.cluster.local"
        assert int(port) == grpc_port
        assert labels_match(admitted, pod["metadata"]["labels"])  # the policy admits it
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_pd_proxy_names_the_engine_services(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered[PD]
    (container,) = find(objs, "Deployment", "nopecache-pd-proxy")["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["command"] == ["nopecache-pd-proxy"]
    assert container["image"] == f"nopecache-vllm:{server_version()}"
    args = container["args"]
    assert int(_arg(args, "--port")[0]) == ports_by_name(container)["http"]
    for flag, name in (("--prefill", "vllm-prefill"), ("--decode", "vllm-decode")):
        (url,) = _arg(args, flag)
        parts = urlsplit(url)
        service = find(objs, "Service", name)
        assert parts.hostname == name
        assert [p["port"] for p in service["spec"]["ports"]] == [parts.port]
        engine = find(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert service["spec"]["ports"][0]["targetPort"] in ports_by_name(engine)
