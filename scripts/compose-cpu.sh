#!/usr/bin/env bash
# docker-compose with the CPU override (docker-compose.cpu.yml) on a machine without a GPU:
# renders docker-compose.yml + docker-compose.cpu.yml, drops the GPU reservations (an override
# cannot remove them: Compose merges device lists, and a CPU engine refuses to create a container
# that asks for one), writes the result to .flywheel/compose-cpu.yml and runs docker-compose on it
# with the arguments given. The project name is flywheel-cpu unless COMPOSE_PROJECT_NAME says.
# FLYWHEEL_COMPOSE_EXTRA: more override files (space-separated) applied after the CPU one, e.g. the
# compose loop test's tests/compose/loop.yml.
#
#   POSTGRES_PASSWORD=... scripts/compose-cpu.sh up -d
#   scripts/compose-cpu.sh ps
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .flywheel
out=.flywheel/compose-cpu.yml
umask 077  # the rendered file holds the secrets the environment gave
files=(-f docker-compose.yml -f docker-compose.cpu.yml)
for extra in ${FLYWHEEL_COMPOSE_EXTRA:-}; do files+=(-f "$extra"); done
docker-compose "${files[@]}" config > "$out.merged"
"$PY" - "$out.merged" "$out" <<'PYEOF'
import sys

import yaml

src, dst = sys.argv[1:]
config = yaml.safe_load(open(src))
for name, svc in config["services"].items():
    reservations = svc.get("deploy", {}).get("resources", {}).get("reservations", {})
    if reservations.pop("devices", None):
        print(f"compose-cpu: {name}: GPU reservation dropped", file=sys.stderr)
with open(dst, "w") as handle:
    yaml.safe_dump(config, handle, sort_keys=False)
PYEOF
rm -f "$out.merged"
exec docker-compose -p "${COMPOSE_PROJECT_NAME:-flywheel-cpu}" -f "$out" "$@"
