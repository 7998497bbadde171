#!/usr/bin/env bash
# A Docker engine for the compose test (make test-compose): installs Debian's docker.io,
# docker-compose and debootstrap when they are missing, starts dockerd in the background when
# no engine answers, and waits until `docker info` does. Idempotent: an engine that already
# answers is left as it is. Needs root (or passwordless sudo) to install or start anything.
#
#   scripts/docker-engine.sh           # ensure an engine runs; prints the server version
#   DOCKERD_LOG=/path scripts/docker-engine.sh   # where dockerd's log goes (default below)
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/var/log/flywheel-dockerd.log}
WAIT_S=${DOCKER_ENGINE_WAIT_S:-60}
# Debian's client matches Debian's daemon (20.10); a newer client found first on PATH still
# talks to it, but its `docker build` wants the buildx plug-in, which Debian does not package.
DOCKER=/usr/bin/docker

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    SUDO="__none__"
  fi
fi

engine_answers() { $DOCKER info >/dev/null 2>&1 || { [ "$SUDO" != "__none__" ] && $SUDO $DOCKER info >/dev/null 2>&1; }; }

if [ -x $DOCKER ] && engine_answers; then
  $DOCKER version --format 'docker-engine: engine already running (server {{.Server.Version}})' 2>/dev/null \
    || echo "docker-engine: engine already running"
  exit 0
fi

if [ "$SUDO" = "__none__" ]; then
  echo "docker-engine: no Docker engine answers and this user is not root (no passwordless sudo):" >&2
  echo "  as root: apt-get install -y docker.io docker-compose debootstrap && dockerd &" >&2
  exit 1
fi

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
[ -x $DOCKER ] || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || { echo "docker-engine: missing ${missing[*]} and no apt-get here" >&2; exit 1; }
  echo "docker-engine: installing ${missing[*]} (apt-get) ..."
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >/dev/null
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
  echo "docker-engine: starting dockerd (log: $DOCKERD_LOG) ..."
  # setsid: the engine outlives this script and the shell that ran it.
  $SUDO setsid dockerd >"$DOCKERD_LOG" 2>&1 < /dev/null &
fi

for _ in $(seq "$WAIT_S"); do
  if $SUDO $DOCKER info >/dev/null 2>&1; then
    $SUDO $DOCKER version --format 'docker-engine: engine running (server {{.Server.Version}})'
    exit 0
  fi
  sleep 1
done
echo "docker-engine: dockerd did not answer within ${WAIT_S}s; last lines of $DOCKERD_LOG:" >&2
tail -n 20 "$DOCKERD_LOG" >&2 || true
exit 1
