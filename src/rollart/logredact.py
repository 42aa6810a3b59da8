"""Secrets never reach a log line: every log record is redacted as it is made.

The controller hands each agent trajectory a base URL whose path is its secret
(``/t/<token>/v1``), and HTTP clients in the same process log the URLs they call (``httpx``
at INFO, ``openai`` and ``httpcore`` at DEBUG); bearer tokens and keys can reach a message or a
traceback the same way. :func:`install` (run on ``import rollart``, so in every rollart process
and driver script) wraps the logging module's record factory: a record whose message, traceback
or stack text holds a secret shape has it replaced by ``<redacted>`` before any handler, filter
or formatter sees it, at every level and whichever library logged it. Records with nothing to
redact are left as they were (message template and args intact).

Shapes (:data:`PATTERNS`): an agent URL's ``/t/<token>``, ``Bearer <token>``, an
``Authorization`` header's value, ``token`` / ``api_key`` / ``key`` / ``secret`` / ``password``
assignments (``name=value``, ``name: value``, JSON ``"name": "value"``), and exact values
registered with :func:`add_secret` (e.g. a run's reward token).

Cost: the message is formatted once more per record that is emitted (records below a logger's
level are never made); tracebacks are rendered at most once per record, as a formatter would.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any

REDACTED = "<redacted>"

#: (pattern, replacement) applied in order; group 1 is the part kept before the secret
PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # The agent endpoint's per-trajectory path (rollart.controller.agents.server).
    (re.compile(r"(/t/)[A-Za-z0-9_\-]{8,}"), rf"\1{REDACTED}"),
    (re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/=\-]{8,}", re.IGNORECASE), rf"\1{REDACTED}"),
    (re.compile(r"""(\bAuthorization['"]?\s*[:=]\s*['"]?)[^'"\s,}]+(?:\s+[^'"\s,}]+)?""",
                re.IGNORECASE), rf"\1{REDACTED}"),
    # a name may carry a prefix (OPENAI_API_KEY, access_token, REWARD_TOKEN)
    (re.compile(r"""((?<![A-Za-z0-9])(?:[A-Za-z0-9]*[_-])*"""
                r"""(?:api[_-]?key|key|token|secret|password|passwd)['"]?\s*[:=]\s*"""
                r"""['"]?)[^'"\s&,;}]{4,}""", re.IGNORECASE), rf"\1{REDACTED}"),
)

#: a message holding none of these (lower-cased) cannot match PATTERNS: skip the regexes
_TRIGGERS = ("/t/", "bearer", "authorization", "key", "token", "secret", "passw")

_secrets: set[str] = set()
_MAX_SECRETS = 1024  # bounded: a few per run (tokens minted per trajectory use PATTERNS)
_lock = threading.Lock()
_installed = False


def add_secret(value: str) -> None:
    """Redact this exact string (at least 8 characters) from every later log record."""
    if len(value) >= 8:
        with _lock:
            if len(_secrets) < _MAX_SECRETS:
                _secrets.add(value)


def redact(text: str) -> str:
    """``text`` with every secret shape (see the module docstring) replaced by
    ``<redacted>``."""
    low = text.lower()
    if any(t in low for t in _TRIGGERS):
        for pattern, repl in PATTERNS:
            text = pattern.sub(repl, text)
    for value in tuple(_secrets):
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """Redact ``record`` in place (message, traceback and stack text); returns it."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a broken %-format: logging reports it when emitting
        return record
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        clean = redact(text)
        if clean != text:
            record.exc_text = clean  # formatters use it instead of rendering exc_info
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


def install() -> None:
    """Make every log record of this process pass through :func:`redact_record` when it is
    created (idempotent; wraps any record factory set before)."""
    global _installed
    with _lock:
        if _installed:
            return
        previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return redact_record(previous(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _installed = True
