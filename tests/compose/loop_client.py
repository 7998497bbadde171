"""The compose loop test's client, run inside the compose project (``loop-client`` in loop.yml).

It is what a product and its operator would be: the demo's calculator agent (the official
``openai`` client through the router with a product key; the SDK's HTTP transport to the ingest
gateway with a write key), and an operator calling the admin API with a token. Its container is
on the compose project's ``public`` network only, so nothing but the public ingresses can be
reached from it.

    python /check/loop_client.py  (environment: PROJECT, PRODUCT_KEY, WRITE_KEY, ADMIN_TOKEN,
                                   BUDGET_S; ROUTER_URL, GATEWAY_URL, ADMIN_URL have defaults)

Phases: traffic until the canary controller has promoted at least one checkpoint and a later
canary is on trial; then the operator pauses the controller, rolls that canary back through the
admin API (retrying while the controller's own swap holds the fleet), checks the fleet serves the
stable again, and resumes the controller; then the operator pauses the trainer, the agent stops
and the SDK flushes. The last line printed is one JSON object: sessions, events the gateway
accepted (``events_sent``), the SDK's losses, failed requests, the promotions seen, the rollback's
answer. Exit 0 when every phase completed, 1 otherwise (the JSON line is printed either way).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import httpx

from flywheel.demo.agent import DemoAgent
from flywheel.sdk import Flywheel

ROUTER_URL = os.environ.get("ROUTER_URL", "http://router:8000")
GATEWAY_URL = os.environ.get("GATEWAY_URL", "http://ingest-gateway:8080")
ADMIN_URL = os.environ.get("ADMIN_URL", "http://admin-api:8090")
OPERATION_STATES_DONE = ("succeeded", "failed")

log = logging.getLogger("loop-client")


class Admin:
    """The admin API, as an operator's script calls it."""

    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def get(self, path: str, **params: Any) -> Any:
        response = self.http.get(path, params=params)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict[str, Any] | None = None, *, retry_conflict_s: float = 0.0) -> tuple[int, Any]:
        """POST; a long action answered with an operation (202) is followed to its end (then 200 when it
        succeeded, 500 when it failed). A conflict (another deployment operation holds the fleet, e.g. the
        controller's own look), answered at once (409) or as the operation's error, is retried for
        ``retry_conflict_s``."""
        deadline = time.monotonic() + retry_conflict_s
        while True:
            status, answer = self._post_once(path, body)
            conflict = status == 409 or (isinstance(answer, dict) and answer.get("error") == "conflict")
            if not conflict or time.monotonic() > deadline:
                return status, answer
            log.info("%s: conflict (%s); trying again", path, answer.get("reason") if isinstance(answer, dict) else "")
            time.sleep(2.0)

    def _post_once(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        response = self.http.post(path, json=body)
        answer = response.json() if response.content else None
        if response.status_code == 202 and isinstance(answer, dict) and answer.get("id"):
            deadline = time.monotonic() + 600
            while answer.get("state") not in OPERATION_STATES_DONE and time.monotonic() < deadline:
                time.sleep(1.0)
                answer = self.get(f"/v1/operations/{answer['id']}")
            return (200 if answer.get("state") == "succeeded" else 500), answer
        return response.status_code, answer

    def promotions(self) -> int:
        page = self.get("/v1/audit", action="deploy.promote", success=True, limit=500)
        return len(page["items"])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai", "flywheel.sdk"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    project = os.environ["PROJECT"]
    budget_s = float(os.environ.get("BUDGET_S", "1800"))
    admin = Admin(ADMIN_URL, os.environ["ADMIN_TOKEN"])
    fw = Flywheel(
        project=project, write_key=os.environ["WRITE_KEY"], transport="http", gateway_url=GATEWAY_URL,
        spool_dir="/tmp/loop-spool",
    )  # fmt: skip
    agent = DemoAgent(fw, ROUTER_URL, api_key=os.environ["PRODUCT_KEY"], concurrency=6, seed=0)
    result: dict[str, Any] = {"project": project, "promotions_seen": 0, "rollback": None, "phases": []}
    started = time.monotonic()
    agent.start()
    try:
        # 1. Traffic until a checkpoint was promoted and a later canary is on trial.
        canary: dict[str, Any] | None = None
        while time.monotonic() - started < budget_s:
            time.sleep(5.0)
            result["promotions_seen"] = admin.promotions()
            state = admin.get("/v1/canary")
            live = state.get("canary")
            log.info(
                "%.0f s: %s sessions, %s promotions, canary %s",
                time.monotonic() - started, agent.stats.sessions, result["promotions_seen"],
                f"{live['checkpoint_id']} ({live['status']}, weight {live['weight']})" if live else "none",
            )  # fmt: skip
            if result["promotions_seen"] >= 1 and live and live["status"] == "active":
                canary = live
                break
        if canary is None:
            result["phases"].append("no promotion followed by a canary within the budget")
            return 1
        result["phases"].append("promoted")
        # 2. The operator rolls the canary back (the controller paused so that it cannot decide first).
        status, answer = admin.post("/v1/canary/pause", {"reason": "compose test: rollback by the operator"})
        if status != 200:
            result["phases"].append(f"canary pause answered {status}: {answer}")
            return 1
        try:
            status, answer = admin.post(
                "/v1/rollback", {"reason": "compose test: operator rollback"}, retry_conflict_s=180.0
            )
            result["rollback"] = {"status": status, "canary_checkpoint_id": canary["checkpoint_id"]}
            after = admin.get("/v1/canary")
            if status != 200:
                result["phases"].append(f"rollback answered {status}: {answer}")
                return 1
            if after.get("canary") is not None:
                result["phases"].append(f"a canary is still deployed after the rollback: {after['canary']}")
                return 1
            fleet = admin.get("/v1/fleet")
            stable_id = after["stable"]["checkpoint_id"]
            serving = [r for r in fleet["replicas"] if r.get("state") == "serving"]
            result["rollback"]["stable_checkpoint_id"] = stable_id
            result["rollback"]["replicas_on_stable"] = sum(r.get("checkpoint_id") == stable_id for r in serving)
            result["rollback"]["replicas_serving"] = len(serving)
        finally:
            admin.post("/v1/canary/resume", {"reason": "compose test: rollback done"})
        result["phases"].append("rolled back")
        # 3. A little more traffic on the stable after the rollback; then the operator pauses the trainer,
        # so that what the test counts before and after the restart is settled.
        time.sleep(10.0)
        status, answer = admin.post("/v1/trainer/pause", {"reason": "compose test: counting"})
        if status != 200:
            result["phases"].append(f"trainer pause answered {status}: {answer}")
            return 1
        result["phases"].append("trainer paused")
        return 0
    finally:
        agent.stop(60)
        flushed = fw.flush(120)
        fw.close(30)
        stats = fw.stats
        result.update(
            seconds=round(time.monotonic() - started, 1),
            sessions_sent=agent.stats.sessions,
            agent=agent.stats.snapshot(),
            failed_requests=agent.stats.failed_requests,
            events_sent=stats.sent,
            sdk_dropped=stats.dropped,
            sdk_invalid=stats.invalid,
            sdk_pending=stats.queued,
            sdk_spool_bytes=stats.spool_bytes,
            flushed=flushed,
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
