"""``make bench-canary``: the canary controller's real decision code on simulated reward streams.

Per scenario and seed, sessions arrive one after another (``--rate`` per simulated second);
each is routed to the canary with the canary's current traffic weight (so the canary's
sample grows faster as the weight steps up) and succeeds with probability ``p_stable`` or
``p_canary``. Every ``--look-every`` sessions the controller looks: the real
:func:`serving.canary.policy.decide` (with :mod:`serving.canary.stats`) gets the per-arm
statistics since the deployment, the canary sessions scored at the current step and the
simulated time elapsed, and its action is applied (step up changes the routing weight;
promote or rollback ends the run). Guards get no input here (only the primary metric is
simulated). Rewards are seen as soon as a session ends (no feedback-window delay). The settings
are :class:`~flywheel.core.settings.CanarySettings`' defaults, or ``--settings JSON`` over them
(a demo's canary, say; docs/scenarios.md measures the parl demo's this way).

Scenarios (success rate, ``p_stable`` = 0.5 by default): ``aa`` (identical), ``drop20``
(canary 20 points worse), ``minus5`` (5 points worse), ``gain10`` (10 points better).

The last line is JSON: ``aa_false_rollback_rate`` (every A/A rollback, max-duration ones
included), ``drop20_rollback_median_sessions`` (median canary sessions until rollback),
``minus5_false_promotion_rate``, ``gain10_promotion_median_sessions``, the A/A promotion
rate and median sessions, ``aa_min_rate_per_s_for_max_duration`` (the slowest scored-session
rate at which 95 % of A/A canaries are promoted before ``max_duration_s``; below it the
deadline turns equal canaries into rollbacks), per-scenario outcome rates (with the upper end of their 95 %
Wilson interval: 0 of 200 seeds still allows a true rate up to ~1.9 %), the settings and
the seeds.
Targets: ``aa_false_rollback_rate`` <= 0.05, ``minus5_false_promotion_rate`` <= 0.05,
``drop20_rollback_median_sessions`` <= 200.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.core.settings import CanarySettings  # noqa: E402
from serving.canary.policy import Observations, decide  # noqa: E402
from serving.canary.stats import ArmStats  # noqa: E402

SCENARIOS = {"aa": 0.0, "drop20": -0.20, "minus5": -0.05, "gain10": 0.10}


@dataclass
class RunResult:
    """How one simulated canary ended."""

    outcome: str
    """``promote``, ``rollback`` or ``unfinished`` (hit the simulation's session cap)."""
    canary_sessions: int
    total_sessions: int
    reason: str


def simulate(
    settings: CanarySettings, p_stable: float, p_canary: float, seed: int, rate: float, look_every: int, cap: int
) -> RunResult:
    """One canary's life under the real decision rule."""
    rng = random.Random(seed)
    weight = settings.steps[0]
    canary, stable = [0, 0], [0, 0]  # n, successes (Bernoulli: sum of squares == sum)
    at_step = 0
    total = 0
    while total < cap:
        for _ in range(look_every):
            total += 1
            if rng.random() < weight:
                canary[0] += 1
                canary[1] += rng.random() < p_canary
                at_step += 1
            else:
                stable[0] += 1
                stable[1] += rng.random() < p_stable
        obs = Observations(
            canary=ArmStats(canary[0], float(canary[1]), float(canary[1])),
            stable=ArmStats(stable[0], float(stable[1]), float(stable[1])),
            canary_at_step=at_step,
            elapsed_s=total / rate,
        )
        decision = decide(obs, weight, settings)
        if decision.action in ("promote", "rollback"):
            return RunResult(decision.action, canary[0], total, decision.reason)
        if decision.action == "step_up":
            weight, at_step = decision.new_weight, 0
    return RunResult("unfinished", canary[0], total, "session cap")


def wilson_upper(successes: int, n: int, z: float = 1.96) -> float:
    """Upper end of the 95 % Wilson score interval of a rate (how large it could be, given the seeds)."""
    if n == 0:
        return 1.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def _quantile(values: list[int], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _median(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def summarise(results: list[RunResult]) -> dict:
    """Outcome rates and median canary sessions per outcome."""
    n = len(results)
    by = {k: [r for r in results if r.outcome == k] for k in ("promote", "rollback", "unfinished")}
    out = {
        "runs": n,
        "promotion_rate": len(by["promote"]) / n,
        "rollback_rate": len(by["rollback"]) / n,
        "unfinished_rate": len(by["unfinished"]) / n,
        "promotion_median_sessions": _median([r.canary_sessions for r in by["promote"]]),
        "rollback_median_sessions": _median([r.canary_sessions for r in by["rollback"]]),
        "promotion_median_total_sessions": _median([r.total_sessions for r in by["promote"]]),
        "rollback_median_total_sessions": _median([r.total_sessions for r in by["rollback"]]),
        "max_duration_rollbacks": sum(1 for r in by["rollback"] if "max duration" in r.reason),
        "promotion_p95_total_sessions": _quantile([r.total_sessions for r in by["promote"]], 0.95),
        "promotion_rate_upper95": round(wilson_upper(len(by["promote"]), n), 4),
        "rollback_rate_upper95": round(wilson_upper(len(by["rollback"]), n), 4),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per scenario (>= 200 for the targets)")
    parser.add_argument("--p-stable", type=float, default=0.5, help="stable success rate")
    parser.add_argument("--rate", type=float, default=2.0, help="sessions per simulated second (for max_duration_s)")
    parser.add_argument("--look-every", type=int, default=10, help="sessions between two looks of the controller")
    parser.add_argument("--cap", type=int, default=200_000, help="most sessions per simulated canary")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    parser.add_argument("--settings", type=json.loads, default={}, metavar="JSON",
                        help='canary settings over the defaults, e.g. \'{"non_inferiority_margin": 0.1}\'')  # fmt: skip
    args = parser.parse_args(argv)

    if not isinstance(args.settings, dict):
        parser.error(f"--settings: a JSON object of canary settings, got {args.settings!r}")
    try:
        settings = CanarySettings(**args.settings)
    except ValueError as err:
        parser.error(f"--settings: {err}")
    started = time.perf_counter()
    summaries: dict[str, dict] = {}
    for name in args.scenarios.split(","):
        p_canary = args.p_stable + SCENARIOS[name]
        results = [
            simulate(settings, args.p_stable, p_canary, 1000 * i + 7, args.rate, args.look_every, args.cap)
            for i in range(args.seeds)
        ]
        summaries[name] = summarise(results)
        print(f"{name}: {json.dumps(summaries[name])}", file=sys.stderr, flush=True)
    result: dict = {}
    if "aa" in summaries:
        result |= {
            "aa_false_rollback_rate": summaries["aa"]["rollback_rate"],
            "aa_false_rollback_rate_upper95": summaries["aa"]["rollback_rate_upper95"],
            "aa_promotion_rate": summaries["aa"]["promotion_rate"],
            "aa_promotion_median_sessions": summaries["aa"]["promotion_median_sessions"],
            "aa_promotion_median_total_sessions": summaries["aa"]["promotion_median_total_sessions"],
            "aa_min_rate_per_s_for_max_duration": (
                None
                if summaries["aa"]["promotion_p95_total_sessions"] is None
                else round(summaries["aa"]["promotion_p95_total_sessions"] / settings.max_duration_s, 4)
            ),
            "aa_promotion_median_hours": (
                None
                if summaries["aa"]["promotion_median_total_sessions"] is None
                else round(summaries["aa"]["promotion_median_total_sessions"] / args.rate / 3600, 3)
            ),
        }
    if "drop20" in summaries:
        result |= {
            "drop20_rollback_median_sessions": summaries["drop20"]["rollback_median_sessions"],
            "drop20_rollback_rate": summaries["drop20"]["rollback_rate"],
        }
    if "minus5" in summaries:
        result |= {
            "minus5_false_promotion_rate": summaries["minus5"]["promotion_rate"],
            "minus5_false_promotion_rate_upper95": summaries["minus5"]["promotion_rate_upper95"],
            "minus5_rollback_rate": summaries["minus5"]["rollback_rate"],
        }
    if "gain10" in summaries:
        result |= {
            "gain10_promotion_median_sessions": summaries["gain10"]["promotion_median_sessions"],
            "gain10_promotion_rate": summaries["gain10"]["promotion_rate"],
        }
    result |= {
        "scenarios": summaries,
        "p_stable": args.p_stable,
        "seeds": args.seeds,
        "seed_list": "1000 * i + 7 for i in range(seeds)",
        "rate_per_s": args.rate,
        "look_every_sessions": args.look_every,
        "settings": settings.model_dump(mode="json"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
