#!/usr/bin/env bash
# Base images built locally from Debian's packages, for machines that reach Debian's mirrors but
# no image registry (docs/deploy.md): a debootstrap root file system imported as
# flywheel/debian-base:<suite>, and on top of it PostgreSQL, Redis and Python 3.11 images
# (docker/base/*.Dockerfile). Idempotent: an image that exists is kept (FORCE=1 rebuilds all).
# Prints how long each step took, and one JSON line with the figures at the end.
#
#   scripts/build-base-images.sh
#   SUITE=bookworm MIRROR=http://deb.debian.org/debian scripts/build-base-images.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-/usr/bin/docker}
SUITE=${SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}
WORK=${FLYWHEEL_IMAGE_WORK:-/var/cache/flywheel/images}
FORCE=${FORCE:-0}
PREFIX=${FLYWHEEL_IMAGE_PREFIX:-flywheel}
BASE_IMAGE=$PREFIX/debian-base:$SUITE
POSTGRES_IMAGE=$PREFIX/postgres:$SUITE
REDIS_IMAGE=$PREFIX/redis:$SUITE
PYTHON_IMAGE=$PREFIX/python:3.11-$SUITE

# The host's own Debian mirror (deb822 sources first, then one-line sources), else Debian's CDN.
host_mirror() {
  local uri
  uri=$(awk '/^URIs:/ {u=$2} /^Suites:/ && u ~ /debian\/?$/ {print u; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $0 !~ /security/ && $3 ~ /^[a-z]+$/ {print $2; exit}' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${MIRROR:-$(host_mirror)}

"$(dirname "$0")/docker-engine.sh" >/dev/null

have() { [ "$FORCE" != 1 ] && $DOCKER image inspect "$1" >/dev/null 2>&1; }
declare -A SECONDS_OF
step() {  # step NAME COMMAND...: run, time, record
  local name=$1 t0 t1
  shift
  t0=$(date +%s)
  "$@"
  t1=$(date +%s)
  SECONDS_OF[$name]=$((t1 - t0))
  echo "build-base-images: $name took $((t1 - t0)) s"
}

rootfs() {
  local dir=$WORK/rootfs-$SUITE
  rm -rf "$dir.tmp"
  mkdir -p "$WORK"
  echo "build-base-images: debootstrap $SUITE from $MIRROR into $dir ..."
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$dir.tmp" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log" >&2; echo "build-base-images: debootstrap failed (log: $WORK/debootstrap.log)" >&2; exit 1; }
  # The suite, its updates and its security fixes, as on the host.
  cat >"$dir.tmp/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
  # No service starts while a package installs inside an image build; no apt caches in layers.
  printf '#!/bin/sh\nexit 101\n' >"$dir.tmp/usr/sbin/policy-rc.d"
  chmod +x "$dir.tmp/usr/sbin/policy-rc.d"
  echo 'APT::Install-Recommends "false"; Acquire::Retries "3";' >"$dir.tmp/etc/apt/apt.conf.d/90flywheel"
  rm -rf "$dir.tmp"/var/cache/apt/archives/*.deb "$dir.tmp"/var/lib/apt/lists/*
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
}

import_base() {
  local dir=$WORK/rootfs-$SUITE
  [ -d "$dir" ] && [ "$FORCE" != 1 ] || step debootstrap rootfs
  tar -C "$dir" --numeric-owner -c . | $DOCKER import \
    -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' -m "debootstrap --variant=minbase $SUITE $MIRROR" - "$BASE_IMAGE" >/dev/null
}

build_on_base() {  # build_on_base IMAGE DOCKERFILE
  $DOCKER build -q --build-arg "BASE=$BASE_IMAGE" -t "$1" -f "docker/base/$2" docker/base >/dev/null
}

have "$BASE_IMAGE" || step base import_base
have "$POSTGRES_IMAGE" || step postgres build_on_base "$POSTGRES_IMAGE" postgres.Dockerfile
have "$REDIS_IMAGE" || step redis build_on_base "$REDIS_IMAGE" redis.Dockerfile
have "$PYTHON_IMAGE" || step python build_on_base "$PYTHON_IMAGE" python.Dockerfile

size() { $DOCKER image inspect -f '{{.Size}}' "$1"; }
printf '{"suite": "%s", "mirror": "%s"' "$SUITE" "$MIRROR"
for name in debootstrap base postgres redis python; do
  printf ', "%s_s": %s' "$name" "${SECONDS_OF[$name]:-null}"
done
printf ', "images": {"%s": %s, "%s": %s, "%s": %s, "%s": %s}}\n' \
  "$BASE_IMAGE" "$(size "$BASE_IMAGE")" "$POSTGRES_IMAGE" "$(size "$POSTGRES_IMAGE")" \
  "$REDIS_IMAGE" "$(size "$REDIS_IMAGE")" "$PYTHON_IMAGE" "$(size "$PYTHON_IMAGE")"
