#!/usr/bin/env bash
# `make image`: build deploy/Dockerfile with whichever builder this machine has.
#
#   deploy/image/build.sh [IMAGE]          default IMAGE: nopecache:<package version>
#
# Builder, first that works: docker (a reachable daemon), podman (`podman info` answers),
# buildah (rootless-friendly: --isolation chroot, the vfs storage driver; override with
# BUILDAH_ISOLATION / BUILDAH_STORAGE_DRIVER). BUILDER=docker|podman|buildah forces one.
# It prints which one ran and why the others did not.
#
# Package-index settings. pip inside the build sees the host's: every pip setting the host
# has (its pip.conf files and PIP_* environment, as `pip config list` reports them) is
# written to one pip.conf and passed as the build secret `pipconf`, the CA bundle pip
# trusts as the secret `pipcert` (both empty when the host has none). Secrets are mounted
# only during the RUN steps that use them: nothing lands in a layer. Settings that name
# local folders or files (find-links, file:// indexes, constraints) are bind-mounted
# read-only at the same path where the builder can (podman, buildah); docker gets them
# dropped with a warning. No registry host is named here: whatever the host uses is used.
#
# Base image. The Dockerfile's PYTHON_IMAGE when it can be pulled; else, with buildah or
# podman, a local Debian bookworm base made by deploy/image/base.sh from the host's Debian
# mirror (a machine that reaches package mirrors but no container registry).
# PYTHON_IMAGE=... forces a base.
#
# Exit status: 0 built; 3 no builder on this machine (the reason is printed).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || command -v python3)}
version=$($PY -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
image=${1:-nopecache:$version}
storage=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")
LOCAL_BASE=localhost/nopecache-base:bookworm

# -- which builder ---------------------------------------------------------------------
probe() {
  case $1 in
    docker) command -v docker >/dev/null || { echo "not installed"; return 1; }
            docker info >/dev/null 2>&1 || { echo "no daemon answers (docker info failed)"; return 1; } ;;
    podman) command -v podman >/dev/null || { echo "not installed"; return 1; }
            podman info >/dev/null 2>&1 || { echo "podman info failed"; return 1; } ;;
    buildah) command -v buildah >/dev/null || { echo "not installed"; return 1; }
            buildah "${storage[@]}" images >/dev/null 2>&1 || { echo "buildah images failed"; return 1; } ;;
  esac
}
builder=${BUILDER:-}
if [ -z "$builder" ]; then
  for b in docker podman buildah; do
    if why=$(probe $b); then builder=$b; break; fi
    echo "build.sh: $b: $why"
  done
fi
if [ -z "$builder" ]; then
  echo "build.sh: no image builder works on this machine (docker, podman, buildah)" >&2
  exit 3
fi
echo "build.sh: building $image with $builder"

# -- package-index settings as secrets -------------------------------------------------
secrets=$(mktemp -d)
trap 'rm -rf "$secrets"' EXIT
mounts=()
$PY - "$secrets" "$builder" <<'PYEOF' >"$secrets/mounts"
"""Write pipconf/pipcert from the host's pip settings; print the local paths to mount."""
import os, subprocess, sys
from pathlib import Path

out, builder = Path(sys.argv[1]), sys.argv[2]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                        capture_output=True, text=True).stdout
settings = {}
for line in listed.splitlines():
    name, _, value = line.partition("=")
    section, _, key = name.partition(".")
    # Later lines win (pip lists files in load order, then the environment).
    settings[key] = value.strip().strip("'\"")
cert = settings.pop("cert", "") or os.environ.get("PIP_CERT", "")
(out / "pipcert").write_bytes(Path(cert).read_bytes() if cert and Path(cert).is_file() else b"")
mountable = builder != "docker"
paths, lines = [], []
for key, value in settings.items():
    if key in ("client-cert",):
        continue
    local = []
    for part in value.split():
        if part.startswith("file://"):
            # A file index (.../simple) links to its files beside it (../files/...).
            local.append(os.path.dirname(part[len("file://"):].rstrip("/")))
        elif part.startswith("/"):
            local.append(part)
    if local and not mountable:
        print(f"build.sh: pip {key} names local paths docker cannot mount: dropped",
              file=sys.stderr)
        continue
    paths += [p for p in local if os.path.exists(p)]
    lines.append(f"{key} = {value}")
(out / "pipconf").write_text("[global]\n" + "\n".join(lines) + "\n" if lines else "")
print("\n".join(sorted(set(paths))))
PYEOF
while read -r p; do [ -n "$p" ] && mounts+=(-v "$p:$p:ro"); done <"$secrets/mounts"
secret_args=(--secret "id=pipconf,src=$secrets/pipconf" --secret "id=pipcert,src=$secrets/pipcert")

# -- base image ------------------------------------------------------------------------
base_args=()
pull() {
  case $builder in
    docker) docker pull -q "$1" >/dev/null 2>&1 ;;
    podman) podman pull -q "$1" >/dev/null 2>&1 ;;
    buildah) buildah "${storage[@]}" pull -q "$1" >/dev/null 2>&1 ;;
  esac
}
default_base=$(sed -n 's/^ARG PYTHON_IMAGE=//p' deploy/Dockerfile)
base=${PYTHON_IMAGE:-$default_base}
if ! pull "$base"; then
  if [ -n "${PYTHON_IMAGE:-}" ] || [ "$builder" = docker ]; then
    echo "build.sh: cannot pull the base image $base" >&2
    exit 1
  fi
  if buildah "${storage[@]}" inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    echo "build.sh: cannot pull $base (no container registry reachable): using $LOCAL_BASE"
  else
    echo "build.sh: cannot pull $base (no container registry reachable): making $LOCAL_BASE"
    BUILDAH_STORAGE_DRIVER=${BUILDAH_STORAGE_DRIVER:-vfs} deploy/image/base.sh "$LOCAL_BASE"
  fi
  base=$LOCAL_BASE
fi
base_args=(--build-arg "PYTHON_IMAGE=$base")

# -- build -----------------------------------------------------------------------------
common=(-f deploy/Dockerfile -t "$image" "${base_args[@]}" "${secret_args[@]}")
case $builder in
  docker) DOCKER_BUILDKIT=1 docker build "${common[@]}" . ;;
  podman) podman build --format docker --ignorefile deploy/Dockerfile.dockerignore "${mounts[@]}" "${common[@]}" . ;;
  buildah) buildah "${storage[@]}" bud --format docker --isolation "${BUILDAH_ISOLATION:-chroot}" \
             --ignorefile deploy/Dockerfile.dockerignore "${mounts[@]}" "${common[@]}" . ;;
esac
echo "build.sh: built $image with $builder"
