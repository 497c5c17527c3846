"""Regenerates the checked-in Python stubs of proto/cache.proto (``make proto``).

protoc sees the source under the virtual path ``nopecache/proto/cache.proto`` (the
``-Inopecache/proto=<folder>`` mapping), so the generated modules import each other
package-qualified (``from nopecache.proto import cache_pb2``) rather than as a bare
top-level ``cache_pb2``. Output goes to a scratch folder first and is then copied flat
into the target, so a half-finished run never leaves mixed stubs behind.

Generated files (all deterministic for a given grpcio-tools / mypy-protobuf version):

    cache_pb2.py        messages             (grpcio-tools' bundled protoc)
    cache_pb2.pyi       message types        (mypy-protobuf)
    cache_pb2_grpc.py   KVCache stub/servicer (grpcio-tools)
    cache_pb2_grpc.pyi  stub/servicer types   (mypy-protobuf)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "cache.proto"
VIRTUAL_DIR = "nopecache/proto"
GENERATED = ("cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py", "cache_pb2_grpc.pyi")


class GenerateError(RuntimeError):
    """protoc failed or did not produce the expected files."""


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this interpreter (mypy-protobuf's)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise GenerateError(f"protoc plugin {name!r} not found; install mypy-protobuf")
        return found
    return str(path)


def generate(out_dir: Path, *, source_dir: Path = PROTO_DIR) -> list[Path]:
    """Writes the generated stubs of ``source_dir/cache.proto`` flat into ``out_dir``."""
    # Imported here: grpcio-tools is a development dependency, not a runtime one.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nopecache-proto-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL_DIR}={source_dir}",
            f"-I{well_known}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--mypy_out={scratch}",
            f"--mypy_grpc_out={scratch}",
            f"{VIRTUAL_DIR}/{PROTO_FILE}",
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise GenerateError(f"protoc exited with status {rc} for {source_dir / PROTO_FILE}")
        written = []
        for name in GENERATED:
            produced = Path(scratch) / VIRTUAL_DIR / name
            if not produced.exists():
                raise GenerateError(f"protoc did not produce {name}")
            target = out_dir / name
            shutil.copyfile(produced, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line: regenerate the stubs (into proto/ unless --out is given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=PROTO_DIR, help="folder to write the stubs to (default: proto/)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
