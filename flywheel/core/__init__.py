"""The core: what every other layer stands on.

Settings (:mod:`flywheel.core.settings`), the typed contracts of everything that crosses a
process boundary (:mod:`flywheel.core.contracts`), the database models and engine
(:mod:`flywheel.core.db`), write-key auth, endpoint resolution from settings alone and a few
file-system and Kafka helpers. The core imports no role (ingest, rewarding, trainer,
serving), no SDK and no development tooling; see docs/architecture.md.
"""
