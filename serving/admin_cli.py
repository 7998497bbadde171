"""``flywheel`` commands that drive serving through the admin API.

``checkpoints``, ``deploy``, ``promote``, ``rollback``, ``canary``, ``ops``, ``status``, ``tokens``
and ``audit`` talk to the admin API over HTTP with an ops token (``--token`` or
``FLYWHEEL_TOKEN``), so every action is authorised by the token's role and audited under its
name. The API's URL is ``serving.admin_url`` (``FLYWHEEL_SERVING__ADMIN_URL``), else
``http://serving.admin_host:serving.admin_port``; ``--url`` overrides both.

``deploy``, ``promote``, ``rollback`` and ``canary weight`` are operations
(:mod:`serving.admin.operations`): the API accepts them at once and they print the
operation's id; ``--wait`` follows it to its end (progress on stderr, then what it did), as
``flywheel ops show ID --wait`` does for any operation.

The one exception is the first admin token: ``flywheel tokens create --role admin`` without a
token, while no active admin token exists, creates it directly in Postgres (and says so).

Exit codes: 0 done (an operation accepted, or with ``--wait`` succeeded); 1 the API (or the CLI)
refused, or the operation failed, with the reason printed; 2 the admin API (or, for the
bootstrap, Postgres) could not be reached, naming where it tried; 3 ``--wait`` gave up after
``--timeout`` seconds while the operation still runs (it goes on).
httpx and SQLAlchemy are imported inside the commands, so ``flywheel --help`` stays instant.
"""

from __future__ import annotations

import getpass
import json
import time
from typing import Any
from urllib.parse import quote

import typer

from flywheel.core.settings import Settings, get_settings

READ_TIMEOUT_S = 30.0
"""Timeout of a request (deployment actions answer at once with their operation)."""
WAIT_TIMEOUT_S = 1800.0
"""Default of ``--timeout``: how long ``--wait`` follows an operation (a rolling swap of the whole fleet
can take minutes)."""
POLL_S = 1.0
"""How often ``--wait`` reads the operation."""
PROGRESS_EVERY_S = 15.0
"""How often ``--wait`` says that an operation is still running."""
ACTIVE_STATES = ("queued", "running")

TOKEN_OPTION = typer.Option(
    None,
    "--token",
    envvar="FLYWHEEL_TOKEN",
    show_envvar=True,
    show_default=False,
    help="Ops token (viewer, operator or admin) for the admin API.",
)
URL_OPTION = typer.Option(
    None,
    "--url",
    show_default=False,
    help="Admin API URL (default: serving.admin_url, else http://serving.admin_host:admin_port).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print the API's JSON answer.")
REASON_OPTION = typer.Option(None, "--reason", help="Why (kept in the audit log).")
WAIT_OPTION = typer.Option(
    False,
    "--wait",
    help="Follow the operation to its end: progress on stderr, exit 0 when it succeeded, 1 with the reason "
    "when it failed.",
)
TIMEOUT_OPTION = typer.Option(
    WAIT_TIMEOUT_S,
    "--timeout",
    min=1.0,
    help="With --wait: stop following after this many seconds (exit 3; the operation goes on).",
)


class CliFailure(Exception):
    """A command failed: the message to print and the exit code (1 refused or failed, 2 unreachable, 3 timed out)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def admin_url(settings: Settings) -> str:
    """Where clients find the admin API: ``serving.admin_url``, else ``http://admin_host:admin_port``."""
    serving = settings.serving
    if serving.admin_url:
        return serving.admin_url.rstrip("/")
    host = "127.0.0.1" if serving.admin_host in ("0.0.0.0", "::", "") else serving.admin_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{serving.admin_port}"


class AdminClient:
    """A small HTTP client of the admin API that turns every failure into a :class:`CliFailure`."""

    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        self.token = token

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float = READ_TIMEOUT_S,
    ) -> Any:
        """The JSON answer of ``method path``; raises :class:`CliFailure` on any error."""
        import httpx

        if not self.token:
            raise CliFailure(
                1,
                "no token: set FLYWHEEL_TOKEN or pass --token "
                "(an admin creates one with `flywheel tokens create --name NAME --role ROLE`)",
            )
        target = f"{self.url}{path}"
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = httpx.request(
                method,
                target,
                json=body,
                params=params,
                timeout=timeout,
                headers={"Authorization": f"Bearer {self.token}"},
            )
        except httpx.TimeoutException:
            raise CliFailure(
                2,
                f"no answer from the admin API at {self.url} within {timeout:.0f} s "
                "(an action may still be running: check `flywheel status` and `flywheel audit`)",
            ) from None
        except httpx.TransportError as err:
            raise CliFailure(
                2,
                f"cannot reach the admin API at {self.url} ({type(err).__name__}: {err}); "
                "start it with `flywheel-serving admin`, or point --url / "
                "FLYWHEEL_SERVING__ADMIN_URL at it",
            ) from None
        if response.status_code >= 400:
            raise CliFailure(1, f"{method} {path} refused: HTTP {response.status_code} {_reason(response)}")
        return response.json()


def _reason(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error, reason = body.get("error"), body.get("reason") or body.get("detail")
        if reason is not None:
            return f"{error}: {reason}" if error else str(reason)
    return json.dumps(body)[:500]


def _settings() -> Settings:
    return get_settings()


def _client(token: str | None, url: str | None) -> AdminClient:
    return AdminClient(url or admin_url(_settings()), token)


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn``; a :class:`CliFailure` is printed to stderr and becomes the exit code."""
    try:
        return fn(*args, **kwargs)
    except CliFailure as failure:
        typer.echo(f"error: {failure.message}", err=True)
        raise typer.Exit(failure.code) from None


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- printing


def _deployment_line(role: str, dep: dict[str, Any] | None) -> str:
    if not dep:
        return f"  {role:7} none"
    return (
        f"  {role:7} checkpoint={dep.get('checkpoint_id')} version={dep.get('policy_version', '-')} "
        f"weight={_fmt(dep.get('weight'), 2)} status={dep.get('status', '-')} id={dep.get('id', '-')}"
    )


def _pin_lines(pins: list[dict[str, Any]] | None) -> list[str]:
    return [
        f"  pinned  role={p.get('agent_role')} checkpoint={p.get('checkpoint_id')} "
        f"version={p.get('policy_version', '-')} status={p.get('status', '-')} id={p.get('id', '-')}"
        for p in pins or []
    ]


def _pause_line(what: str, state: dict[str, Any]) -> str:
    if not state.get("paused"):
        return f"{what}: running"
    reason = f" ({state['reason']})" if state.get("reason") else ""
    return f"{what}: PAUSED by {state.get('actor')} at {state.get('at')}{reason}"


def _decision_line(decision: dict[str, Any] | None) -> str:
    if not decision:
        return "last decision: none"
    failed = "" if decision.get("success", True) else f" FAILED ({decision.get('error')})"
    return (
        f"last decision: {decision.get('action')} on {decision.get('target')} at {decision.get('at')}{failed}: "
        f"{decision.get('reason')}"
    )


def print_fleet(fleet: dict[str, Any]) -> None:
    """The fleet status in lines: stable, canary, then each replica."""
    typer.echo(f"fleet {fleet.get('fleet', '')}".rstrip())
    typer.echo(_deployment_line("stable", fleet.get("stable")))
    typer.echo(_deployment_line("canary", fleet.get("canary")))
    for line in _pin_lines(fleet.get("pins")):
        typer.echo(line)
    for rep in fleet.get("replicas") or []:
        reason = f"  ({rep['reason']})" if rep.get("reason") else ""
        typer.echo(
            f"  replica {rep.get('id')} {rep.get('url')} {rep.get('state')} version={rep.get('policy_version')} "
            f"checkpoint={rep.get('checkpoint_id')}{reason}"
        )


def _print_result(answer: dict[str, Any], as_json: bool) -> None:
    """What a deployment action did: the deployments after it, what it ended, each replica's swap."""
    if as_json:
        _echo_json(answer)
        return
    typer.echo(f"{answer.get('action')} done by {answer.get('actor')} on fleet {answer.get('fleet')}")
    typer.echo(_deployment_line("stable", answer.get("stable")))
    typer.echo(_deployment_line("canary", answer.get("canary")))
    for line in _pin_lines(answer.get("pins")):
        typer.echo(line)
    for ended in answer.get("ended") or []:
        typer.echo(
            f"  ended   {ended.get('role')} deployment {ended.get('id')} ({ended.get('checkpoint_id')}): "
            f"{ended.get('status')}"
        )
    for swap in answer.get("swaps") or []:
        outcome = "ok" if swap.get("ok") else ("REVERTED" if swap.get("reverted") else "FAILED")
        reason = f" ({swap['reason']})" if swap.get("reason") else ""
        typer.echo(
            f"  swap    {swap.get('url')} {swap.get('from_version')} -> {swap.get('to_version')} {outcome}, "
            f"paused {_fmt(swap.get('pause_ms'), 0)} ms of {_fmt(swap.get('total_ms'), 0)} ms{reason}"
        )


def _operation_line(op: dict[str, Any]) -> str:
    return (
        f"operation {op.get('id')} {op.get('state')}: {op.get('kind')} on fleet {op.get('fleet')} by {op.get('actor')}"
    )


def print_operation(op: dict[str, Any]) -> None:
    """An operation in lines: what, when, by which process, then its result or its error."""
    typer.echo(_operation_line(op))
    params = " ".join(f"{k}={v}" for k, v in (op.get("params") or {}).items() if v is not None)
    typer.echo(f"  params   {params or '-'}")
    typer.echo(
        f"  created  {op.get('created_at')}  started {_fmt(op.get('started_at'))}  "
        f"finished {_fmt(op.get('finished_at'))}"
    )
    typer.echo(f"  owner    {op.get('owner')} (lease renewed {op.get('heartbeat_at')}, {_fmt(op.get('lease_s'), 0)} s)")
    if op.get("state") == "failed":
        typer.echo(f"  error    {op.get('error')}: {op.get('reason')}")
    if op.get("result"):
        _print_result(op["result"], as_json=False)


def follow(client: AdminClient, op: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Read the operation until it ends; progress on stderr. Returns it succeeded; raises :class:`CliFailure`.

    Failed: exit 1 with its error and reason. Still queued or running after ``timeout_s``:
    exit 3 (2 when the admin API did not answer at the end). The admin API not answering
    meanwhile (a restart) is retried: the operation is in Postgres, any admin API process answers.
    """
    op_id = op["id"]
    typer.echo(_operation_line(op), err=True)
    start = time.monotonic()
    deadline, said = start + timeout_s, start
    state, unreachable = op["state"], None
    while op["state"] in ACTIVE_STATES:
        if time.monotonic() > deadline:
            if unreachable is not None:
                raise CliFailure(2, f"{unreachable} (operation {op_id} was {state} when last seen)")
            raise CliFailure(
                3,
                f"operation {op_id} still {state} after {timeout_s:g} s; it goes on: "
                f"follow it with `flywheel ops show {op_id} --wait`",
            )
        time.sleep(POLL_S)
        try:
            op = client.call("GET", f"/v1/operations/{op_id}")
        except CliFailure as failure:
            if failure.code != 2:
                raise
            if unreachable is None:
                typer.echo(f"{failure.message}; retrying until the timeout", err=True)
            unreachable = failure.message
            continue
        unreachable = None
        now = time.monotonic()
        if op["state"] != state:
            state, said = op["state"], now
            typer.echo(f"operation {op_id} {state} ({now - start:.0f} s)", err=True)
        elif now - said >= PROGRESS_EVERY_S:
            said = now
            typer.echo(f"operation {op_id} still {state} ({now - start:.0f} s)", err=True)
    if op["state"] == "failed":
        raise CliFailure(1, f"operation {op_id} ({op.get('kind')}) failed: {op.get('error')}: {op.get('reason')}")
    return op


def _follow_or_exit(client: AdminClient, op: dict[str, Any], timeout_s: float, as_json: bool) -> dict[str, Any]:
    """:func:`follow`; a failed operation is printed (whole, or its JSON), then its reason, and exits 1."""
    try:
        return follow(client, op, timeout_s)
    except CliFailure as failure:
        if failure.code == 1:
            ended = _run(client.call, "GET", f"/v1/operations/{op['id']}")
            if as_json:
                _echo_json(ended)
            else:
                print_operation(ended)
        typer.echo(f"error: {failure.message}", err=True)
        raise typer.Exit(failure.code) from None


def _act(
    token: str | None,
    url: str | None,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    wait: bool,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Start a deployment operation; print its id, or with ``wait`` follow it and print what it did."""
    client = _client(token, url)
    op = _run(client.call, method, path, body=body)
    if wait:
        op = _follow_or_exit(client, op, timeout_s, as_json)
        if as_json:
            _echo_json(op)
        else:
            _print_result(op.get("result") or {}, as_json=False)
        return
    if as_json:
        _echo_json(op)
        return
    typer.echo(_operation_line(op))
    typer.echo(f"follow it with `flywheel ops show {op['id']} --wait` (or pass --wait)", err=True)


# --------------------------------------------------------------------------- checkpoints

checkpoints_app = typer.Typer(no_args_is_help=False, help="Checkpoints of the registry (list, show).")


@checkpoints_app.callback(invoke_without_command=True)
def _checkpoints_default(ctx: typer.Context, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION) -> None:
    """List checkpoints when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        checkpoints_list(token=token, url=url, limit=20, offset=0, status=None, as_json=False)


@checkpoints_app.command("list")
def checkpoints_list(
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    limit: int = typer.Option(20, min=1, max=500, help="Rows."),
    offset: int = typer.Option(0, min=0, help="Rows to skip (newest first)."),
    status: str | None = typer.Option(None, help="Only this status (candidate, rejected, deployed, retired, deleted)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Checkpoints, newest first: status, parent, policy version, held-out success."""
    page = _run(
        _client(token, url).call, "GET", "/v1/checkpoints", params={"limit": limit, "offset": offset, "status": status}
    )
    if as_json:
        _echo_json(page)
        return
    typer.echo(f"{'id':28} {'status':10} {'parent':28} {'heldout':>8} created")
    for item in page["items"]:
        heldout = (item.get("heldout") or {}).get("success_rate")
        typer.echo(
            f"{item['id']:28} {item['status']:10} {item.get('parent_id') or '-':28} {_fmt(heldout):>8} "
            f"{item['created_at']}"
        )
    shown = page["offset"] + len(page["items"])
    more = f"; more with --offset {shown}" if shown < page["total"] else ""
    typer.echo(f"({len(page['items'])} of {page['total']}{more})")


@checkpoints_app.command("show")
def checkpoints_show(
    checkpoint_id: str = typer.Argument(..., help="Checkpoint id."),
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
) -> None:
    """One checkpoint with its metrics, evaluation and data window (JSON)."""
    _echo_json(_run(_client(token, url).call, "GET", f"/v1/checkpoints/{quote(checkpoint_id, safe='')}"))


# --------------------------------------------------------------------------- deploy, promote, rollback


def deploy_command(
    checkpoint_id: str = typer.Argument(..., help="Checkpoint to deploy as the canary."),
    weight: float = typer.Option(0.05, "--weight", help="Canary share of new sessions, in (0, 1]."),
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Deploy a checkpoint as the fleet's canary (hot swap, one replica at a time)."""
    body = {"checkpoint_id": checkpoint_id, "weight": weight}
    _act(token, url, "POST", "/v1/canary", body, wait, timeout, as_json)


def promote_command(
    reason: str | None = REASON_OPTION,
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Promote the canary to stable on the whole fleet."""
    _act(token, url, "POST", "/v1/promote", {"reason": reason}, wait, timeout, as_json)


def rollback_command(
    to: str | None = typer.Option(
        None, "--to", help="Checkpoint to serve as stable (default: end the canary, back to the previous stable)."
    ),
    reason: str | None = REASON_OPTION,
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Roll back to the previous stable, or to any checkpoint with --to."""
    _act(token, url, "POST", "/v1/rollback", {"to_checkpoint_id": to, "reason": reason}, wait, timeout, as_json)


def pin_command(
    agent_role: str = typer.Argument(..., help="The agent role (as the SDK sends it in x-flywheel-agent-role)."),
    checkpoint: str = typer.Argument(..., help="Checkpoint id or policy version every request of the role gets."),
    reason: str | None = REASON_OPTION,
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Pin an agent role to a frozen checkpoint, whatever stable and canary serve (e.g. PARL's sub-agents)."""
    body = {"checkpoint_id": checkpoint, "reason": reason}
    _act(token, url, "PUT", f"/v1/pins/{agent_role}", body, wait, timeout, as_json)


def unpin_command(
    agent_role: str = typer.Argument(..., help="The pinned agent role."),
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """End an agent role's pin: its requests follow stable and canary again."""
    _act(token, url, "DELETE", f"/v1/pins/{agent_role}", None, wait, timeout, as_json)


# --------------------------------------------------------------------------- canary

canary_app = typer.Typer(no_args_is_help=False, help="The canary: status, weight, pause and resume the controller.")


@canary_app.callback(invoke_without_command=True)
def _canary_default(ctx: typer.Context, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION) -> None:
    """Show the canary when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        canary_status(token=token, url=url, as_json=False)


@canary_app.command("status")
def canary_status(token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION, as_json: bool = JSON_OPTION) -> None:
    """The canary and stable deployments, whether the controller is paused, and its last decision."""
    answer = _run(_client(token, url).call, "GET", "/v1/canary")
    if as_json:
        _echo_json(answer)
        return
    typer.echo(f"fleet {answer['fleet']}")
    typer.echo(_deployment_line("stable", answer.get("stable")))
    typer.echo(_deployment_line("canary", answer.get("canary")))
    enabled = "" if answer.get("enabled") else " (disabled in settings: serving.canary.enabled=false)"
    typer.echo(_pause_line("canary controller", answer["controller"]) + enabled)
    typer.echo(_decision_line(answer.get("last_decision")))


@canary_app.command("weight")
def canary_weight(
    weight: float = typer.Argument(..., help="New canary share of new sessions, in (0, 1]."),
    reason: str | None = REASON_OPTION,
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Change the canary's traffic weight."""
    _act(token, url, "PUT", "/v1/canary/weight", {"weight": weight, "reason": reason}, wait, timeout, as_json)


def _flag(path: str, what: str, reason: str | None, token: str | None, url: str | None) -> None:
    state = _run(_client(token, url).call, "POST", path, body={"reason": reason})
    typer.echo(_pause_line(what, state))


@canary_app.command("pause")
def canary_pause(
    reason: str | None = REASON_OPTION, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION
) -> None:
    """Pause the canary controller (no automatic step, promotion or rollback until resumed)."""
    _flag("/v1/canary/pause", "canary controller", reason, token, url)


@canary_app.command("resume")
def canary_resume(
    reason: str | None = REASON_OPTION, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION
) -> None:
    """Resume the canary controller."""
    _flag("/v1/canary/resume", "canary controller", reason, token, url)


# --------------------------------------------------------------------------- operations

ops_app = typer.Typer(
    no_args_is_help=False, help="Deployment operations (deploy, weight, promote, rollback): list, show."
)


@ops_app.callback(invoke_without_command=True)
def _ops_default(ctx: typer.Context, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION) -> None:
    """List recent operations when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        ops_list(token=token, url=url, limit=20, state=None, kind=None, as_json=False)


@ops_app.command("list")
def ops_list(
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    limit: int = typer.Option(20, min=1, max=500, help="Rows."),
    state: str | None = typer.Option(None, help="Only this state (queued, running, succeeded, failed)."),
    kind: str | None = typer.Option(None, help="Only this kind (deploy.canary, deploy.weight, deploy.promote, ...)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Recent operations, newest first: id, state, kind, who, when, and why a failed one failed."""
    page = _run(
        _client(token, url).call, "GET", "/v1/operations", params={"limit": limit, "state": state, "kind": kind}
    )
    if as_json:
        _echo_json(page)
        return
    for op in page["items"]:
        why = f"  {op.get('error')}: {op.get('reason')}" if op.get("state") == "failed" else ""
        typer.echo(f"{op['id']}  {op['state']:9} {op['kind']:16} {op['actor']:24} {op['created_at']}{why}")


@ops_app.command("show")
def ops_show(
    operation_id: str = typer.Argument(..., help="Operation id (printed by deploy, promote, rollback, canary weight)."),
    wait: bool = WAIT_OPTION,
    timeout: float = TIMEOUT_OPTION,
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """One operation: its state, its result or its error; --wait follows it to its end (exit 1 if it failed)."""
    client = _client(token, url)
    op = _run(client.call, "GET", f"/v1/operations/{quote(operation_id, safe='')}")
    if wait:
        op = _follow_or_exit(client, op, timeout, as_json)
    if as_json:
        _echo_json(op)
    else:
        print_operation(op)


# --------------------------------------------------------------------------- status


def fleet_status(token: str | None, url: str | None, as_json: bool) -> int:
    """Print the fleet, the trainer and the canary controller through the admin API; return an exit code.

    Exit 1: the API refused; exit 2: the admin API is unreachable.
    """
    try:
        answer = _client(token, url).call("GET", "/v1/status")
    except CliFailure as failure:
        typer.echo(f"fleet: {failure.message}", err=True)
        return failure.code
    if as_json:
        _echo_json(answer)
    else:
        print_fleet(answer["fleet"])
        typer.echo(_pause_line("trainer", answer["trainer"]))
        typer.echo(_pause_line("canary controller", answer["canary_controller"]))
    return 0


# --------------------------------------------------------------------------- audit


def audit_command(
    limit: int = typer.Option(20, min=1, max=500, help="Rows."),
    action: str | None = typer.Option(None, help="Only this action (e.g. canary.promote)."),
    prefix: str | None = typer.Option(None, "--prefix", help="Only actions starting with this (e.g. token.)."),
    actor: str | None = typer.Option(None, help="Only this actor (e.g. token:alice)."),
    failed: bool = typer.Option(False, "--failed", help="Only failed (refused) calls."),
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Recent audit-log entries, newest first."""
    params = {
        "limit": limit,
        "action": action,
        "action_prefix": prefix,
        "actor": actor,
        "success": "false" if failed else None,
    }
    page = _run(_client(token, url).call, "GET", "/v1/audit", params=params)
    if as_json:
        _echo_json(page)
        return
    for item in page["items"]:
        mark = "ok  " if item["success"] else "FAIL"
        details = item.get("details") or {}
        why = f"  {details['reason']}" if details.get("reason") else ""
        typer.echo(f"{item['at']}  {mark} {item['action']:18} {item['actor']:24} {item.get('target') or '-'}{why}")


# --------------------------------------------------------------------------- tokens

tokens_app = typer.Typer(no_args_is_help=False, help="Ops tokens of the admin API: list, create, revoke.")


@tokens_app.callback(invoke_without_command=True)
def _tokens_default(ctx: typer.Context, token: str | None = TOKEN_OPTION, url: str | None = URL_OPTION) -> None:
    """List tokens when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        tokens_list(token=token, url=url, role=None, as_json=False)


@tokens_app.command("list")
def tokens_list(
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    role: str | None = typer.Option(None, help="Only this role (viewer, operator, admin, writer)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Every token (admin only): id, prefix, name, role, state; never the tokens."""
    answer = _run(_client(token, url).call, "GET", "/v1/tokens", params={"role": role})
    if as_json:
        _echo_json(answer)
        return
    for item in answer["items"]:
        state = f"revoked {item['revoked_at']}" if item["revoked_at"] else "active"
        used = f"last used {item['last_used_at']}" if item["last_used_at"] else "never used"
        typer.echo(f"{item['id']:5}  {item['token_prefix']:14} {item['name']:24} {item['role']:8} {state}, {used}")


@tokens_app.command("create")
def tokens_create(
    name: str = typer.Option(..., "--name", help="Who or what holds the token (unique among active tokens)."),
    role: str = typer.Option(..., "--role", help="viewer, operator or admin."),
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    db_url: str | None = typer.Option(
        None, "--db-url", help="Database URL for the first-admin bootstrap (default: settings)."
    ),
) -> None:
    """Create a token and print it once (stdout; only its hash is stored).

    With an admin token this goes through the admin API. Without one, and while no active
    admin token exists, the first admin token is created directly in Postgres (bootstrap).
    """
    if role not in ("viewer", "operator", "admin"):
        typer.echo(
            f"error: --role must be viewer, operator or admin (got {role!r}); "
            "gateway write keys are made with `flywheel keys create`",
            err=True,
        )
        raise typer.Exit(1)
    if token:
        answer = _run(_client(token, url).call, "POST", "/v1/tokens", body={"name": name, "role": role})
        typer.echo(
            f"created {answer['role']} token {answer['id']} ({answer['token_prefix']}…) named "
            f"{answer['name']!r}; store it now, it is not shown again:",
            err=True,
        )
        typer.echo(answer["token"])
        return
    info, secret = _run(_bootstrap, name, role, db_url)
    typer.echo(
        f"no admin token existed: created the first admin token {info.id} ({info.token_prefix}…) named "
        f"{info.name!r} directly in Postgres (bootstrap, audited as token.create). Later tokens are created "
        "through the admin API with it (FLYWHEEL_TOKEN). Store it now, it is not shown again:",
        err=True,
    )
    typer.echo(secret)


def _bootstrap(name: str, role: str, db_url: str | None) -> Any:
    from sqlalchemy.exc import OperationalError

    from flywheel.core.db.engine import get_engine
    from flywheel.core.endpoints import NotConfigured, postgres_url
    from serving.admin.tokens import BootstrapRefused, bootstrap_admin_token

    try:
        url = db_url or postgres_url(_settings())
    except NotConfigured as err:
        raise CliFailure(2, f"no token given and no database to bootstrap the first admin token in: {err}") from None
    if role != "admin":
        _refuse_if_admin_exists(url)
        raise CliFailure(
            1,
            "no admin token exists yet: the first token must be created with --role admin "
            "(bootstrap); create the others with it",
        )
    try:
        return bootstrap_admin_token(get_engine(url), name, f"cli:{getpass.getuser()}")
    except BootstrapRefused as err:
        raise CliFailure(1, f"no token given, and the bootstrap does not apply: {err}") from None
    except OperationalError as err:
        raise CliFailure(
            2,
            f"cannot reach Postgres at {_safe_url(url)} to bootstrap the first admin token: "
            f"{str(err.orig).strip().splitlines()[0] if err.orig else err}",
        ) from None


def _refuse_if_admin_exists(url: str) -> None:
    """With an admin token in the database, a token-less create is refused with the reason (exit 1)."""
    from sqlalchemy import select
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    from flywheel.core.db.engine import get_engine
    from flywheel.core.db.models import ApiKey

    try:
        with Session(get_engine(url)) as session:
            exists = session.scalars(
                select(ApiKey.id).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).limit(1)
            ).first()
    except OperationalError as err:
        raise CliFailure(2, f"cannot reach Postgres at {_safe_url(url)}: {err.orig or err}") from None
    if exists is not None:
        raise CliFailure(1, "no token: creating a token needs an admin token (--token or FLYWHEEL_TOKEN)")


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: int = typer.Argument(..., min=1, help="Id of the token (from `flywheel tokens list`)."),
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
) -> None:
    """Revoke a token; the admin API refuses it from the next request."""
    answer = _run(_client(token, url).call, "DELETE", f"/v1/tokens/{token_id}")
    typer.echo(f"revoked token {answer['id']} ({answer['token_prefix']}…, {answer['name']!r}, {answer['role']})")


def register(app: typer.Typer) -> None:
    """Add the serving commands to the ``flywheel`` app (its ``status`` shows the fleet through
    :func:`fleet_status`)."""
    app.add_typer(checkpoints_app, name="checkpoints")
    app.command("deploy")(deploy_command)
    app.command("promote")(promote_command)
    app.command("rollback")(rollback_command)
    app.command("pin")(pin_command)
    app.command("unpin")(unpin_command)
    app.add_typer(canary_app, name="canary")
    app.add_typer(ops_app, name="ops")
    app.command("audit")(audit_command)
    app.add_typer(tokens_app, name="tokens")
