"""The disk spool: an append-only, bounded FIFO of serialized events.

While the transport cannot send (broker down, gateway unreachable) or the sender is
behind, the sender appends events here; when the transport is back it replays them,
oldest first, before anything logged later. Nothing but the sender thread touches it.

Layout: ``<root>/lane-<n>/<seq>.spool``. Each Flywheel client claims one *lane* (a
folder it holds an exclusive ``flock`` on), so several processes can share a spool root;
a lane left behind by a process that died is claimed, and replayed, by the next one.
A segment holds records ``[key length][value length][crc32][key][value]`` (big-endian
u32 each); the sender appends to the newest segment, replays from the oldest, and
deletes a segment only once every record in it was acknowledged, so a crash during
replay sends some events twice (harmless: ids dedupe downstream) but loses none. A
torn record at the end of a segment (a crash mid-write) is detected by length or CRC
and skipped with a warning.

Durability: every append is written to the OS (survives a crash of the process); the
active segment is fsynced at most every ``fsync_interval_s`` and on rotation, flush and
close (a crash of the machine loses at most that interval).
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from flywheel.sdk.transports.base import Envelope

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: lanes are not locked
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("flywheel.sdk")

HEADER = struct.Struct(">III")
"""Record header: key length, value length, CRC32 of key + value."""
SUFFIX = ".spool"
MAX_LANES = 256
MAX_SEGMENT_BYTES = 16 * 1024 * 1024
MIN_SEGMENT_BYTES = 64 * 1024


class SpoolUnavailable(OSError):
    """No lane of the spool folder could be claimed or created."""


def record_size(envelope: Envelope) -> int:
    """Bytes one envelope takes in a segment."""
    return HEADER.size + len(envelope.key) + len(envelope.value)


def encode(envelope: Envelope) -> bytes:
    """One record as it is written to a segment."""
    key, value = envelope
    return HEADER.pack(len(key), len(value), zlib.crc32(value, zlib.crc32(key))) + key + value


def decode_segment(data: bytes) -> tuple[list[Envelope], int]:
    """The records of a segment's bytes, and how many trailing bytes were unreadable (torn or corrupt)."""
    records: list[Envelope] = []
    pos, end = 0, len(data)
    while pos + HEADER.size <= end:
        key_len, value_len, crc = HEADER.unpack_from(data, pos)
        start = pos + HEADER.size
        stop = start + key_len + value_len
        if stop > end:
            break
        key, value = data[start : start + key_len], data[start + key_len : stop]
        if zlib.crc32(value, zlib.crc32(key)) != crc:
            break
        records.append(Envelope(key, value))
        pos = stop
    return records, end - pos


class Spool:
    """A bounded FIFO of envelopes on disk, in one claimed lane under ``root``."""

    def __init__(
        self,
        root: Path | str,
        max_bytes: int,
        *,
        segment_bytes: int | None = None,
        fsync_interval_s: float = 1.0,
    ):
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, max_bytes // 16))
        self.fsync_interval_s = fsync_interval_s
        self.lane, self._lock = claim_lane(Path(root))
        self._closed: deque[tuple[Path, int]] = deque(_existing_segments(self.lane))
        self._bytes = sum(size for _, size in self._closed)
        self._next_seq = _seq(self._closed[-1][0]) + 1 if self._closed else 0
        self._active: IO[bytes] | None = None
        self._active_path: Path | None = None
        self._active_size = 0
        self._last_fsync = time.monotonic()
        self._reading: list[Envelope] = []
        self._read_pos = 0
        if self._bytes:
            log.info(
                "flywheel spool: %d bytes left in %s by an earlier process; replaying them first",
                self._bytes,
                self.lane,
            )

    # -- state ------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        """Bytes on disk (what counts against ``max_bytes``)."""
        return self._bytes

    @property
    def empty(self) -> bool:
        """Nothing is waiting to be replayed."""
        return self._bytes == 0

    # -- writing ----------------------------------------------------------------------------

    def append(self, envelopes: Sequence[Envelope]) -> int:
        """Append envelopes in order, as many as fit under ``max_bytes``; returns how many were stored.

        Stops at the first one that does not fit, so what is stored stays a contiguous,
        ordered run; the caller counts (and reports) the rest as dropped. If the disk
        refuses a write after some were stored, returns how many were; raises ``OSError``
        if it refuses the first.
        """
        chunks: list[bytes] = []
        room = self.max_bytes - self._bytes
        for envelope in envelopes:
            size = record_size(envelope)
            if size > room:
                break
            chunks.append(encode(envelope))
            room -= size
        stored = 0
        try:
            while stored < len(chunks):
                stored += self._write(chunks[stored:])
        except OSError as err:
            if not stored:
                raise
            log.error("flywheel spool: write to %s failed after %d records: %s", self.lane, stored, err)
            return stored
        self._maybe_fsync()
        return stored

    def _write(self, chunks: list[bytes]) -> int:
        """Write as many chunks as fit in the active segment (at least one); returns how many."""
        if self._active is None or self._active_size >= self.segment_bytes:
            self._rotate()
        assert self._active is not None
        room = max(self.segment_bytes - self._active_size, 1)
        taken, size = 0, 0
        for chunk in chunks:
            if taken and size + len(chunk) > room:
                break
            taken += 1
            size += len(chunk)
        self._active.write(b"".join(chunks[:taken]))
        self._active.flush()
        self._active_size += size
        self._bytes += size
        return taken

    def _rotate(self) -> None:
        """Close the active segment (it becomes replayable) and open a new one lazily."""
        self._close_active()
        path = self.lane / f"{self._next_seq:016d}{SUFFIX}"
        self._next_seq += 1
        self._active = open(path, "ab")
        self._active_path = path
        self._active_size = 0

    def _close_active(self) -> None:
        if self._active is None:
            return
        self._active.flush()
        os.fsync(self._active.fileno())
        self._active.close()
        assert self._active_path is not None
        if self._active_size:
            self._closed.append((self._active_path, self._active_size))
        else:
            self._active_path.unlink(missing_ok=True)
        self._active = None
        self._active_path = None
        self._active_size = 0

    def _maybe_fsync(self) -> None:
        if self._active is not None and time.monotonic() - self._last_fsync >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        """fsync the active segment now."""
        if self._active is not None:
            self._active.flush()
            os.fsync(self._active.fileno())
        self._last_fsync = time.monotonic()

    # -- replaying --------------------------------------------------------------------------

    def peek(self, limit: int) -> list[Envelope]:
        """Up to ``limit`` of the oldest envelopes not yet acknowledged (they stay until :meth:`ack`)."""
        while self._read_pos >= len(self._reading):
            if not self._load_oldest():
                return []
        return self._reading[self._read_pos : self._read_pos + limit]

    def ack(self, count: int) -> None:
        """The first ``count`` envelopes that :meth:`peek` returned were delivered (or rejected for good)."""
        self._read_pos += count
        if self._reading and self._read_pos >= len(self._reading):
            path, size = self._closed.popleft()
            path.unlink(missing_ok=True)
            self._bytes -= size
            self._reading, self._read_pos = [], 0

    def _load_oldest(self) -> bool:
        """Read the oldest closed segment into memory (rotating the active one if it is the only one)."""
        if not self._closed:
            if not self._active_size:
                return False
            self._close_active()
        while self._closed:
            path, size = self._closed[0]
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = b""
            records, torn = decode_segment(data)
            if torn:
                log.warning("flywheel spool: %d unreadable bytes at the end of %s (torn write?) skipped", torn, path)
            if records:
                self._reading, self._read_pos = records, 0
                return True
            self._closed.popleft()
            path.unlink(missing_ok=True)
            self._bytes -= size
        return False

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """fsync and close the active segment, and release the lane."""
        self._close_active()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def claim_lane(root: Path) -> tuple[Path, IO[str] | None]:
    """The first lane folder under ``root`` that no live process holds, and its lock file (kept open)."""
    root.mkdir(parents=True, exist_ok=True)
    for index in range(MAX_LANES):
        lane = root / f"lane-{index}"
        lane.mkdir(exist_ok=True)
        lock = open(lane / ".lock", "a+")
        if fcntl is None:
            return lane, lock
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return lane, lock
    raise SpoolUnavailable(f"all {MAX_LANES} spool lanes under {root} are held by live processes")


def _existing_segments(lane: Path) -> list[tuple[Path, int]]:
    paths = sorted(p for p in lane.iterdir() if p.suffix == SUFFIX and p.stem.isdigit())
    return [(p, p.stat().st_size) for p in paths]


def _seq(path: Path) -> int:
    return int(path.stem)
