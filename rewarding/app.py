"""The rewarding stream processor: a faust app over the session events.

- The agent takes events from the events topic in batches, parses each with
  ``parse_event`` (a record that fails is counted and skipped: ingest dead-letters it) and
  adds it to its session's state in the ``sessions`` table, idempotently by event id.
- The table is keyed by the Kafka message key (the session id) and uses the producer's
  partitioner, so a session's state lives in the changelog partition with the number of
  its events partition; a worker that restarts (also after SIGKILL) recovers it from the
  changelog. Its value maps project -> state, for session ids shared across projects.
  A batch is acked (its offsets become committable) only once the broker holds the
  changelog records it caused, and recovery reads each changelog to its last record
  (see :mod:`rewarding.changelog`: both were ways to lose sessions after a SIGKILL).
  What has been scored is kept apart in the small ``marks`` table (same key, same
  partitions), so marking a session scored does not rewrite its events to the changelog.
- A timer finds the sessions whose window closed (ended + feedback window, or a timeout,
  or late events gathered for ``rescore_delay_s``) in the partitions this worker owns and,
  in chunks of at most ``finalize_batch_max`` until none is due, scores them, writes each
  reward version with its samples in one transaction (the store
  refuses to write the same events twice), publishes the samples on the scored topic,
  and marks the states scored.

Scale out by starting more workers with the same ``rewarding.group_id``: partitions, and
with them sessions and their states, are spread over the workers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import faust
import psycopg
from aiokafka.partitioner import murmur2
from faust.sensors import Monitor
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent
from sqlalchemy.exc import OperationalError

from flywheel.core.contracts.events import ContractError, Event, parse_event
from flywheel.core.settings import Settings
from rewarding import metrics
from rewarding.changelog import ChangelogTable, RewardingTableManager
from rewarding.detectors import detector_report
from rewarding.records import scored_record
from rewarding.scorer import ScoredSession, Scorer
from rewarding.session_state import EventCache, SessionState, Windows
from rewarding.store import RewardStore, StoreResult
from rewarding.topics import Topics
from rewarding.transport import Transport, broker_credentials

log = logging.getLogger(__name__)

Slot = tuple[bytes, str]
"""(table key = session id bytes, project)."""
PRODUCER_LINGER_S = 0.005
"""Changelog and scored records wait this long to share a produce request."""
PRODUCER_BATCH_BYTES = 512 * 1024
"""Per-partition produce batch (session states are kilobytes each; faust's default is 16 KiB)."""
PRODUCER_BUFFER_MESSAGES = 2000
"""Table changelog records buffered before faust pauses consuming (its default, 100, stalls every batch)."""
ACKS_IN_FLIGHT = 4
"""Batches applied whose changelog records the broker has not yet acknowledged (each is acked after)."""
WATCHDOG_EXIT = 75
"""Exit code of a worker that ends itself after a wedged rebalance (EX_TEMPFAIL: restart it)."""
EVICT_EVERY_S = 30.0
"""How often a worker scans its table for states past their retention."""
HOLDING_LOG = "holding events partitions %s (generation %s), tables recovered: fetching from t=%.6f cpu=%.3f"
"""Logged when an assignment is complete; ``rewarding.harness.HOLDING_MARK`` reads the time."""
FIRST_EVENTS_LOG = "first events since the assignment: t=%.6f"
"""Logged at the first batch after an assignment; ``rewarding.harness.FIRST_EVENTS_MARK`` reads the time."""


@functools.lru_cache(maxsize=65_536)
def partition_of(key: bytes, partitions: int) -> int:
    """The partition the default Kafka partitioner (murmur2) gives ``key``.

    Cached: every event of a session asks for the same key, and aiokafka's murmur2 is pure
    Python (it was ~2 % of a busy worker's CPU)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def windows_of(settings: Settings) -> Windows:
    """The scoring windows from settings."""
    r = settings.rewarding
    return Windows(r.feedback_window_s, r.session_timeout_s, r.rescore_delay_s)


class LeanMonitor(Monitor):
    """faust's Monitor without its per-message, per-event, per-table-access and per-send
    bookkeeping (statistics for faust's web views, which the worker does not serve; its own
    metrics are Prometheus counters). Each of those hooks runs several times per event: ~2 %
    of a busy worker's CPU. Rebalance, assignment and commit statistics are kept, and so is
    each partition's last stream event time (``stream_inbound_time``): faust's consumer reads it
    to tell a stalled stream ("Stream has not started processing ...", logged as an error) from a
    busy one; without it, every partition with a backlog was reported stalled after 5 minutes."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        self.stream_inbound_time[tp] = time.monotonic()
        return None

    def on_stream_event_out(self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None) -> None:
        pass

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_table_get(self, table: Any, key: Any) -> None:
        pass

    def on_table_set(self, table: Any, key: Any, value: Any) -> None:
        pass

    def on_table_del(self, table: Any, key: Any) -> None:
        pass

    def on_send_initiated(self, producer: Any, topic: str, message: Any, keysize: int, valsize: int) -> None:
        return None

    def on_send_completed(self, producer: Any, state: Any, metadata: Any) -> None:
        pass


class ResumeKeepsQueues(FlowControlEvent):
    """faust's flow control of the stream queues, but resuming a flow that is already active
    leaves the queues alone.

    mode's ``FlowControlEvent.resume`` always clears every stream queue. A revoke suspends the
    flow and clears the queues itself; recovery then resumes the flow to read the changelogs,
    and resumes it again once the tables are recovered (``Recovery.on_recovery_completed``),
    after it has resumed the stream partitions and sought them to their committed offsets. In
    between, the fetch loop runs: records fetched from the committed offsets are delivered to the
    (already active) stream queue and their read offsets recorded, and that second resume then
    clears them. They never reach the agent, are never fetched again, and the partition's commits
    stop there: a hole of one fetch at each partition's committed offset, the sessions in it never
    scored (``test_a_worker_joining_and_leaving_mid_stream_loses_and_doubles_nothing``).
    Everything in an active flow's queues was delivered in the current generation (a rebalance
    suspends and clears first), so keeping it is right.
    """

    def resume(self) -> None:
        if self.is_active():  # already flowing: what the queues hold is current (class doc)
            self._resume.set()
            return
        super().resume()


class RewardingFaustApp(faust.App):
    """faust's app with :class:`ResumeKeepsQueues` as its flow control."""

    @cached_property
    def flow_control(self) -> FlowControlEvent:
        return ResumeKeepsQueues(loop=self.loop)


@dataclass
class Due:
    """A session picked for scoring in one tick."""

    slot: Slot
    state: SessionState
    n_events: int
    due_at: float


class RewardingApp:
    """The faust app, its table, agent and timers, and the scoring around them."""

    def __init__(self, settings: Settings, bootstrap: str, db_url: str, scorer: Scorer, topics: Topics):
        self.settings = settings
        self.conf = settings.rewarding
        self.topics = topics
        self.scorer = scorer
        self.store = RewardStore(db_url)
        self.db_url = db_url
        self.windows = windows_of(settings)
        self.cache = EventCache(self.conf.event_cache_size)
        self.due_index: dict[Slot, float] = {}
        self._indexed_rebalance = -1
        self._next_evict = 0.0
        self._first_batch_pending = False
        self._due_now = False
        """Set by :meth:`apply_batch` when a session it changed is already due (its window closed)."""
        self._finalizing = False
        self._again = False
        self._woken: asyncio.Task | None = None
        self.app = self._make_app(bootstrap)
        self.events = self.app.topic(
            topics.events, key_serializer="raw", value_serializer="raw", partitions=topics.partitions
        )
        self.table = self.app.Table(
            "sessions", key_type=bytes, partitions=topics.partitions, use_partitioner=True, help="Session states"
        )
        self.marks = self.app.Table(
            "marks", key_type=bytes, partitions=topics.partitions, use_partitioner=True, help="What is scored"
        )
        self.app.agent(self.events, name="rewarding.consume")(self.consume)
        self.app.on_rebalance_complete.connect(self.on_assigned)
        self.app.timer(self.conf.timer_interval_s, name="rewarding.finalize")(self.finalize_tick)
        self._rebalancing_since: float | None = None
        if self.conf.rebalance_watchdog_s > 0:
            self.app.timer(min(5.0, self.conf.rebalance_watchdog_s / 4), name="rewarding.watchdog")(self.watchdog)
        if self.conf.metrics_port is not None:
            self.app.timer(self.conf.detectors.refresh_s, name="rewarding.detectors")(self.refresh_detectors)

    def _make_app(self, bootstrap: str) -> faust.App:
        c = self.conf
        web: dict[str, Any] = {"web_enabled": False}
        if c.web_port is not None:
            web = {"web_enabled": True, "web_port": c.web_port, "web_bind": "127.0.0.1"}
        datadir = Path(self.settings.run_dir) / "rewarding"
        datadir.mkdir(parents=True, exist_ok=True)
        security = self.settings.kafka.security()
        app = RewardingFaustApp(
            c.group_id,
            broker=[f"kafka://{b}" for b in bootstrap.split(",")],
            broker_credentials=broker_credentials(security),
            store="memory://",
            datadir=str(datadir),
            table_standby_replicas=0,
            topic_partitions=self.topics.partitions,
            topic_replication_factor=self.settings.ingest.replication_factor,
            consumer_auto_offset_reset="earliest",
            broker_session_timeout=c.session_timeout_broker_s,
            broker_rebalance_timeout=c.rebalance_timeout_s,
            broker_max_poll_interval=c.max_poll_interval_s,
            broker_heartbeat_interval=min(3.0, c.session_timeout_broker_s / 3),
            broker_commit_interval=c.commit_interval_s,
            producer_linger=PRODUCER_LINGER_S,
            producer_max_batch_size=PRODUCER_BATCH_BYTES,
            # A changelog record holds a session's state (all its events) and a scored record all its
            # samples: with 128 k-token completions, megabytes each (faust's defaults: 1 MB, 4 MB).
            producer_max_request_size=self.settings.kafka.max_record_bytes,
            consumer_max_fetch_size=self.settings.kafka.max_record_bytes,
            worker_redirect_stdouts=False,
            Table=ChangelogTable,
            TableManager=RewardingTableManager,
            Monitor=LeanMonitor,
            **web,
        )
        app.transport = Transport(
            app.conf.broker_consumer,
            app,
            fetch_max_wait_s=c.fetch_max_wait_s,
            fetch_max_bytes=self.settings.kafka.max_record_bytes,
            security=security,
        )
        app.producer.buffer.max_messages = PRODUCER_BUFFER_MESSAGES
        return app

    # ------------------------------------------------------------------ consuming

    async def on_assigned(self, sender: Any = None, **kwargs: Any) -> None:
        """faust's ``on_rebalance_complete``: partitions held, tables recovered, fetching starts now."""
        self._first_batch_pending = True
        owned, generation = sorted(self.owned()), self.app.consumer_generation_id
        log.info(HOLDING_LOG, owned, generation, time.time(), time.process_time())

    async def consume(self, stream: faust.Stream) -> None:
        """The agent: apply batches of events to the session states.

        Events come unacked; a batch is acked (its offsets become committable) only once the
        broker holds the changelog records it caused (see :mod:`rewarding.changelog`). That
        wait runs in the background, at most ``ACKS_IN_FLIGHT`` batches at a time.
        """
        acking: collections.deque[asyncio.Task] = collections.deque()
        async for batch in stream.noack_take(self.conf.batch_max_events, within=self.conf.batch_max_wait_s):
            started = time.perf_counter()
            if self._first_batch_pending:
                self._first_batch_pending = False
                log.info(FIRST_EVENTS_LOG, time.time())
            self.apply_batch([(e.key, e.value, e.message.partition) for e in batch], time.time())
            if self._due_now:
                self._due_now = False
                self.wake_finalizer()
            written = self.table.take_unwritten()
            prior = acking[-1] if acking else None
            acking.append(asyncio.ensure_future(self._ack_when_written(stream, batch, written, prior)))
            while acking and (acking[0].done() or len(acking) > ACKS_IN_FLIGHT):
                await acking.popleft()
            metrics.STAGE_SECONDS.labels("apply").inc(time.perf_counter() - started)

    async def _ack_when_written(
        self, stream: faust.Stream, events: list, written: list[asyncio.Future], prior: asyncio.Task | None
    ) -> None:
        """Ack ``events`` once every changelog record in ``written`` is acknowledged by the broker,
        and the batch before (``prior``) is acked: batches are acked in order. (faust commits past
        one unacked offset at the head of a partition's acked offsets, its committed offset
        + 1 taken for contiguous; an earlier batch still waiting for its changelog records while
        a later one was acked could have its last record committed unprocessed.)

        A failed changelog write crashes the worker: its events stay unacked (never committed),
        so they are processed again after the restart.
        """
        try:
            if written:
                await asyncio.gather(*written)
        except Exception as err:
            log.error("changelog write failed; stopping the worker so its events are processed again: %r", err)
            await self.app.crash(err)
            raise
        if prior is not None:
            await prior  # raises if that batch's write failed (the worker is crashing): this one stays unacked too
        for event in events:
            await stream.ack(event)

    def apply_batch(self, records: list[tuple[bytes | None, bytes, int]], arrived_at: float) -> int:
        """Add (key, value, partition) records to their sessions' states; the number of sessions changed."""
        touched: dict[bytes, dict[str, Any]] = {}
        states: dict[Slot, SessionState] = {}
        changed: set[Slot] = set()
        applied = duplicates = 0
        for key, value, partition in records:
            parsed = self.parse(key, value, partition)
            if parsed is None:
                continue
            event, text = parsed
            slot = (key, event.project)
            state = states.get(slot)
            if state is None:
                bucket = touched.get(key)
                if bucket is None:
                    bucket = dict(self.stored(self.table, key) or {})
                    touched[key] = bucket
                state = self.load_state(key, event.project, bucket) or SessionState(event.project, event.session_id)
                states[slot] = state
            event_key = str(event.event_id)
            if state.add(event, arrived_at, self.windows, raw=text, key=event_key):
                self.cache.put(event, event_key)
                changed.add(slot)
                applied += 1
            else:
                duplicates += 1
        metrics.APPLIED.inc(applied)
        metrics.DUPLICATE.inc(duplicates)
        for slot in changed:
            key, project = slot
            state = states[slot]
            touched[key][project] = state.to_dict()
            if state.due_at is not None:
                self.due_index[slot] = state.due_at
                self._due_now = self._due_now or state.due_at <= arrived_at
        for key in {k for k, _ in changed}:
            self.table[key] = touched[key]
        return len(changed)

    def load_state(self, key: bytes, project: str, bucket: dict[str, Any] | None = None) -> SessionState | None:
        """A session's state from the ``sessions`` table with the newer ``marks`` merged in."""
        data = (bucket if bucket is not None else (self.stored(self.table, key) or {})).get(project)
        if data is None:
            return None
        state = SessionState.from_dict(data)
        state.merge_marks((self.stored(self.marks, key) or {}).get(project), self.windows)
        return state

    @staticmethod
    def stored(table: faust.Table, key: bytes) -> Any:
        """``table.get(key)`` read from the table's store (``Collection.data``).

        The same value, without faust's per-read hook (a sensor call, ~10x the lookup itself);
        writes always go through the table, which sends them to the changelog.
        """
        return table.data.get(key)

    def parse(self, key: bytes | None, value: bytes, partition: int) -> tuple[Event, str] | None:
        """The event of one record and its JSON text, or None (counted) when it is invalid or keyed
        to another session."""
        try:
            text = value.decode("utf-8")
            event = parse_event(text)
        except (UnicodeDecodeError, ContractError):
            metrics.EVENTS.labels("invalid").inc()
            return None
        if event.session_id is None:  # feedback by completion id alone: ingest re-produces it attached
            metrics.EVENTS.labels("unattached").inc()
            return None
        if key is None or key != event.session_id.encode("utf-8"):
            metrics.EVENTS.labels("key_mismatch").inc()
            log.warning("skipping event %s: record key %r is not its session id", event.event_id, key)
            return None
        if partition_of(key, self.topics.partitions) != partition:
            metrics.EVENTS.labels("partition_mismatch").inc()
        return event, text

    # ------------------------------------------------------------------ scoring

    def ready(self) -> bool:
        """Assigned, recovered and not rebalancing."""
        return not self.app.rebalancing and not self.app.in_recovery and bool(self.owned())

    def owned(self) -> set[int]:
        """Events partitions this worker consumes now."""
        return {tp.partition for tp in self.app.consumer.assignment() if tp.topic == self.topics.events}

    def rebuild_index(self) -> None:
        """Re-read due times from the table (after a rebalance or recovery changed what is local)."""
        self.due_index = {}
        for key, bucket in self.table.items():
            for project in bucket or {}:
                state = self.load_state(key, project, bucket)
                if state is not None and state.due_at is not None:
                    self.due_index[(key, project)] = state.due_at
        self._indexed_rebalance = self.app.rebalancing_count

    def pick_due(self, now: float, owned: set[int]) -> list[Due]:
        """Sessions in owned partitions whose due time has passed, oldest first, at most a batch."""
        if self._indexed_rebalance != self.app.rebalancing_count:
            self.rebuild_index()
        candidates = sorted((at, slot) for slot, at in self.due_index.items() if at <= now)
        picked: list[Due] = []
        for at, slot in candidates:
            key, project = slot
            if partition_of(key, self.topics.partitions) not in owned:
                continue
            state = self.load_state(key, project)
            if state is None or state.due_at is None:
                self.due_index.pop(slot, None)
                continue
            picked.append(Due(slot, state, state.n_events, state.due_at or at))
            if len(picked) >= self.conf.finalize_batch_max:
                break
        return picked

    def wake_finalizer(self) -> None:
        """Run :meth:`finalize_tick` now, not at the next tick: a batch brought sessions already due.

        Sessions whose window closed before they arrived (a backlog, a window shorter than the
        tick) are scored without waiting up to ``timer_interval_s``. An error ends the worker,
        as it would from the timer.
        """
        if self._woken is not None and not self._woken.done():
            self._again = True
            return
        self._woken = asyncio.ensure_future(self.finalize_tick())
        self._woken.add_done_callback(self._woken_done)

    def _woken_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            asyncio.ensure_future(self.app.crash(task.exception()))

    async def finalize_tick(self) -> None:
        """Score, store, publish and mark every due session, a chunk at a time.

        Run by the timer every ``timer_interval_s`` and woken by the agent when a batch brings
        sessions already due; one run at a time (a call during a run makes that run look
        again when it is done). A chunk is at most ``finalize_batch_max`` sessions; between
        chunks the event loop runs the agent (and everything else), so a backlog neither
        waits for the next tick nor holds the loop for long.
        """
        if self._finalizing:
            self._again = True
            return
        self._finalizing = True
        try:
            self._again = True
            while self._again:
                self._again = False
                if not await self._finalize_due():
                    break  # Postgres is down: the next tick retries, not every batch that arrives
        finally:
            self._finalizing = False

    async def _finalize_due(self) -> bool:
        """One pass over the due sessions; False when Postgres could not be written."""
        if not self.ready():
            return True
        owned = self.owned()
        rebalance = self.app.rebalancing_count
        while True:
            due = self.pick_due(time.time(), owned)
            if not due:
                break
            try:
                await self.finalize(due, owned)
            except (OperationalError, psycopg.OperationalError) as err:
                # Postgres unreachable: nothing was marked, so these sessions stay due for the next tick.
                metrics.STORE_ERRORS.inc()
                log.warning("could not store %d rewards, retrying next tick: %s", len(due), err)
                return False
            await asyncio.sleep(0)
            if not self.ready() or self.app.rebalancing_count != rebalance or self.owned() != owned:
                break
        now = time.time()
        if now >= self._next_evict:
            self._next_evict = now + EVICT_EVERY_S
            await self.evict(now, owned)
            await self.table.wait_written()
        await self.marks.wait_written()  # a lost mark only means a re-score, which the store finds covered
        return True

    async def finalize(self, due: list[Due], owned: set[int]) -> None:
        """Score ``due`` sessions and record the results."""
        rebalance = self.app.rebalancing_count
        t0 = time.perf_counter()
        if self.scorer.calls_out:
            scored = await asyncio.gather(*(self.scorer.score(d.state.view(self.cache)) for d in due))
        else:  # nothing to wait for: no task per session
            scored = [self.scorer.score_local(d.state.view(self.cache)) for d in due]
        t1 = time.perf_counter()
        batch = [(s, d.state.reason()) for s, d in zip(scored, due)]
        results = await asyncio.to_thread(self.store.write, batch, "stream")
        committed = time.time()
        t2 = time.perf_counter()
        published = await self.publish(scored, results, [d.state.published_version for d in due])
        t3 = time.perf_counter()
        still_owned = self.app.rebalancing_count == rebalance and self.owned() == owned
        for d, s, result, sent in zip(due, scored, results, published):
            self.count(s, result, committed - d.due_at)
            if still_owned:
                self.mark(d, result, sent)
        stages = {"score": t1 - t0, "store": t2 - t1, "publish": t3 - t2, "mark": time.perf_counter() - t3}
        for stage, seconds in stages.items():
            metrics.STAGE_SECONDS.labels(stage).inc(seconds)

    async def publish(
        self, scored: list[ScoredSession], results: list[StoreResult], sent_before: list[int]
    ) -> list[bool]:
        """Publish every version written now (or stored identically, and not yet sent), with its samples."""
        sent: list[bool] = []
        now = datetime.now(UTC)
        for s, result, before in zip(scored, results, sent_before):
            unsent = result.version is not None and before < result.version
            fresh = result.written or (result.identical and unsent)
            if not (self.conf.publish_scored and fresh and result.version and result.reward_id):
                sent.append(False)
                continue
            record = scored_record(s, result.reward_id, result.version, result.reason, now)
            await self.app.producer.send(
                self.topics.scored, s.session_id.encode(), record.model_dump_json().encode(), None, None, None
            )
            metrics.PUBLISHED.inc()
            sent.append(True)
        return sent

    def count(self, scored: ScoredSession, result: StoreResult, lag_s: float) -> None:
        """Metrics of one scored session."""
        metrics.SESSIONS.labels(result.decision, result.reason or "").inc()
        for name, component in scored.components.items():
            if name != "_meta" and component.get("failures"):
                metrics.EXTRACTOR_FAILURES.labels(name).inc(len(component["failures"]))
        if result.written:
            metrics.SAMPLES.inc(len(scored.samples))
            metrics.FINALIZE_LAG.observe(max(0.0, lag_s))
            for reason, n in scored.skipped.items():
                metrics.SAMPLES_SKIPPED.labels(reason).inc(n)
        if result.decision == "diverged":
            log.warning(
                "session %s/%s: its state no longer holds every event of stored version %s; "
                "run `flywheel rewards recompute` for it",
                *result.key,
                result.version,
            )

    def mark(self, due: Due, result: StoreResult, published: bool) -> None:
        """Record in the table that the events scored now are covered by a stored version."""
        key, project = due.slot
        state = self.load_state(key, project)
        if state is None:
            return
        state.mark_scored(due.n_events, result.version or 0, published, self.windows)
        self.marks[key] = {**(self.stored(self.marks, key) or {}), project: state.marks()}
        if state.due_at is None:
            self.due_index.pop(due.slot, None)
            self.cache.drop(state.events)
        else:
            self.due_index[due.slot] = state.due_at

    async def evict(self, now: float, owned: set[int]) -> int:
        """Drop every scored state whose last event is older than the retention; how many.

        One pass over the whole table, in chunks of ``finalize_batch_max`` keys with the event
        loop run between them (each key is read again when its turn comes, so a session that
        took an event meanwhile is kept). A pass used to stop after ``finalize_batch_max``
        states every ``EVICT_EVERY_S``: ~17 states/s, fewer than a busy worker creates, so the
        table grew without bound (found by the soak).
        """
        horizon = now - self.conf.state_retention_s
        dropped = 0
        for i, key in enumerate(list(self.table.keys())):
            if i and i % self.conf.finalize_batch_max == 0:
                await asyncio.sleep(0)
                if not self.ready() or self.owned() != owned:
                    break
            bucket = self.stored(self.table, key)
            if not bucket or partition_of(key, self.topics.partitions) not in owned:
                continue
            stale = [p for p in bucket if self._expired(key, p, bucket, horizon)]
            if not stale:
                continue
            kept = {p: d for p, d in bucket.items() if p not in stale}
            marks = {p: m for p, m in (self.stored(self.marks, key) or {}).items() if p not in stale}
            if kept:
                self.table[key] = kept
                self.marks[key] = marks
            else:
                del self.table[key]
                if key in self.marks:
                    del self.marks[key]
            dropped += len(stale)
            metrics.EVICTED.inc(len(stale))
        metrics.OPEN_SESSIONS.set(len(self.table))
        return dropped

    def _expired(self, key: bytes, project: str, bucket: dict[str, Any], horizon: float) -> bool:
        state = self.load_state(key, project, bucket)
        return state is not None and state.pending_since is None and state.last_arrival < horizon

    async def watchdog(self) -> None:
        """Exit (code :data:`WATCHDOG_EXIT`) when the worker has been rebalancing, not recovering,
        for ``rebalance_watchdog_s``: a wedged rebalance never ends by itself, a restart ends it.

        Safe at any moment: nothing is committed before it is written (see the module doc),
        so a restarted worker re-reads what was in flight and the store finds it covered.
        """
        if stuck_for := self.rebalance_stuck_for(time.monotonic()):
            log.critical("rebalancing for %.0f s without recovering a table: exiting for a restart", stuck_for)
            logging.shutdown()
            os._exit(WATCHDOG_EXIT)

    def rebalance_stuck_for(self, now: float) -> float | None:
        """Seconds the worker has been rebalancing (not in recovery) once past the watchdog's limit, else None."""
        if not self.app.rebalancing or self.app.in_recovery:
            self._rebalancing_since = None
            return None
        if self._rebalancing_since is None:
            self._rebalancing_since = now
        stuck = now - self._rebalancing_since
        return stuck if stuck >= self.conf.rebalance_watchdog_s else None

    async def refresh_detectors(self) -> None:
        """The timer that refreshes the detector gauges from Postgres."""
        since = datetime.now(UTC) - timedelta(seconds=self.conf.detectors.window_s)
        report = await asyncio.to_thread(detector_report, self.db_url, since, self.conf.detectors)
        metrics.publish_report(report)
