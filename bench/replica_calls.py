"""``make bench-replica_calls``: CPU per call of the client the fleet code uses to reach replicas.

The canary controller's reconcile asks every replica ``/health``, ``/is_paused`` and
``/weight_info`` at every look, and the hot swap polls ``/metrics`` while it drains. Each call
used to go through ``httpx.get`` / ``httpx.request``, which build a client, and with it an SSL
context that loads the CA bundle, per call; profiled under the demo's load, that was 85 % of the
controller's samples. :func:`flywheel.core.vllm_admin.client` keeps one client per process.

This measures both against a local HTTP server answering like a replica's ``/health`` and
``/weight_info``, in the same run: CPU seconds of this process per call (``time.process_time``,
the server's threads included, the same for both) and wall time per call. The last line is JSON:
``per_call_cpu_ms`` and ``per_call_wall_ms`` of each, and ``cpu_ratio`` (shared client over
per-call client; lower is better).
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from flywheel.core import vllm_admin  # noqa: E402


class Replica(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b'{"weight_version": "v1"}' if self.path == "/weight_info" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def measure(call: Callable[[], object], n: int) -> dict[str, float]:
    """``call`` (two requests) ``n`` times: CPU and wall milliseconds per request."""
    call()  # warm
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        call()
    return {
        "per_call_cpu_ms": round((time.process_time() - cpu) * 1000 / (2 * n), 3),
        "per_call_wall_ms": round((time.perf_counter() - wall) * 1000 / (2 * n), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="/health + /weight_info pairs per client (default 300)")
    args = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def per_call_client() -> None:  # what the fleet code did before
        httpx.get(url + "/health", timeout=5.0)
        httpx.request("GET", url + "/weight_info", timeout=5.0).json()

    def shared_client() -> None:
        vllm_admin.health(url)
        vllm_admin.weight_info(url)

    baseline = measure(per_call_client, args.calls)
    shared = measure(shared_client, args.calls)
    server.shutdown()
    print(f"per-call client: {baseline}", file=sys.stderr)
    print(f"shared client:   {shared}", file=sys.stderr)
    result = {
        "calls": args.calls * 2,
        "per_call_client": baseline,
        "shared_client": shared,
        "cpu_ratio": round(shared["per_call_cpu_ms"] / baseline["per_call_cpu_ms"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
