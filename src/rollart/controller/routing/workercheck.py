"""Checks of inference workers' output where it enters the controller, and the per-worker
record of violations that decides when a worker is quarantined.

A ``GenerateResult`` that decoded (``GenerateResult.__post_init__`` already refused ragged
lengths and NaN / infinite / positive logprobs on the wire) can still be wrong in ways only the
caller can see: a ``"stop"`` or ``"length"`` turn with no token, more tokens than
``max_tokens``, token ids outside the model's vocabulary, versions outside what was ever
published or going backwards within a turn, an unknown finish reason. In-process backends
(simulated workers, fakes) skip the wire decode, so :func:`check_generate_result` repeats those
checks too. A violation is a per-trajectory failure (``InvalidWorkerOutput``, reason
``invalid_worker_output``), never a reward of 0.

:class:`ViolationWindow` counts violations among each worker's last ``window`` replies; once
one worker reaches ``max_violations`` the proxy takes it out of its pool.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError

#: ``RemoteError.code`` of a reply that failed these checks, or failed to decode at all
BAD_REPLY = "bad_reply"
#: ``RemoteError.code`` of a request the worker's engine failed (not one it refused as bad
#: input: that is ``bad_request``); counted towards quarantine like a bad reply
ENGINE_ERROR = "engine_error"
#: the ``TrajectoryFailed.reason`` / buffer failure reason of such a turn
INVALID_OUTPUT_REASON = "invalid_worker_output"
_FINISH = ("stop", "length", "abort")
_NEG_INF = float("-inf")


class InvalidWorkerOutput(RemoteError):
    """A worker's reply broke the ``GenerateResult`` contract: this turn (and its trajectory)
    fails; the worker is counted towards quarantine. ``worker``: its name."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(BAD_REPLY, f"{worker}: {message}")
        self.worker = worker


def check_generate_result(
    result: m.GenerateResult,
    *,
    max_tokens: int,
    min_version: int,
    max_version: int,
    vocab_size: int | None = None,
) -> str | None:
    """The first way ``result`` breaks the contract, or ``None`` if it keeps it.

    Args:
        result: one worker reply to a ``Generate`` with ``sampling.max_tokens == max_tokens``.
        min_version, max_version: inclusive bounds of a generated token's policy version
            (the version every worker served when the request was sent; the newest version
            any worker was asked to apply).
        vocab_size: token ids must be below it (``None``: only ``>= 0`` is checked).

    Vectorised (numpy views of the reply's bytes, no copy).
    """
    rid = result.request_id
    if result.finish_reason not in _FINISH:
        return f"request {rid!r}: unknown finish_reason {result.finish_reason!r}"
    nt, nl, nv = len(result.token_ids), len(result.logprobs), len(result.versions)
    if nt % 4 or nl != nt or nv != nt:
        return (f"request {rid!r}: {nt} bytes of token_ids, {nl} of logprobs, {nv} of "
                "versions (4 per token each)")
    n = nt // 4
    if n == 0:
        if result.finish_reason != "abort":
            return f"request {rid!r}: finish_reason {result.finish_reason!r} with no token"
        return None
    if n > max_tokens:
        return f"request {rid!r}: {n} tokens for max_tokens {max_tokens}"
    if nt <= tb.SMALL_BYTES:
        return _check_small(result, rid, min_version, max_version, vocab_size)
    ids = np.frombuffer(result.token_ids, dtype="<i4")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        return f"request {rid!r}: token id {bad} outside the vocabulary [0, {vocab_size})"
    lps = np.frombuffer(result.logprobs, dtype="<f4")
    if not (lps.max() <= 0.0 and lps.min() > -np.inf):  # NaN fails the first comparison
        bad_lp = lps[~(np.isfinite(lps) & (lps <= 0.0))]
        return f"request {rid!r}: logprob {float(bad_lp[0])} must be finite and <= 0"
    vs = np.frombuffer(result.versions, dtype="<i4")
    vlo, vhi = int(vs.min()), int(vs.max())
    if vlo < min_version or vhi > max_version:
        bad_v = vlo if vlo < min_version else vhi
        return (f"request {rid!r}: token version {bad_v} outside [{min_version}, "
                f"{max_version}] (served when sent .. newest applied)")
    if vlo != vhi and bool((down := np.diff(vs) < 0).any()):  # one version: nothing to see
        k = int(np.argmax(down))
        return (f"request {rid!r}: versions go backwards within the turn ({int(vs[k])} then "
                f"{int(vs[k + 1])} at token {k + 1})")
    return None


def _check_small(result: m.GenerateResult, rid: str, min_version: int, max_version: int,
                 vocab_size: int | None) -> str | None:
    """:func:`check_generate_result`'s per-token checks for a short turn (at most
    ``tokenbytes.SMALL_BYTES`` per field), in plain Python: same verdicts, same messages."""
    ids = memoryview(result.token_ids).cast("i")
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        return f"request {rid!r}: token id {bad} outside the vocabulary [0, {vocab_size})"
    for x in memoryview(result.logprobs).cast("f"):
        if not _NEG_INF < x <= 0.0:  # NaN fails both comparisons
            return f"request {rid!r}: logprob {x} must be finite and <= 0"
    vs = memoryview(result.versions).cast("i")
    vlo, vhi = min(vs), max(vs)
    if vlo < min_version or vhi > max_version:
        bad_v = vlo if vlo < min_version else vhi
        return (f"request {rid!r}: token version {bad_v} outside [{min_version}, "
                f"{max_version}] (served when sent .. newest applied)")
    if vlo != vhi:
        for k in range(len(vs) - 1):
            if vs[k + 1] < vs[k]:
                return (f"request {rid!r}: versions go backwards within the turn ({vs[k]} "
                        f"then {vs[k + 1]} at token {k + 1})")
    return None


class ViolationWindow:
    """Per worker, which of its last ``window`` replies broke the contract.

    ``record(worker, ok)`` returns True when the worker now has ``max_violations`` or more
    violations in its window (time-free, so deterministic under any clock).

    Raises ValueError when ``max_violations`` is not in ``[1, window]``.
    """

    def __init__(self, max_violations: int, window: int) -> None:
        if not 1 <= max_violations <= window:
            raise ValueError(f"max_violations {max_violations} must be in [1, window={window}]")
        self.max_violations = max_violations
        self.window = window
        self._recent: dict[str, deque[bool]] = {}
        self._bad: dict[str, int] = {}
        #: violations seen per worker over the whole run
        self.total: dict[str, int] = {}

    def record(self, worker: str, ok: bool) -> bool:
        recent = self._recent.get(worker)
        if recent is None:
            if ok:  # the common case costs one dict lookup
                return False
            recent = self._recent[worker] = deque(maxlen=self.window)
            self._bad[worker] = 0
        if len(recent) == self.window and recent[0]:  # the oldest, a violation, drops out
            self._bad[worker] -= 1
        recent.append(not ok)
        if not ok:
            self._bad[worker] += 1
            self.total[worker] = self.total.get(worker, 0) + 1
        return self._bad[worker] >= self.max_violations

    def count(self, worker: str) -> int:
        """Violations among ``worker``'s last ``window`` replies."""
        return self._bad.get(worker, 0)
