"""Pure parts of the hot swap and the deployment state machine: gauges, logprob checks, weights, replica choice."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from flywheel.core.vllm_admin import CheckpointInvalid
from serving.fleet.deploy import DeployError, canary_urls, validate_weight
from serving.fleet.strategies import get_strategy
from serving.fleet.swap import SwapResult, SwapVerifyError, check_weights, completion_logprobs, parse_in_flight

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base-1"} 2.0
vllm:num_requests_running{engine="1",model_name="base-1"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="base-1"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="base-1",reason="capacity"} 3.0
vllm:num_preemptions_total{engine="0",model_name="base-1"} 7.0
"""


def test_in_flight_sums_running_and_waiting_over_engines_only():
    assert parse_in_flight(METRICS) == 6
    assert parse_in_flight("vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n") == 0
    assert parse_in_flight("") == 0


def _completion(logprobs):
    return {"choices": [{"logprobs": {"token_logprobs": logprobs}}]}


def test_completion_logprobs_must_exist_and_be_finite():
    assert completion_logprobs(_completion([-0.1, -2.0])) == [-0.1, -2.0]
    with pytest.raises(SwapVerifyError, match="non-finite"):
        completion_logprobs(_completion([-0.1, math.nan]))
    with pytest.raises(SwapVerifyError, match="non-finite"):
        completion_logprobs(_completion([-math.inf]))
    with pytest.raises(SwapVerifyError, match="non-finite"):
        completion_logprobs(_completion([None]))
    with pytest.raises(SwapVerifyError, match="no token"):
        completion_logprobs(_completion([]))
    with pytest.raises(SwapVerifyError, match="no token logprobs"):
        completion_logprobs({"choices": [{"text": "x"}]})


@pytest.mark.parametrize("weight", [0.05, 0.5, 1.0, "0.25"])
def test_weights_in_the_open_closed_unit_interval_are_accepted(weight):
    assert validate_weight(weight) == float(weight)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.01, math.nan, math.inf, "lots", None])
def test_other_weights_are_invalid(weight):
    with pytest.raises(DeployError) as refused:
        validate_weight(weight)
    assert refused.value.kind == "invalid"


def _replica(url, state="serving", checkpoint="base"):
    return SimpleNamespace(url=url, state=state, checkpoint_id=checkpoint)


def test_a_full_weight_canary_takes_the_last_stable_replicas_but_never_all():
    fleet = [_replica("a"), _replica("b"), _replica("c")]
    assert canary_urls(fleet, "base", 1, "f") == ["c"]
    assert canary_urls(fleet, "base", 2, "f") == ["b", "c"]
    with pytest.raises(DeployError, match="would leave no stable replica") as refused:
        canary_urls(fleet, "base", 3, "f")
    assert refused.value.kind == "conflict"


def test_failed_or_foreign_replicas_do_not_count_for_a_canary():
    fleet = [_replica("a"), _replica("b", state="failed"), _replica("c", checkpoint="other")]
    with pytest.raises(DeployError, match="has 1 replica"):
        canary_urls(fleet, "base", 1, "f")
    with pytest.raises(DeployError, match="has 1 replica"):
        canary_urls([_replica("only")], "base", 1, "f")


def test_strategies_are_chosen_by_name():
    assert get_strategy("full").exclusive and not get_strategy("lora").exclusive
    with pytest.raises(ValueError, match="unknown swap strategy 'nccl'"):
        get_strategy("nccl")


def test_swap_result_and_errors_are_plain_data():
    result = SwapResult("http://r", "a", "b", ok=False, reverted=True, reason="verify failed", drain_ms=1.5)
    assert result.to_dict()["reverted"] is True and result.to_dict()["drain_ms"] == 1.5
    err = DeployError("not_found", "no checkpoint 'x'")
    assert (err.kind, err.message, str(err)) == ("not_found", "no checkpoint 'x'", "not_found: no checkpoint 'x'")


def _weights(folder, **tensors):
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_check_weights_refuses_non_finite_and_truncated_files(tmp_path):
    check_weights(str(_weights(tmp_path / "good", a=[1.0, 2.0], b=[[0.5]])))
    with pytest.raises(CheckpointInvalid, match="tensor b holds NaN"):
        check_weights(str(_weights(tmp_path / "nan", a=[1.0], b=[math.nan])))
    with pytest.raises(CheckpointInvalid, match="NaN or infinite"):
        check_weights(str(_weights(tmp_path / "inf", a=[math.inf])))
    cut = _weights(tmp_path / "cut", a=[1.0] * 64) / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[:-8])
    with pytest.raises(CheckpointInvalid, match="truncated"):
        check_weights(str(cut.parent))
    with pytest.raises(CheckpointInvalid, match="does not exist"):
        check_weights(str(tmp_path / "missing"))


def test_check_weights_against_the_served_model_refuses_other_names_and_shapes(tmp_path):
    served = str(_weights(tmp_path / "served", a=[1.0, 2.0], b=[[0.5]]))
    check_weights(str(_weights(tmp_path / "same", a=[3.0, 4.0], b=[[1.5]])), reference=served)
    with pytest.raises(CheckpointInvalid, match=r"tensor a has shape \[3\], the served model's has \[2\]"):
        check_weights(str(_weights(tmp_path / "wide", a=[1.0, 2.0, 3.0], b=[[0.5]])), reference=served)
    with pytest.raises(CheckpointInvalid, match=r"missing \['b'\], unexpected \['c'\]"):
        check_weights(str(_weights(tmp_path / "renamed", a=[1.0, 2.0], c=[[0.5]])), reference=served)
