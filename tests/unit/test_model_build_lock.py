"""Concurrent builds of one base model: the second builder waits for the first instead of building too."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from flywheel.model.build import _build_lock


def test_a_second_builder_of_the_same_key_waits_and_another_key_does_not(tmp_path: Path) -> None:
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with _build_lock(tmp_path, "k1"):
            held.set()
            time.sleep(0.5)
            order.append("first done")

    def second(key: str) -> None:
        held.wait(5)
        with _build_lock(tmp_path, key):
            order.append(f"{key} entered")

    threads = [threading.Thread(target=first), threading.Thread(target=second, args=("k2",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["k2 entered", "first done"]  # another key is not held up

    order.clear()
    held.clear()
    threads = [threading.Thread(target=first), threading.Thread(target=second, args=("k1",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["first done", "k1 entered"]
