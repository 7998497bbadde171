"""Entry point of ``flywheel-ingest`` (``python -m ingest.main``)."""

from __future__ import annotations

from flywheel.core.entrypoint import run
from ingest.cli import app

__all__ = ["app", "main"]


def main() -> None:
    """Run the ``flywheel-ingest`` command line."""
    run(app)


if __name__ == "__main__":
    main()
