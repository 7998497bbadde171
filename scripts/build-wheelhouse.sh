#!/usr/bin/env bash
# wheelhouse/: one wheel for every line of requirements/$ACCEL.lock, for the services image's
# build (the Dockerfile installs from it alone, --no-index, when it holds wheels), so the image
# reuses what this machine's pip already reaches (its configured indexes, find-links and cache)
# instead of installing everything a second time from the package index. Git-ignored; read by
# the image build (.dockerignore lets it through). Rebuilt only when the lock changed.
#
#   scripts/build-wheelhouse.sh            # ACCEL=cpu
set -euo pipefail
cd "$(dirname "$0")/.."
ACCEL=${ACCEL:-cpu}
LOCK=requirements/$ACCEL.lock
PIP=${PIP:-.venv/bin/pip}
OUT=wheelhouse
[ -f "$LOCK" ] || { echo "build-wheelhouse: no $LOCK" >&2; exit 1; }
[ -x "$PIP" ] || { echo "build-wheelhouse: no $PIP (run 'make setup', or set PIP=/path/to/pip)" >&2; exit 1; }
stamp="$OUT/.lock-$ACCEL.sha256"
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "build-wheelhouse: $OUT/ is up to date with $LOCK"
  exit 0
fi
t0=$(date +%s)
# A wheel of another lock or an older pin would let --no-index install the wrong thing: start clean.
find "$OUT" -maxdepth 1 -name '*.whl' -delete 2>/dev/null || true
mkdir -p "$OUT"
"$PIP" wheel --quiet --no-deps --disable-pip-version-check -r "$LOCK" -w "$OUT" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
wanted=$(grep -cE '^[A-Za-z0-9]' "$LOCK")
have=$(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l)
[ "$have" -eq "$wanted" ] || { echo "build-wheelhouse: $have wheels for $wanted pins of $LOCK" >&2; exit 1; }
echo "$want" > "$stamp"
echo "build-wheelhouse: $have wheels ($(du -sh "$OUT" | cut -f1)) in $(( $(date +%s) - t0 )) s"
