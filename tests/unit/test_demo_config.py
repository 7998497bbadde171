"""The demo's configuration as written into its JSON summary."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from flywheel.demo.loop import DemoConfig, config_json


class Hooks:
    """A hook owner holding a lock, like the reliability soak (a deep copy of it would fail)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def start(self, *args: object) -> None:
        return None

    def finish(self, *args: object) -> None:
        return None


def test_config_json_leaves_the_hooks_out_and_is_json():
    hooks = Hooks()
    config = DemoConfig(budget_minutes=3.0, report_dir=Path("/tmp/r"), on_start=hooks.start, on_finish=hooks.finish)
    out = config_json(config)
    assert "on_start" not in out and "on_finish" not in out
    assert out["budget_minutes"] == 3.0 and out["report_dir"] == "/tmp/r" and out["canary_steps"] == [0.5, 1.0]
    assert out["trainer_parent"] == "lineage" and out["trainer_threads"] == 1
    json.dumps(out)


def test_service_settings_are_merged_over_the_demos_own(tmp_path):
    from flywheel.core.settings import Settings
    from flywheel.demo.loop import service_overrides

    config = DemoConfig(service_settings={"rewarding": {"state_retention_s": 120.0, "feedback_window_s": 1.0},
                                          "ingest": {"batch_max": 7}})  # fmt: skip
    out = service_overrides(config, Settings(run_dir=tmp_path), "postgresql+psycopg://x@h/db")
    assert out["rewarding"] == {"feedback_window_s": 1.0, "rescore_delay_s": 2.0, "session_timeout_s": 120.0,
                                "state_retention_s": 120.0}  # fmt: skip
    assert out["ingest"] == {"batch_max": 7} and out["postgres"] == {"url": "postgresql+psycopg://x@h/db"}
    assert out["serving"]["canary"]["auto_deploy"] is True  # nested demo settings untouched
    json.dumps(config_json(config))
