"""Typed errors shared by every client and service.

Two families, never mixed up:

- ``RemoteError`` and subclasses: *per item*. One request (a generate call, an env step, a reward
  call) failed; the peer is alive and keeps serving. The caller fails that trajectory only.
- ``PeerDeadError``: *fatal*. The peer process is gone or stopped answering heartbeats; every
  pending and future call to it fails with this error until it is replaced.

Neither is ever turned into a reward of 0 by rollart code.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` (difflib, cutoff 0.6), or "":
    the tail of an error naming an unknown value."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class RollartError(Exception):
    """Base class of every error rollart raises on purpose."""


class ConfigError(RollartError, ValueError):
    """A configuration value is invalid. The message names the file (if any), field and reason.

    Attributes:
        reasons: the independent reasons the message joins (one per refused item, e.g. per
            domain), for a caller that lists them one per line; ``[message]`` when one.
    """

    def __init__(self, message: str = "", *, reasons: list[str] | None = None) -> None:
        super().__init__(message if reasons is None else "; ".join(reasons))
        self.reasons = list(reasons) if reasons else [str(self)]


class RemoteError(RollartError):
    """A remote call failed for this item only; the peer keeps serving.

    Attributes:
        code: machine-readable error code (see ``rollart.transport.messages.ErrorCode``).
        message: human-readable reason naming what was wrong.
        fault: ``"transient"`` (the peer is healthy: retry later), ``"fatal"`` (the peer's
            own fault) or ``""`` (not classified); ``rollart.transport.messages.FAULTS``.
    """

    #: set by the LLM proxy on a generate timeout: it happened under overload (the worker
    #: answered other calls meanwhile, or no worker answered anything), not a worker fault
    overload: bool = False

    def __init__(self, code: str, message: str, *, fault: str = "") -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.fault = fault


class RemoteTimeoutError(RemoteError):
    """No reply arrived within the call's ``timeout_s``; the peer may still be alive."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class PeerDeadError(RollartError):
    """Fatal: the peer process is dead or unresponsive (missed heartbeats, process exit)."""


class EnvError(RemoteError):
    """An environment raised, timed out or was misused; fails that env session only."""


class RewardError(RollartError):
    """A reward call failed (HTTP error, timeout, invalid reward). Fails that trajectory only.

    Attributes:
        status: HTTP status when a response arrived, else ``None`` (timeout / connection error).
        reason: what went wrong, naming the function and cause.
    """

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason if status is None else f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


class RewardTooLargeError(RewardError):
    """A reward reply, or its ``details``, exceeded the client's size limit (not retried: the
    same call would return the same). Fails that trajectory with reason ``reward_too_large``."""


class InvalidActionError(RollartError):
    """Raised by an env's ``step`` when the model's action is malformed (e.g. broken tool-call
    JSON): a *model-caused* outcome, not an env failure. The trajectory is not re-drawn: per its
    domain's ``invalid_action`` policy the model sees ``message`` as the next observation, or
    the trajectory ends with the domain's penalty reward, and it is trained on.

    Attributes:
        message: what is wrong with the action, shown to the model (``"observe"`` policy).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
