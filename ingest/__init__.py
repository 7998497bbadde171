"""Ingest: Kafka topics, the HTTP gateway and the Kafka → Postgres consumer.

Entry point: ``flywheel-ingest`` (:mod:`ingest.main`); see ``docs/ingest.md``.
"""
