"""The router's decisions, as pure logic: which policy version a request gets, which replica serves it.

Nothing here does I/O; :mod:`serving.proxy.router` feeds it the routing table read from Postgres,
the results of its health probes and the clock, so every rule is testable on its own:

- **Routable replica**: its ``replicas`` row says ``serving``, the router's own probes pass
  (it is not ejected) and the version its ``/weight_info`` reported equals the row's
  ``policy_version``.
- **Split**: a request's policy version is the canary's when ``bucket(session) < canary
  weight``, else the stable one's. ``bucket`` is a deterministic hash of the session id in
  ``[0, 1)``, so raising the weight only moves stable sessions to the canary, never back.
  A request without a session key draws its bucket at random.
- **Stickiness**: a session's first request fixes its version (:class:`StickyTable`, an LRU
  with a TTL after the last request); later requests go to that version while a routable
  replica serves it, else the session is moved to what the split gives now (a rolled-back
  canary's sessions go to stable).
- **Role pins**: a request whose agent role (``x-flywheel-agent-role``) is pinned goes to the
  pin's policy version, whatever its session's split or stickiness says, and never changes the
  session's sticky version (the session's other roles keep theirs). No routable replica of the
  pinned version means no answer, never the learning policy instead.
- **Within a version**: the replica with the fewest outstanding requests.
- **Ejection** (:class:`ReplicaHealth`): ``eject_after`` consecutive failures (probes or
  connection errors of real requests) eject a replica; a successful probe brings it back.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["stable", "canary"]


def session_bucket(session_id: str) -> float:
    """A uniform, deterministic number in ``[0, 1)`` for ``session_id`` (the first 8 bytes of its BLAKE2b)."""
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def pick_role(bucket: float, canary_weight: float) -> Role:
    """``canary`` when ``bucket < canary_weight``, else ``stable`` (monotone in the weight)."""
    return "canary" if bucket < canary_weight else "stable"


@dataclass(frozen=True)
class DeploymentEntry:
    """An active deployment of the fleet, as the router needs it."""

    role: Role
    policy_version: str
    weight: float
    """Share of new sessions (meaningful for the canary; stable takes the rest)."""
    deployment_id: int | None = None


@dataclass(frozen=True)
class PinEntry:
    """An active role pin: every request of ``agent_role`` goes to ``policy_version``."""

    agent_role: str
    policy_version: str
    deployment_id: int | None = None


@dataclass(frozen=True)
class ReplicaRow:
    """A ``replicas`` row of the fleet."""

    url: str
    state: str
    """``serving``, ``draining``, ``swapping`` or ``failed``; only ``serving`` gets new requests."""
    policy_version: str | None
    id: int | None = None
    """The row's id: what the router's metrics call the replica (never its internal URL)."""


@dataclass(frozen=True)
class RoutingTable:
    """What the router read from Postgres at one refresh."""

    deployments: Mapping[Role, DeploymentEntry]
    replicas: tuple[ReplicaRow, ...]
    pins: Mapping[str, PinEntry] = field(default_factory=dict)
    """Active role pins by agent role."""

    @property
    def stable(self) -> DeploymentEntry | None:
        """The active stable deployment, if any."""
        return self.deployments.get("stable")

    @property
    def canary(self) -> DeploymentEntry | None:
        """The active canary deployment, if any."""
        return self.deployments.get("canary")

    @property
    def canary_weight(self) -> float:
        """Share of new sessions the canary gets (0 without a canary), clamped to ``[0, 1]``."""
        canary = self.canary
        if canary is None or self.stable is not None and canary.policy_version == self.stable.policy_version:
            return 0.0
        return min(max(float(canary.weight), 0.0), 1.0)


EMPTY_TABLE = RoutingTable(deployments={}, replicas=())


class ReplicaHealth:
    """The ejection state machine of one replica.

    ``eject_after`` consecutive failures eject it; a successful *probe* ends the ejection
    (a successful real request only resets the count, an ejected replica gets none anyway).
    It starts ejected-unknown (``probed=False``): not routable until its first probe passes.
    """

    def __init__(self, eject_after: int):
        if eject_after < 1:
            raise ValueError(f"eject_after must be >= 1, got {eject_after}")
        self.eject_after = eject_after
        self.failures = 0
        self.ejected = False
        self.probed = False
        self.weight_version: str | None = None
        """What ``/weight_info`` answered at the last successful probe."""
        self.models: tuple[str, ...] = ()
        """The model names ``/v1/models`` listed at the last successful probe: the served base name first (it
        stays the same whatever weights a full swap reloads), then the loaded LoRA adapters."""
        self.last_error: str | None = None

    @property
    def healthy(self) -> bool:
        """Probed successfully at least once and not ejected."""
        return self.probed and not self.ejected

    def probe_ok(self, weight_version: str | None, models: Iterable[str] = ()) -> bool:
        """Record a passing probe; returns whether this ended an ejection."""
        rejoined = self.ejected
        self.failures = 0
        self.ejected = False
        self.probed = True
        self.weight_version = weight_version
        self.models = tuple(models)
        self.last_error = None
        return rejoined

    def failure(self, error: str) -> bool:
        """Record a failed probe or a connection error; returns whether this ejected the replica."""
        self.failures += 1
        self.last_error = error
        if not self.ejected and self.failures >= self.eject_after:
            self.ejected = True
            return True
        return False

    def request_ok(self) -> None:
        """A real request got an answer: the consecutive-failure count starts again."""
        self.failures = 0


@dataclass
class StickyEntry:
    """A remembered session: its policy version and when it expires."""

    policy_version: str
    expires_at: float


class StickyTable:
    """Session id → policy version, least recently used forgotten first, expiring ``ttl_s`` after its last use."""

    def __init__(self, ttl_s: float, max_sessions: int):
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"need ttl_s > 0 and max_sessions >= 1, got {ttl_s}, {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, StickyEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, now: float) -> str | None:
        """The session's version (and its TTL restarts), or None when unknown or expired."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.expires_at <= now:
            del self._entries[session_id]
            return None
        entry.expires_at = now + self.ttl_s
        self._entries.move_to_end(session_id)
        return entry.policy_version

    def put(self, session_id: str, policy_version: str, now: float) -> None:
        """Remember (or move) the session on ``policy_version``."""
        entry = self._entries.get(session_id)
        if entry is None:
            self._entries[session_id] = StickyEntry(policy_version, now + self.ttl_s)
        else:
            entry.policy_version, entry.expires_at = policy_version, now + self.ttl_s
            self._entries.move_to_end(session_id)
        self._expire(now)

    def _expire(self, now: float) -> None:
        entries = self._entries
        # Front = least recently used = earliest expiry (the TTL is the same for all).
        while entries:
            first = next(iter(entries.values()))
            if first.expires_at > now and len(entries) <= self.max_sessions:
                break
            entries.popitem(last=False)


@dataclass(frozen=True)
class ReplicaView:
    """A routable replica."""

    url: str
    policy_version: str


@dataclass
class Decision:
    """The version a request goes to, and whether the session was (re)pinned to it."""

    policy_version: str
    role: Role | None
    sticky: bool
    """True when the version came from the session's earlier requests."""
    pin: PinEntry | None = None
    """The role pin that chose the version (then ``role`` and ``sticky`` say nothing)."""


@dataclass
class Routes:
    """Routable replicas grouped by policy version, with the table's split."""

    table: RoutingTable
    by_version: dict[str, list[ReplicaView]] = field(default_factory=dict)

    def served_versions(self) -> list[str]:
        """Versions with at least one routable replica."""
        return [v for v, replicas in self.by_version.items() if replicas]

    def role_of(self, version: str) -> Role | None:
        """``stable`` / ``canary`` when an active deployment serves ``version``."""
        for role, entry in self.table.deployments.items():
            if entry.policy_version == version:
                return role
        return None


def routable(row: ReplicaRow, health: ReplicaHealth | None) -> bool:
    """Whether new requests may go to the replica of ``row``: serving, healthy, and serving its version,
    as its weights (``/weight_info``, full checkpoints) or as a loaded LoRA adapter (``/v1/models``)."""
    return (
        row.state == "serving"
        and row.policy_version is not None
        and health is not None
        and health.healthy
        and (health.weight_version == row.policy_version or row.policy_version in health.models[1:])
    )


def build_routes(table: RoutingTable, health: Mapping[str, ReplicaHealth]) -> Routes:
    """Group the routable replicas of ``table`` by the policy versions they serve.

    A replica serves its row's version and, beside it, every deployed version it has loaded as a
    LoRA adapter (a LoRA swap loads the adapter next to the base and leaves the row's version as
    it was): ``/v1/models`` lists those under their policy version.
    """
    routes = Routes(table=table)
    deployed = {entry.policy_version for entry in table.deployments.values()}
    deployed.update(pin.policy_version for pin in table.pins.values())
    for row in table.replicas:
        state = health.get(row.url)
        if state is None or not routable(row, state):
            continue
        versions = [row.policy_version or ""]
        versions += sorted(v for v in deployed if v in state.models[1:] and v not in versions)
        for version in versions:
            routes.by_version.setdefault(version, []).append(ReplicaView(row.url, version))
    return routes


def target_version(routes: Routes, bucket: float) -> tuple[str, Role | None] | None:
    """The version a new session (or a request without one) gets, with a fallback when it has no replica.

    The split's pick first, then the other deployment, then any routable version (e.g. a
    replica still on the previous stable while a promotion rolls through the fleet).
    """
    table = routes.table
    role = pick_role(bucket, table.canary_weight)
    other: Role = "stable" if role == "canary" else "canary"
    for r in (role, other):
        entry = table.deployments.get(r)
        if entry is not None and routes.by_version.get(entry.policy_version):
            return entry.policy_version, r
    served = sorted(routes.served_versions())
    if not served:
        return None
    return served[0], routes.role_of(served[0])


def decide(
    routes: Routes,
    session_id: str | None,
    sticky: StickyTable,
    now: float,
    rng: random.Random | None = None,
    agent_role: str | None = None,
) -> Decision | None:
    """The policy version of one request (None: no routable replica at all).

    A request of a pinned ``agent_role`` gets the pin's version, routable or not (the caller
    waits for it or refuses). Otherwise a known session keeps its version while a routable
    replica serves it, else the split decides and the session is pinned to the result.
    """
    pin = routes.table.pins.get(agent_role) if agent_role is not None else None
    if pin is not None:
        return Decision(pin.policy_version, None, sticky=False, pin=pin)
    if session_id is not None:
        pinned = sticky.get(session_id, now)
        if pinned is not None and routes.by_version.get(pinned):
            return Decision(pinned, routes.role_of(pinned), sticky=True)
        bucket = session_bucket(session_id)
    else:
        bucket = (rng or random).random()
    target = target_version(routes, bucket)
    if target is None:
        return None
    version, role = target
    if session_id is not None:
        sticky.put(session_id, version, now)
    return Decision(version, role, sticky=False)


def least_outstanding(
    candidates: Iterable[ReplicaView],
    outstanding: Mapping[str, int],
    exclude: frozenset[str] | set[str] = frozenset(),
    rng: random.Random | None = None,
) -> ReplicaView | None:
    """The candidate with the fewest ``outstanding`` requests (ties broken at random), skipping ``exclude``."""
    best: list[ReplicaView] = []
    fewest = None
    for view in candidates:
        if view.url in exclude:
            continue
        n = outstanding.get(view.url, 0)
        if fewest is None or n < fewest:
            best, fewest = [view], n
        elif n == fewest:
            best.append(view)
    if not best:
        return None
    return best[0] if len(best) == 1 else (rng or random).choice(best)


def served_model_name(models: list[str] | None, policy_version: str) -> str | None:
    """The ``model`` to send a replica for ``policy_version``: the version itself when the replica
    serves it under that name (a LoRA adapter), else the replica's base model name (first entry)."""
    if not models:
        return None
    if policy_version in models:
        return policy_version
    return models[0]
