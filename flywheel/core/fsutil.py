"""Durable file writes: fsync helpers for the write-to-temp-then-rename pattern."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """fsync a directory entry, so that a rename inside it is durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` and every folder, ``folder`` included."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    for path in [p for p in folder.rglob("*") if p.is_dir()] + [folder]:
        fsync_dir(path)
