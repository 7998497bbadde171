#!/usr/bin/env bash
# The SDK's dependency ranges, tested at both ends: for each of "lowest" (every direct dependency of
# flywheel-rl[sdk] at the lowest version its range allows) and "highest" (the newest releases inside
# the ranges), a fresh venv gets the SDK alone (no service packages), and the SDK's unit tests run in it.
#
#   scripts/sdk-compat.sh            # both ends
#   scripts/sdk-compat.sh lowest     # one end
#
# Uses uv (installed from the package index into a throw-away venv) for its --resolution option.
# The venvs live under .flywheel/sdk-compat/ (git-ignored). Prints one line per end with the versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
ENDS=("$@")
[ ${#ENDS[@]} -gt 0 ] || ENDS=(lowest highest)
ROOT=.flywheel/sdk-compat
mkdir -p "$ROOT"
if [ ! -x "$ROOT/uv/bin/uv" ]; then
  "$PYTHON" -m venv "$ROOT/uv"
  "$ROOT/uv/bin/pip" install --quiet --disable-pip-version-check uv 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
uv="$ROOT/uv/bin/uv"
# The test tools at the versions the project's lock has (only the SDK's own dependencies float).
tools=$(grep -E '^(pytest|pytest-timeout|pytest-asyncio|hypothesis)==' requirements/cpu.lock)
# Unit tests of the SDK that need only the SDK. test_sdk_redact_training.py builds the trainer's
# samples (rewarding, tokenizers): a service-side test, run by make test.
tests=$(ls tests/unit/test_sdk_*.py | grep -v '/test_sdk_redact_training\.py$')
for end in "${ENDS[@]}"; do
  case "$end" in
    lowest) resolution=lowest-direct ;;
    highest) resolution=highest ;;
    *) echo "error: unknown end '$end' (lowest or highest)" >&2; exit 2 ;;
  esac
  venv="$ROOT/$end"
  rm -rf "$venv"
  "$uv" venv --quiet --python "$PYTHON" "$venv"
  # shellcheck disable=SC2086
  VIRTUAL_ENV="$venv" "$uv" pip install --quiet --resolution "$resolution" ".[sdk]" $tools
  versions=$(VIRTUAL_ENV="$venv" "$uv" pip list 2>/dev/null \
    | awk 'tolower($1) ~ /^(pydantic|pydantic-settings|kafka-python|httpx|openai)$/ {printf "%s %s, ", $1, $2}')
  echo "sdk-compat $end: ${versions%, }"
  # --noconftest: tests/conftest.py starts services and imports them; these tests need none of it.
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest --noconftest -q -p no:cacheprovider $tests
done
