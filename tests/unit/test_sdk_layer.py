"""The SDK is its own layer: importing it and logging a session loads no role, no server
settings, no database, no web, queue or ML library, and reads no development-stack file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = (
    "ingest",
    "rewarding",
    "trainer",
    "serving",
    "flywheel.stack",
    "flywheel.demo",
    "flywheel.cli",
    "flywheel.core.settings",
    "flywheel.core.db",
    "flywheel.core.endpoints",
    "sqlalchemy",
    "psycopg",
    "torch",
    "vllm",
    "faust",
    "celery",
    "fastapi",
    "transformers",
)

PROGRAM = """
import json, sys
opened = []
def audit(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        opened.append(str(args[0]))
sys.addaudithook(audit)
import flywheel.sdk
from flywheel.sdk import Flywheel
fw = Flywheel(project="p", transport="kafka", spool_dir=sys.argv[1], queue_size=10)
with fw.session("s-1") as s:
    s.tool_call("calc", "1+1")
fw.close(0)
loaded = sorted({m for m in sys.modules for f in json.loads(sys.argv[2]) if m == f or m.startswith(f + ".")})
print(json.dumps({"loaded": loaded, "opened": opened}))
"""


def test_the_sdk_loads_no_other_layer_and_reads_no_stack_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # a stack.json where a development stack would keep one
    run_dir.mkdir()
    (run_dir / "stack.json").write_text('{"components": {}}')
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "spool"), json.dumps(FORBIDDEN)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "FLYWHEEL_RUN_DIR": str(run_dir), "HOME": str(tmp_path)},
        timeout=60,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], f"the SDK loaded modules of other layers: {report['loaded']}"
    stack_files = [p for p in report["opened"] if "stack.json" in p or str(run_dir) in p]
    assert stack_files == [], f"the SDK read development-stack files: {stack_files}"
