"""The main job: the flywheel demo (:mod:`flywheel.demo.loop`) and the stack smoke run (:mod:`flywheel.demo.smoke`)."""

from flywheel.demo.loop import DemoConfig, run_demo
from flywheel.demo.smoke import run_smoke

__all__ = ["DemoConfig", "run_demo", "run_smoke"]
