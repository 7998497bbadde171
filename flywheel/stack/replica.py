"""One vLLM replica in the foreground, started as the local stack starts it: for a container.

``python -m flywheel.stack.replica --model /models/base`` runs the server that
:class:`~flywheel.stack.vllm.VllmReplica` would start (the same argv and environment from the
same settings: served model name and initial weight version the model's policy version, dtype,
context length, processed logprobs, the worker extension, LoRA when the settings ask), listening
on ``--host``/``--port``; once it answers ``/health`` it sets the initial weight version and
writes ``--ready-file``, which the container's healthcheck looks for. ``--gate`` starts the
trainer's eval-gate replica instead (:class:`~flywheel.stack.gate.GateReplica`: LoRA when the
trainer trains adapters, its weight version the folder's path). SIGTERM and SIGINT go on to the
server; the exit status is the server's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flywheel.core import vllm_admin
from flywheel.core.settings import Settings
from flywheel.stack.gate import GateReplica
from flywheel.stack.vllm import VllmReplica, policy_version_of, served_vllm, server_argv, server_env


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flywheel.stack.replica", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the model folder to serve")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all of the container's)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--index", type=int, default=0, help="the replica's index (its CPU binding)")
    parser.add_argument("--gate", action="store_true", help="the trainer's eval-gate replica")
    parser.add_argument("--ready-file", type=Path, default=Path("/tmp/flywheel-replica-ready"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    settings = Settings()
    model_dir = args.model.resolve()
    if not (model_dir / "config.json").is_file():
        print(f"flywheel-replica: {model_dir} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    replica = GateReplica(settings, model_dir) if args.gate else VllmReplica(settings, args.index, model_dir)
    served = policy_version_of(model_dir, settings)
    version = replica.initial_version(model_dir, served)
    args.ready_file.unlink(missing_ok=True)
    env = {**os.environ, **server_env(settings.vllm, args.index, replica.lora)}
    cmd = server_argv(model_dir, served, args.host, args.port, served_vllm(settings), replica.lora)
    print(f"flywheel-replica: serving {model_dir} as {served} (weight version {version}): {' '.join(cmd)}", flush=True)
    server = subprocess.Popen(cmd, env=env, cwd=model_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: server.send_signal(signum))

    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + settings.vllm.startup_timeout_s
    while server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=3.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            timeout = settings.vllm.startup_timeout_s
            print(f"flywheel-replica: no /health within {timeout:.0f} s; stopping", file=sys.stderr)
            server.terminate()
            return server.wait() or 1
        time.sleep(2)
    if server.poll() is None:
        vllm_admin.update_weight_version(url, version)
        args.ready_file.write_text(version + "\n")
        print(f"flywheel-replica: ready, weight version {version}", flush=True)
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
