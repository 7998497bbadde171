"""PII redaction: the SDK's sender applies it before an event is serialized (nothing unredacted
leaves the product's process), and the router's capture to what it records.

:class:`Redactor` is the default: e-mail addresses, API keys and tokens (OpenAI/Anthropic
``sk-``, GitHub, Slack, AWS, Google, Flywheel keys, JWTs, ``Bearer`` headers,
``password=...``-style assignments, PEM private keys) and credit-card-like numbers (13 to
19 digits that pass the Luhn check). A product adds its own with any ``str -> str``
callable (``Flywheel(redactor=...)``); it runs after the default one.

Only free text is redacted (message and tool contents, tool arguments, completion and
prompt text, summaries, feedback text, errors, span assignments and results, string
values of metadata and details); ids and names are left as they are.

Token ids encode text, and neither the SDK nor the router has the tokenizer to re-encode redacted text, so a
completion whose text redaction changed loses the token data of that text
(:func:`redact_completion`): ``completion_token_ids`` and ``logprobs`` when its completion
text or a tool call changed, ``prompt_token_ids`` when its prompt text or a prompt message
changed. Otherwise a redacted e-mail or key would still be in the training data, one
decode away. Such a completion is not trained on (the sample builder skips a completion
without token ids).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

RedactFn = Callable[[str], str]
"""A redactor: text in, redacted text out."""

_MISSING = object()

TEXT_KEYS = frozenset(
    {
        "content",
        "arguments",
        "prompt_text",
        "completion_text",
        "summary",
        "text",
        "error",
        "assignment",
        "result",
        "comment",
    }
)
"""Keys whose string values are free text, at any depth of an event's fields."""
FLAT_KEYS = frozenset({"metadata", "details"})
"""Keys holding flat dicts whose string values are all free text."""
NUMBER_LIST_KEYS = frozenset({"prompt_token_ids", "completion_token_ids", "logprobs"})
"""Keys holding lists of numbers, which the walk skips without looking at their items."""
COMPLETION_SIDE_KEYS = ("completion_text", "tool_calls")
"""A completion's generated text: its token data is ``COMPLETION_TOKEN_KEYS``."""
COMPLETION_TOKEN_KEYS = ("completion_token_ids", "logprobs")
"""Token data of the generated text, dropped when redaction changes any of ``COMPLETION_SIDE_KEYS``."""
PROMPT_SIDE_KEYS = ("prompt_text", "prompt_messages")
"""A completion's prompt: its token data is ``PROMPT_TOKEN_KEYS``."""
PROMPT_TOKEN_KEYS = ("prompt_token_ids",)
"""Token data of the prompt, dropped when redaction changes any of ``PROMPT_SIDE_KEYS``."""

_PATTERNS: list[tuple[str, str]] = [
    ("PRIVATE_KEY", r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"),
    ("JWT", r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("BEARER", r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=-]{12,}"),
    (
        "API_KEY",
        r"\b(?:sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
        r"|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35}|fw[kop]_[A-Za-z0-9_-]{24,})",
    ),
    (
        "SECRET",
        r"\b(?i:api[_-]?key|secret|token|passw(?:or)?d|pwd|access[_-]?key)\b[\"']?\s*[:=]\s*[\"']?[^\s\"',;]{6,}",
    ),
    ("EMAIL", r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    # "a digit not preceded by a digit or '-'", written digit-first so the engine can skip to digits
    ("CARD", r"\d(?<![\d-]\d)(?:[ -]?\d){12,18}(?![\d-])"),
]


_BIT = {label: 1 << i for i, (label, _) in enumerate(_PATTERNS)}
_DIGITS = tuple("0123456789")
_SECRET_WORDS = ("api", "secret", "token", "passw", "pwd", "access")


def _possible_patterns(text: str) -> int:
    """Bit mask (:data:`_BIT`) of the built-in patterns that may match somewhere in ``text``.

    Each test is a necessary condition of its pattern, made of C-speed substring searches
    (single characters first: ``memchr``): an e-mail needs an ``@``, a card number a digit,
    a PEM key ``-----BEGIN``, ... Case-insensitive words are looked for in the lower-cased
    text only when the text is ASCII, where lower-casing is exactly the regex's
    case-insensitive matching; in other text those patterns (and ``\\d``, which also matches
    non-ASCII digits) are simply kept.
    """
    ascii_text = text.isascii()
    lowered = text.lower() if ascii_text and ("=" in text or ":" in text or "b" in text or "B" in text) else None
    mask = 0
    if "-" in text and "-----BEGIN" in text:
        mask |= _BIT["PRIVATE_KEY"]
    if "J" in text and "eyJ" in text:
        mask |= _BIT["JWT"]
    if not ascii_text or (lowered is not None and "bearer" in lowered):
        mask |= _BIT["BEARER"]
    if (
        ("-" in text and ("sk-" in text or "xox" in text))
        or ("_" in text and ("gh" in text or "fwk_" in text or "fwo_" in text or "fwp_" in text))
        or ("A" in text and ("AKIA" in text or "AIza" in text))
    ):
        mask |= _BIT["API_KEY"]
    if "=" in text or ":" in text:
        if lowered is None or any(word in lowered for word in _SECRET_WORDS):
            mask |= _BIT["SECRET"]
    if "@" in text:
        mask |= _BIT["EMAIL"]
    if not ascii_text or any(digit in text for digit in _DIGITS):
        mask |= _BIT["CARD"]
    return mask


def luhn_ok(digits: str) -> bool:
    """Whether a digit string passes the Luhn checksum (as payment card numbers do)."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if position % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


class Redactor:
    """The default redactor; ``extra`` adds ``(label, regex)`` patterns of the product's own.

    One pass of one alternation regex replaces every match. Before it runs, cheap substring
    tests (:func:`_possible_patterns`) drop the built-in patterns that cannot match anywhere in the text
    (an e-mail needs an ``@``, a card number a digit, ...); the regex of the patterns left is
    compiled once per combination and cached. Dropping an alternative that matches nowhere
    does not change what the alternation finds, so the result is the same as running all of
    them: plain prose costs a few substring searches instead of a regex scan per pattern.
    The product's ``extra`` patterns always run.
    """

    def __init__(self, extra: Iterable[tuple[str, str]] = ()):
        patterns = [*_PATTERNS, *extra]
        self._labels = [label for label, _ in patterns]
        self._sources = [f"(?P<g{i}>{regex})" for i, (_, regex) in enumerate(patterns)]
        self._regex = re.compile("|".join(self._sources))
        self._always = sum(1 << i for i in range(len(_PATTERNS), len(patterns)))
        self._all = (1 << len(patterns)) - 1
        self._by_mask: dict[int, re.Pattern[str] | None] = {self._all: self._regex, 0: None}

    def __call__(self, text: str) -> str:
        """``text`` with every match replaced by ``[REDACTED_<LABEL>]``."""
        if not text:
            return text
        regex = self._regex_for(_possible_patterns(text) | self._always)
        if regex is None:
            return text
        return regex.sub(self._replace, text)

    def _regex_for(self, mask: int) -> re.Pattern[str] | None:
        regex = self._by_mask.get(mask, _MISSING)
        if regex is _MISSING:
            sources = [source for i, source in enumerate(self._sources) if mask >> i & 1]
            regex = re.compile("|".join(sources))
            self._by_mask[mask] = regex
        return regex  # type: ignore[return-value]

    def _replace(self, match: re.Match[str]) -> str:
        group = match.lastgroup or "g0"
        label = self._labels[int(group[1:])]
        found = match.group(0)
        if label == "CARD" and not luhn_ok("".join(c for c in found if c.isdigit())):
            return found
        if label == "SECRET":
            name = re.match(r"(?i)[\"']?[A-Za-z_-]+[\"']?\s*[:=]\s*[\"']?", found)
            return f"{name.group(0) if name else ''}[REDACTED_SECRET]"
        return f"[REDACTED_{label}]"


def chain(*redactors: RedactFn | None) -> RedactFn | None:
    """One redactor that applies the given ones in order (``None`` entries skipped; ``None`` if none)."""
    active = [r for r in redactors if r is not None]
    if not active:
        return None
    if len(active) == 1:
        return active[0]

    def chained(text: str) -> str:
        for redactor in active:
            text = redactor(text)
        return text

    return chained


def redact_fields(fields: dict[str, Any], redactor: RedactFn) -> None:
    """Redact, in place, the free-text values of an event's fields (nested dicts and lists included)."""
    for key, value in fields.items():
        if isinstance(value, str):
            if key in TEXT_KEYS:
                fields[key] = redactor(value)
        elif isinstance(value, dict):
            if key in FLAT_KEYS:
                for inner, item in value.items():
                    if isinstance(item, str):
                        value[inner] = redactor(item)
            else:
                redact_fields(value, redactor)
        elif isinstance(value, list):
            if key in NUMBER_LIST_KEYS:  # thousands of token ids or logprobs: nothing to redact
                continue
            for item in value:
                if isinstance(item, dict):
                    redact_fields(item, redactor)


def _strings(value: Any, out: list[str]) -> list[str]:
    """Every string in ``value`` (nested dicts and lists included), in order, appended to ``out``."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _strings(item, out)
    elif isinstance(value, list | tuple):
        for item in value:
            _strings(item, out)
    return out


def _texts(fields: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for key in keys:
        out.append(key)  # a separator, so text moving between keys is a change too
        _strings(fields.get(key), out)
    return out


def _drop(fields: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Remove ``keys`` from ``fields``; whether any of them held data."""
    held = False
    for key in keys:
        held |= fields.pop(key, None) is not None
    return held


def redact_completion(fields: dict[str, Any], redactor: RedactFn) -> bool:
    """Redact a completion's fields in place, dropping the token data of every text redaction changed.

    Token ids cannot be redacted without the model's tokenizer, so: when the completion text or
    a tool call changed, ``completion_token_ids`` and ``logprobs`` are removed; when the prompt
    text or a prompt message changed, ``prompt_token_ids`` is. A redactor that changes nothing
    (equal strings out) keeps everything. Returns whether any token data was removed.
    """
    completion_before = _texts(fields, COMPLETION_SIDE_KEYS)
    prompt_before = _texts(fields, PROMPT_SIDE_KEYS)
    redact_fields(fields, redactor)
    dropped = False
    if _texts(fields, COMPLETION_SIDE_KEYS) != completion_before:
        dropped |= _drop(fields, COMPLETION_TOKEN_KEYS)
    if _texts(fields, PROMPT_SIDE_KEYS) != prompt_before:
        dropped |= _drop(fields, PROMPT_TOKEN_KEYS)
    return dropped
