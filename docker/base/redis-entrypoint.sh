#!/bin/sh
set -eu
if [ "${1:-}" = redis-server ]; then
  shift
  exec redis-server --bind '*' --protected-mode no --dir /data "$@"
fi
exec "$@"
