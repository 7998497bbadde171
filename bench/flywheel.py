"""``make bench-flywheel``: the demo, headless, against its learning target.

Runs :func:`flywheel.demo.run_demo` (the whole loop with real components: Kafka, ingest,
faust rewarding, Celery trainer and beat, eval gate, router, hot swap, canary controller)
in a private run folder with its own ports, and prints the demo's summary as one JSON object
on the last line. The baseline is measured in the same run: the base model's held-out
success (the same 200 held-out problems and sampling the eval gate uses for every checkpoint).

Target (the flywheel issue): ``gain_points`` >= 25 within ``minutes`` <= 20, through
``promotions`` >= 2, from live traffic alone; with ``--inject-regression`` (the same scene as
``flywheel demo --inject-regression``, :mod:`flywheel.demo.regression`: ops pause the trainer
and the controller, make room, deploy a damaged checkpoint as canary, resume the controller)
the damaged canary must be rolled back (``regression_rolled_back``);
``regression_rollback_sessions`` and ``regression_seconds`` say how many canary sessions and
seconds it took, ``regression_cleared`` which undecided canaries ops rolled back first, and
``regression_error`` what went wrong when it did not happen.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.core.settings import Settings  # noqa: E402
from flywheel.demo import DemoConfig, run_demo  # noqa: E402
from flywheel.demo.scenarios import SCENARIOS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=20.0)
    parser.add_argument("--scenario", default="arith", choices=sorted(SCENARIOS))
    parser.add_argument("--target-gain", type=float, default=None, help="default: the scenario's (arith 25, parl 10)")
    parser.add_argument("--target-promotions", type=int, default=2)
    parser.add_argument("--inject-regression", action="store_true")
    parser.add_argument("--concurrency", type=int, default=DemoConfig.concurrency)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan = SCENARIOS[args.scenario]
    target_gain = args.target_gain if args.target_gain is not None else plan.target_gain_points

    run_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    base = random.Random().randrange(21000, 30000, 100)
    settings = Settings(
        run_dir=run_dir / "run",
        kafka={"local_port": base},
        vllm={"base_port": base + 10, "replicas": plan.replicas},
        serving={"router_port": base + 20, "admin_port": base + 21},
    )
    config = DemoConfig(
        scenario=args.scenario,
        budget_minutes=args.budget_minutes,
        target_gain_points=target_gain,
        target_promotions=args.target_promotions,
        inject_regression=args.inject_regression,
        concurrency=args.concurrency,
        seed=args.seed,
        report_dir=run_dir / "report",
        live=False,
    )
    summary = run_demo(config, settings)
    met = (
        summary["gain_points"] is not None
        and summary["gain_points"] >= target_gain
        and summary["minutes"] <= args.budget_minutes
        and summary["promotions"] >= args.target_promotions
        and summary["failed_requests"] == 0
    )
    summary["target_met"] = met
    summary.pop("config", None)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
