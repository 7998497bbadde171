"""Hot swap of one replica, verified, reverted on failure; rolling swaps one replica at a time.

Full weights (``serving.strategy == "full"``), per replica:

1. refuse a checkpoint whose files are invalid or whose weights are not finite
   (:func:`check_weights`) before the replica is touched: a failed in-place reload breaks a
   vLLM 0.32 engine, and NaN weights make it answer every request with an error;
2. ``draining``: the router stops sending new requests to it (it re-reads the rows every
   ``serving.refresh_s``); wait ``2 × refresh_s``, then until vLLM's gauges
   ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` read 0 (at most
   ``serving.drain_timeout_s``; what is still running then is held by ``pause(keep)``);
3. ``pause(keep)``, ``swapping``, reload the checkpoint's weights, set the weight version,
   ``resume``;
4. verify: ``/weight_info`` reports the new version and a short greedy completion answers
   with finite logprobs; then ``serving`` with the new policy version.

When any step after the refusal check fails, the replica is put back on the weights it
served (reload, version, resume, verify): ``serving`` on the old version when that
verifies, else ``failed`` with the reason (:func:`serving.fleet.deploy.reconcile` swaps a
restarted replica back later). Under the ``lora`` strategy the adapter is loaded beside
what the replica serves (no drain, no pause) and verified by a completion under its name.

These functions do not take the fleet lock: :mod:`serving.fleet.deploy` holds it around them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx
from safetensors import safe_open
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.db.models import AuditLog, Checkpoint, Replica
from serving.fleet.registry import DeployError, checkpoint_of_version, set_replica
from serving.fleet.strategies import SwapStrategy, Target, get_strategy

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

log = logging.getLogger(__name__)

IN_FLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VERIFY_PROMPT = "user: what is 2 + 2?\nassistant:"
VERIFY_TIMEOUT_S = 120.0
"""Longest a swap waits for its verification completion, over all attempts."""
VERIFY_ATTEMPTS = 3
"""The completion is asked for this many times (a paused scheduler is resumed in between)."""
DRAIN_POLL_S = 0.05


class SwapVerifyError(RuntimeError):
    """A swapped replica failed verification (wrong version, failed or non-finite completion)."""


Verifier = Callable[[str, str, str, SwapStrategy, Target], None]
"""``verify(url, expected_version, model, strategy, target)``: raises :class:`SwapVerifyError` when wrong."""


@dataclass
class SwapResult:
    """What one replica's swap did, with its timings in milliseconds."""

    url: str
    from_version: str | None
    to_version: str
    ok: bool
    reverted: bool
    """The swap failed and the replica is back on ``from_version``, verified."""
    reason: str | None
    drain_ms: float = 0.0
    """From ``draining`` until no request was in flight (or the drain timed out)."""
    pause_ms: float = 0.0
    """From ``pause`` to ``resume`` of the forward swap (0 when it never paused)."""
    total_ms: float = 0.0
    drained: bool = True
    """Whether in-flight requests reached 0 before pausing (False: the drain timed out)."""
    checkpoint_id: str | None = None
    state: str | None = None
    """The replica's state after the swap (None: refused before the replica was touched)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return asdict(self)


# --------------------------------------------------------------------------- pure helpers


def parse_in_flight(metrics_text: str) -> int:
    """Requests running plus waiting, summed over every engine, from vLLM's Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IN_FLIGHT_GAUGES:
            total += float(line.rsplit(" ", 1)[1])
    return int(round(total))


def completion_logprobs(body: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of a ``/v1/completions`` answer; raises :class:`SwapVerifyError`."""
    try:
        values = body["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as err:
        raise SwapVerifyError(f"completion has no token logprobs: {str(body)[:500]}") from err
    if not values:
        raise SwapVerifyError("completion generated no token")
    bad = [v for v in values if v is None or not math.isfinite(float(v))]
    if bad:
        raise SwapVerifyError(f"completion has non-finite logprobs {bad[:4]} (weights broken?)")
    return [float(v) for v in values]


def check_weights(weights_path: str, reference: str | None = None, *, finite: bool = True) -> None:
    """The checkpoint's files are complete and every tensor is finite; raises ``CheckpointInvalid``.

    With ``reference`` (the folder of the model the fleet serves, for a full-weight
    checkpoint), its tensors must also be exactly the reference's names and shapes: vLLM
    reloads in place into the tensors it has, so a missing or reshaped one breaks the replica.

    Beyond :func:`~flywheel.core.vllm_admin.check_checkpoint` (headers, sizes): measured
    on vLLM 0.32 here, weights with NaN made the replica answer every completion with HTTP 400
    (non-finite logprobs), so they are refused before a replica is touched. Reads every
    tensor once, as the replica's reload will; ``finite=False`` skips that read (headers,
    sizes and shapes only: the quick check the admin API runs before it accepts an operation).
    """
    files = vllm_admin.check_checkpoint(weights_path)
    if reference is not None:
        _same_shapes(vllm_admin.tensor_shapes(files), vllm_admin.tensor_shapes(vllm_admin.check_checkpoint(reference)))
    if not finite:
        return
    import torch  # here only: the admin API and the canary controller import this module, torch is slow to load

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as tensors:
                for name in tensors.keys():
                    tensor = tensors.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise vllm_admin.CheckpointInvalid(f"{file} tensor {name} holds NaN or infinite values")
        except vllm_admin.CheckpointInvalid:
            raise
        except Exception as err:  # safetensors raises its own errors for corrupt data: one clear refusal
            raise vllm_admin.CheckpointInvalid(f"{file} is unreadable: {type(err).__name__}: {err}") from err


def _same_shapes(shapes: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise vllm_admin.CheckpointInvalid(
            f"tensors differ from the served model's: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name in sorted(expected):
        if shapes[name] != expected[name]:
            raise vllm_admin.CheckpointInvalid(
                f"tensor {name} has shape {shapes[name]}, the served model's has {expected[name]}"
            )


# --------------------------------------------------------------------------- replica calls


def in_flight(url: str, timeout_s: float = 5.0) -> int:
    """Requests the replica is running or holding (``GET /metrics``)."""
    try:
        response = vllm_admin.client().get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError as err:
        raise vllm_admin.VllmAdminError(url, "/metrics", 0, f"{type(err).__name__}: {err}") from err
    if response.status_code != 200:
        raise vllm_admin.VllmAdminError(url, "/metrics", response.status_code, response.text)
    return parse_in_flight(response.text)


def verify_replica(url: str, expected_version: str, model: str, strategy: SwapStrategy, target: Target) -> None:
    """The replica reports ``target`` and answers a short greedy completion with finite logprobs."""
    if not strategy.reports(url, target):
        actual = vllm_admin.weight_info(url) if strategy.exclusive else "(adapter not listed)"
        raise SwapVerifyError(f"{url} reports {actual!r}, expected {expected_version!r}")
    body = {
        "model": model,
        "prompt": VERIFY_PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    response = _verification_completion(url, body)
    if response.status_code != 200:
        raise SwapVerifyError(
            f"verification completion on {url} answered HTTP {response.status_code}: {response.text[:500]}"
        )
    completion_logprobs(response.json())


def _verification_completion(url: str, body: dict[str, Any]) -> httpx.Response:
    """POST the verification completion; a timeout is retried, resuming a scheduler found still paused."""
    per_try = VERIFY_TIMEOUT_S / VERIFY_ATTEMPTS
    timeout: httpx.TimeoutException | None = None
    paused: bool | None = None
    for attempt in range(1, VERIFY_ATTEMPTS + 1):
        if paused:  # a paused scheduler holds the request forever: resume it before asking again
            vllm_admin.resume(url)
        try:
            return vllm_admin.client().post(url.rstrip("/") + "/v1/completions", json=body, timeout=per_try)
        except httpx.TimeoutException as err:
            timeout, paused = err, _paused_or_none(url)
            log.warning(
                "%s: verification completion timed out (attempt %d of %d, paused: %s)",
                url,
                attempt,
                VERIFY_ATTEMPTS,
                paused,
            )
        except httpx.HTTPError as err:
            raise SwapVerifyError(f"verification completion on {url} failed: {type(err).__name__}: {err}") from err
    raise SwapVerifyError(
        f"verification completion on {url} failed: {type(timeout).__name__} after {VERIFY_ATTEMPTS} attempts "
        f"of {per_try:.0f} s (scheduler paused: {paused})"
    ) from timeout


def _paused_or_none(url: str) -> bool | None:
    """Whether the replica's scheduler is paused; ``None`` when it does not answer."""
    try:
        return vllm_admin.is_paused(url)
    except vllm_admin.VllmAdminError:
        return None


def drain(url: str, refresh_s: float, timeout_s: float) -> tuple[float, bool]:
    """Wait two router refreshes, then until nothing is in flight; ``(milliseconds, drained)``."""
    start = time.monotonic()
    time.sleep(2 * refresh_s)
    deadline = time.monotonic() + timeout_s
    while True:
        if in_flight(url) == 0:
            return (time.monotonic() - start) * 1000.0, True
        if time.monotonic() >= deadline:
            return (time.monotonic() - start) * 1000.0, False
        time.sleep(DRAIN_POLL_S)


# --------------------------------------------------------------------------- swap


def _target(session: Session, checkpoint_id: str) -> Target:
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise DeployError("not_found", f"no checkpoint {checkpoint_id!r} in the registry")
    return Target(row.id, row.policy_version, row.path, row.format)


def _as_target(row: Checkpoint | None) -> Target | None:
    return Target(row.id, row.policy_version, row.path, row.format) if row is not None else None


def _audit(engine: Engine, actor: str, result: SwapResult, before: dict[str, Any]) -> None:
    with Session(engine) as session:
        session.add(
            AuditLog(
                actor=actor,
                action="replica.swap",
                target=result.url,
                before=before,
                after={
                    "policy_version": result.to_version if result.ok else result.from_version,
                    "state": result.state,
                },
                details=result.to_dict(),
                success=result.ok,
            )
        )
        session.commit()


def swap_replica(
    engine: Engine,
    settings: Settings,
    url: str,
    checkpoint_id: str,
    deployment_id: int | None,
    *,
    verify: Verifier | None = None,
    actor: str = "serving.swap",
) -> SwapResult:
    """Swap the replica at ``url`` to ``checkpoint_id`` (see the module docstring); never raises on a failed swap.

    Raises :class:`DeployError` ``not_found`` for an unregistered replica or an unknown
    checkpoint. Otherwise the result says what happened: ``ok``, or ``reverted`` (back on
    its previous weights), or neither (refused before touching it, or ``failed``).
    ``verify`` replaces :func:`verify_replica` (used for the forward swap and the revert).
    """
    url = url.rstrip("/")
    start = time.monotonic()
    strategy = get_strategy(settings.serving.strategy)
    verify = verify or verify_replica
    with Session(engine) as session:
        replica = session.scalars(select(Replica).where(Replica.url == url)).first()
        if replica is None:
            raise DeployError("not_found", f"replica {url} is not registered (run ensure_fleet first)")
        target = _target(session, checkpoint_id)
        before = {
            "policy_version": replica.policy_version,
            "checkpoint_id": replica.checkpoint_id,
            "state": replica.state,
        }
        row_checkpoint = _as_target(session.get(Checkpoint, replica.checkpoint_id)) if replica.checkpoint_id else None
    result = SwapResult(
        url, None, target.policy_version, ok=False, reverted=False, reason=None, checkpoint_id=target.checkpoint_id
    )
    try:
        _swap(engine, settings, strategy, verify, url, target, deployment_id, row_checkpoint, result)
    finally:
        result.total_ms = (time.monotonic() - start) * 1000.0
        _audit(engine, actor, result, before)
    log.info(
        "swap %s %s -> %s: ok=%s reverted=%s reason=%s",
        url,
        result.from_version,
        result.to_version,
        result.ok,
        result.reverted,
        result.reason,
    )
    return result


def _swap(
    engine: Engine,
    settings: Settings,
    strategy: SwapStrategy,
    verify: Verifier,
    url: str,
    target: Target,
    deployment_id: int | None,
    row_checkpoint: Target | None,
    result: SwapResult,
) -> None:
    """The steps of :func:`swap_replica`; fills ``result`` and the replica row."""
    serving = {
        "policy_version": target.policy_version,
        "checkpoint_id": target.checkpoint_id,
        "deployment_id": deployment_id,
    }
    # 0. what it serves now, and a refusal of bad files before anything is touched
    try:
        result.from_version = vllm_admin.weight_info(url)
        model = strategy.model_name(url, target)
    except vllm_admin.VllmAdminError as err:
        _finish(engine, result, "failed", f"replica unreachable before the swap: {err}")
        return
    try:
        check_weights(target.path)
    except vllm_admin.CheckpointInvalid as err:
        result.reason = f"refused before touching the replica: {err}"
        set_replica(engine, url, reason=result.reason)
        result.state = None
        return
    with Session(engine) as session:
        previous = _as_target(checkpoint_of_version(session, result.from_version)) or row_checkpoint
    if strategy.exclusive and result.from_version == target.policy_version:
        _already_there(engine, strategy, verify, url, target, model, serving, result)
        return
    if not strategy.exclusive:
        _load_adapter(engine, settings, strategy, verify, url, target, model, result)
        return
    # 1. drain
    set_replica(engine, url, state="draining", reason=f"draining for a swap to {target.policy_version}")
    try:
        result.drain_ms, result.drained = drain(url, settings.serving.refresh_s, settings.serving.drain_timeout_s)
    except vllm_admin.VllmAdminError as err:
        _back_to_serving(engine, strategy, verify, url, previous, result, f"drain failed: {err}")
        return
    # 2. pause, reload, version, resume
    step, paused_at, touched = "pause", time.monotonic(), False
    try:
        vllm_admin.pause(url, mode="keep")
        set_replica(engine, url, state="swapping", reason=f"swapping to {target.policy_version}")
        step, touched = "reload", True
        strategy.load(url, target, settings.serving.swap_timeout_s)
        step = "resume"
        vllm_admin.resume(url)
        result.pause_ms = (time.monotonic() - paused_at) * 1000.0
        step = "verify"
        verify(url, target.policy_version, model, strategy, target)
    except (vllm_admin.VllmAdminError, vllm_admin.CheckpointInvalid, SwapVerifyError) as err:
        if not result.pause_ms:
            result.pause_ms = (time.monotonic() - paused_at) * 1000.0
        reason = f"{step} failed: {err}"
        if touched:
            _revert(engine, settings, strategy, verify, url, previous, model, result, reason)
        else:
            _back_to_serving(engine, strategy, verify, url, previous, result, reason, resume=True)
        return
    result.ok = True
    _finish(engine, result, "serving", None, **serving)


def _finish(engine: Engine, result: SwapResult, state: str, reason: str | None, **values: Any) -> None:
    result.state = state
    if reason is not None:
        result.reason = reason
    set_replica(engine, result.url, state=state, reason=reason, **values)


def _already_there(
    engine: Engine,
    strategy: SwapStrategy,
    verify: Verifier,
    url: str,
    target: Target,
    model: str,
    serving: dict[str, Any],
    result: SwapResult,
) -> None:
    """The replica already serves the target (a retried or reconciled swap): verify and record it."""
    try:
        verify(url, target.policy_version, model, strategy, target)
    except (vllm_admin.VllmAdminError, SwapVerifyError) as err:
        _finish(engine, result, "failed", f"serves {target.policy_version} but verification failed: {err}")
        return
    result.ok = True
    _finish(engine, result, "serving", None, **serving)


def _back_to_serving(
    engine: Engine,
    strategy: SwapStrategy,
    verify: Verifier,
    url: str,
    previous: Target | None,
    result: SwapResult,
    reason: str,
    resume: bool = False,
) -> None:
    """A failure before the weights were touched: resume if needed, verify the old version, ``serving``."""
    result.reason = reason
    try:
        if resume:
            vllm_admin.resume(url)
        if previous is not None:
            verify(url, previous.policy_version, strategy.model_name(url, previous), strategy, previous)
    except (vllm_admin.VllmAdminError, SwapVerifyError) as err:
        _finish(engine, result, "failed", f"{reason}; then the replica did not verify on its old weights: {err}")
        return
    result.reverted = True
    _finish(engine, result, "serving", reason)


def _revert(
    engine: Engine,
    settings: Settings,
    strategy: SwapStrategy,
    verify: Verifier,
    url: str,
    previous: Target | None,
    model: str,
    result: SwapResult,
    reason: str,
) -> None:
    """Put the replica back on ``previous`` (reload, version, resume, verify); ``serving`` or ``failed``."""
    result.reason = reason
    if previous is None:
        _finish(engine, result, "failed", f"{reason}; no previous checkpoint known to revert to")
        return
    try:
        vllm_admin.pause(url, mode="keep")
        strategy.load(url, previous, settings.serving.swap_timeout_s)
        vllm_admin.resume(url)
        verify(url, previous.policy_version, model, strategy, previous)
    except (vllm_admin.VllmAdminError, vllm_admin.CheckpointInvalid, SwapVerifyError) as err:
        _finish(engine, result, "failed", f"{reason}; revert to {previous.policy_version} failed: {err}")
        return
    result.reverted = True
    _finish(
        engine,
        result,
        "serving",
        f"{reason}; reverted to {previous.policy_version}",
        policy_version=previous.policy_version,
        checkpoint_id=previous.checkpoint_id,
    )


def _load_adapter(
    engine: Engine,
    settings: Settings,
    strategy: SwapStrategy,
    verify: Verifier,
    url: str,
    target: Target,
    model: str,
    result: SwapResult,
) -> None:
    """LoRA: load the adapter beside what the replica serves, verify it; the row's base version stays."""
    try:
        strategy.load(url, target, settings.serving.swap_timeout_s)
        verify(url, target.policy_version, model, strategy, target)
    except (vllm_admin.VllmAdminError, vllm_admin.CheckpointInvalid, SwapVerifyError) as err:
        # the adapter is additive: the base and other adapters kept serving, so nothing to revert
        result.reverted = True
        result.state = "serving"
        result.reason = f"adapter load failed: {err}"
        set_replica(engine, url, reason=result.reason)
        return
    result.ok = True
    result.state = "serving"
    set_replica(engine, url, reason=None)


def rolling_swap(
    engine: Engine,
    settings: Settings,
    urls: list[str],
    checkpoint_id: str,
    deployment_id: int | None,
    *,
    verify: Verifier | None = None,
    actor: str = "serving.swap",
) -> list[SwapResult]:
    """Swap ``urls`` one replica at a time; stops after the first that fails (that one reverted or failed)."""
    results: list[SwapResult] = []
    for url in urls:
        result = swap_replica(engine, settings, url, checkpoint_id, deployment_id, verify=verify, actor=actor)
        results.append(result)
        if not result.ok:
            break
    return results
