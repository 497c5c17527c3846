"""The checked-in gRPC stubs are exactly what `make proto` generates from cache.proto."""

from __future__ import annotations

from pathlib import Path

from nopecache.proto import cache_pb2
from nopecache.proto.generate import GENERATED, PROTO_DIR, generate


def test_checked_in_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(GENERATED)
    for name in GENERATED:
        fresh = (tmp_path / name).read_bytes()
        checked_in = (PROTO_DIR / name).read_bytes()
        assert fresh == checked_in, f"proto/{name} is stale: run `make proto`"


def test_stubs_import_package_qualified() -> None:
    grpc_stub = (PROTO_DIR / "cache_pb2_grpc.py").read_text()
    assert "from nopecache.proto import cache_pb2 as" in grpc_stub
    assert "\nimport cache_pb2" not in grpc_stub
    assert cache_pb2.DESCRIPTOR.name == "nopecache/proto/cache.proto"
    assert cache_pb2.DESCRIPTOR.package == "nopecache.v1"
