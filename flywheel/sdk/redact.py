"""PII redaction for the SDK: :mod:`flywheel.core.redact`, where the router's capture finds it too."""

from __future__ import annotations

from flywheel.core.redact import _PATTERNS, RedactFn, Redactor, chain, luhn_ok, redact_completion, redact_fields

__all__ = ["_PATTERNS", "RedactFn", "Redactor", "chain", "luhn_ok", "redact_completion", "redact_fields"]
