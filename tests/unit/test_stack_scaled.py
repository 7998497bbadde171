"""``scaled``: several processes of a service, one consumer group, one log each."""

from __future__ import annotations

import pytest

from flywheel.core.settings import Settings
from flywheel.stack.services import pipeline_specs, scaled


def test_a_scaled_service_runs_its_command_under_numbered_names() -> None:
    specs = scaled(pipeline_specs(Settings(environment="test")), {"rewarding": 3})
    names = [s.name for s in specs]
    assert names[:4] == ["ingest", "rewarding", "rewarding-2", "rewarding-3"]
    assert names.count("ingest") == 1 and "trainer-worker" in names
    rewarding = [s for s in specs if s.name.startswith("rewarding")]
    assert len({(s.argv, s.settle_s) for s in rewarding}) == 1


def test_nothing_scaled_is_the_pipeline_itself() -> None:
    specs = pipeline_specs(Settings(environment="test"))
    assert scaled(specs, {}) == specs


@pytest.mark.parametrize(("counts", "named"), [({"rewarding": 0}, "rewarding: run 1 to 8"),
                                               ({"rewarding": 9}, "not 9"),
                                               ({"rewardng": 2}, "rewardng")])  # fmt: skip
def test_bad_counts_are_refused_by_name(counts: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        scaled(pipeline_specs(Settings(environment="test")), counts)
