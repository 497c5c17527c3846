#!/usr/bin/env bash
# A local Python 3.11 base image, for machines that reach package mirrors but no container
# registry (the default base, python:3.11-slim, is then not pullable).
#
#   deploy/image/base.sh IMAGE_NAME
#
# debootstrap lays out a minimal Debian bookworm (python3.11, venv, pip, passwd for useradd,
# CA certificates) from the Debian mirror the host's apt already uses (read from
# /etc/apt/sources.list*, never named here), and buildah commits it as IMAGE_NAME.
# Debian's python3 is 3.11 in bookworm: the same minor version as the default base.
set -euo pipefail

image=${1:?usage: base.sh IMAGE_NAME}
storage=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

command -v debootstrap >/dev/null || {
  echo "base.sh: installing debootstrap with apt"
  apt-get install -y -qq debootstrap >/dev/null
}
mirror=$(grep -rhoE '^(deb |URIs:) *https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
  | head -n1 | awk '{print $NF}' || true)
if [ -z "$mirror" ]; then
  echo "base.sh: no Debian mirror found in the host's apt sources" >&2
  exit 1
fi

root=$(mktemp -d /var/tmp/nopecache-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base.sh: debootstrap bookworm (minbase + python3) into $root"
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,python-is-python3,passwd,ca-certificates \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

ctr=$(buildah "${storage[@]}" from scratch)
trap 'rm -rf "$root"; buildah "${storage[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah "${storage[@]}" copy "$ctr" "$root" / >/dev/null
buildah "${storage[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd python3 "$ctr"
buildah "${storage[@]}" commit --rm "$ctr" "$image" >/dev/null
echo "base.sh: committed $image"
