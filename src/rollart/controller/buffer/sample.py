"""The controller's record of one finished trajectory, and the sample buffer's counters.

``Sample`` is what a trajectory coroutine hands to ``SampleBuffer.complete``; the controller
later turns the samples of a batch into ``rollart.transport.messages.TrainSample`` (adding the
GRPO advantage). ``BufferStats`` is the snapshot of counters ``SampleBuffer.stats()`` returns.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec
import numpy as np

#: generated tokens up to this many are reduced in plain Python (numpy's call overhead
#: exceeds a loop over a few items)
_SMALL = 64
#: ``array.array`` typecode of each per-token field (int32, int8 0/1, float32, int32)
TYPECODES: dict[str, Literal["i", "b", "f"]] = {
    "token_ids": "i", "loss_mask": "b", "behaviour_logprobs": "f", "versions": "i"}

if TYPE_CHECKING:
    # After construction every per-token field is a typed memoryview; the wider types below
    # are only what the constructor and msgspec's decoder accept (lists: older snapshots).
    _IntView = memoryview
    _FloatView = memoryview
else:
    _IntView = memoryview | list[int]
    _FloatView = memoryview | list[float]
#: what ``Sample(...)`` takes for a per-token field (see the class docstring)
ArrayInput = memoryview | bytes | bytearray | array.array | Sequence[int] | Sequence[float]


def _typed_view(sample_id: str, name: str, value: Any) -> memoryview[Any]:
    """``value`` as a 1-D memoryview of the field's typecode (no copy where it already is one).

    Raw bytes (a base64-decoded snapshot, wire bytes) are reinterpreted; other sequences (Python
    lists: older checkpoints, tests) are converted value by value."""
    code = TYPECODES[name]
    if isinstance(value, array.array) and value.typecode == code:
        return memoryview(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        view = memoryview(value)
        if view.format == code and view.ndim == 1:
            return view
        if view.format in ("B", "b", "c") and view.c_contiguous:
            try:
                return view.cast("B").cast(code)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"sample {sample_id!r}: {name}: {exc}") from None
    try:
        return memoryview(array.array(code, value))
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"sample {sample_id!r}: {name}: {exc}") from None


def spread_generated(loss_mask: Any, gen_logprobs: Any, gen_versions: Any
                     ) -> tuple[array.array, array.array]:
    """Full-length behaviour logprobs and versions from those of the generated tokens only.

    Args:
        loss_mask: int8 / uint8 buffer, 1 at the generated tokens, ``n`` items.
        gen_logprobs: float32 buffer (native order) of the generated tokens, in order; as many
            items as ``loss_mask`` has ones.
        gen_versions: int32 buffer (native order) of the generated tokens, same count.
    Returns:
        ``(logprobs, versions)``: ``array.array`` float32 / int32 of ``n`` items, 0.0 / -1 off
        the generated tokens (what the trainer's padded tensors and transcripts show).
    Raises:
        ValueError: the counts differ.
    """
    lps = np.frombuffer(gen_logprobs, np.float32)
    vs = np.frombuffer(gen_versions, np.int32)
    at = _generated_positions(loss_mask)
    if at.size != lps.size or at.size != vs.size:
        raise ValueError(f"{at.size} generated tokens in the loss mask but "
                         f"{lps.size} logprobs / {vs.size} versions")
    return _spread(len(loss_mask), at, lps, "f", 0.0), _spread(len(loss_mask), at, vs, "i", -1)


def _generated_positions(loss_mask: Any) -> np.ndarray:
    """Positions of the 1s of ``loss_mask`` (int8 / uint8 buffer), in order."""
    mask = np.frombuffer(loss_mask, dtype=np.uint8)
    # The prompt, most of a long context, precedes the first generated token: find that with
    # argmax and scan only from there.
    first = int(mask.argmax()) if mask.size else 0
    if not mask.size or not mask[first]:
        return np.zeros(0, np.intp)
    return first + np.flatnonzero(mask[first:])


def _spread(n: int, at: np.ndarray, values: np.ndarray, typecode: str, fill: float
            ) -> array.array:
    out = array.array(typecode, [fill]) * n
    np.frombuffer(out, dtype=values.dtype)[at] = values
    return out


class Sample(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """One scored trajectory, token-exact, held as compact arrays: 5 bytes per token plus 8 per
    generated token.

    Fields are 1-D typed memoryviews (``len``, indexing, iteration and ``tolist()`` work;
    ``numpy.asarray(view)`` is a zero-copy array):

    - ``token_ids[t]``: int32 token id, ``num_tokens`` items (prompt, generated and
      observation tokens, in order);
    - ``loss_mask[t]``: int8, ``num_tokens`` items, 1 where token t was generated by the
      policy, else 0;
    - ``behaviour_logprobs[k]``: float32, ``num_generated`` items: the engine's logprob of the
      k-th generated token (the k-th 1 of ``loss_mask``);
    - ``versions[k]``: int32 (>= 0), ``num_generated`` items: the policy version that
      generated the k-th generated token.

    Only generated tokens have a logprob and a version, and at a 32k-token context they are a
    few hundred: keeping those alone saves 8 bytes per context token held until training and
    spares the completion two context-length arrays, whose fresh pages cost ~200 us at 32k
    tokens on the event loop. :meth:`full_behaviour_logprobs` /
    :meth:`full_versions` build the per-token form (0.0 / -1 off the generated tokens).

    Construct with ``array.array`` / memoryviews of those typecodes (no copy), raw bytes, or
    Python sequences (converted). ``behaviour_logprobs`` / ``versions`` of ``num_tokens`` items
    (the per-token form: older snapshots, hand-built samples) are accepted and reduced to the
    generated tokens. ``msgspec.to_builtins`` writes each field as base64 of its bytes, and
    ``msgspec.convert`` reads that back (and the lists older snapshots hold). The arrays must
    not change after construction: ``num_generated`` and ``min_version`` are computed once by
    the validation.

    ``sample_id`` is the trajectory id the buffer issued; ``reward`` is a finite float (a failed
    trajectory is never a sample: see ``SampleBuffer.fail``). ``num_turns`` counts env turns,
    ``finish_reason`` is the engine's/env's reason the trajectory ended (``"stop"``, ``"length"``,
    ``"terminated"``, ...). ``turn_workers[i]``: name of the inference worker that generated
    assistant turn ``i`` (empty for samples from before it was recorded).

    Raises:
        ValueError: naming the sample and field: lengths that fit neither form, mask values
            other than 0/1, a generated token's version < 0, a reward not finite,
            ``num_turns`` < 0.
    """

    sample_id: str
    group_key: str
    token_ids: _IntView
    loss_mask: _IntView
    behaviour_logprobs: _FloatView
    versions: _IntView
    reward: float
    domain: str = "default"
    num_turns: int = 1
    finish_reason: str = "stop"
    metadata: dict[str, Any] = {}
    turn_workers: list[str] = []

    if TYPE_CHECKING:
        def __init__(self, *, sample_id: str, group_key: str, token_ids: ArrayInput,
                     loss_mask: ArrayInput, behaviour_logprobs: ArrayInput,
                     versions: ArrayInput, reward: float, domain: str = ...,
                     num_turns: int = ..., finish_reason: str = ...,
                     metadata: dict[str, Any] = ..., turn_workers: list[str] = ...) -> None: ...

    def __post_init__(self) -> None:
        sid = self.sample_id
        self.token_ids = _typed_view(sid, "token_ids", self.token_ids)
        self.loss_mask = loss_mask = _typed_view(sid, "loss_mask", self.loss_mask)
        self.behaviour_logprobs = logprobs = _typed_view(sid, "behaviour_logprobs",
                                                         self.behaviour_logprobs)
        self.versions = versions = _typed_view(sid, "versions", self.versions)
        n = len(self.token_ids)
        if len(loss_mask) != n:
            raise ValueError(f"sample {sid!r}: token_ids/loss_mask lengths "
                             f"{n}/{len(loss_mask)} differ")
        mask = np.frombuffer(loss_mask, dtype=np.uint8)
        # One pass finds the largest mask value and its first position: 0 means nothing was
        # generated; 1 is the first generated token, so the count starts there (the prompt,
        # most of a long context, is skipped); more than 1 is invalid.
        first = int(mask.argmax()) if n else 0
        top = int(mask[first]) if n else 0
        if top > 1:
            raise ValueError(f"sample {sid!r}: loss_mask values must be 0 or 1")
        gen = int(np.count_nonzero(mask[first:])) if top else 0
        self._num_generated = gen
        nl, nv = len(logprobs), len(versions)
        if nl != gen or nv != gen:
            if nl != n or nv != n:
                raise ValueError(
                    f"sample {sid!r}: behaviour_logprobs/versions have {nl}/{nv} items: "
                    f"expected one per generated token ({gen}) or one per token ({n})")
            # The per-token form: keep the generated tokens' items only.
            at = mask[first:].view(np.bool_)
            self.behaviour_logprobs = memoryview(array.array(
                "f", np.frombuffer(logprobs, np.float32)[first:][at].tobytes()))
            self.versions = versions = memoryview(array.array(
                "i", np.frombuffer(versions, np.int32)[first:][at].tobytes()))
        self._min_version = None
        if gen:
            # a few turns' tokens: Python's min beats numpy's per-call overhead
            vs = versions
            self._min_version = (min(vs) if gen <= _SMALL
                                 else int(np.frombuffer(vs, np.int32).min()))
            if self._min_version < 0:
                k = int(np.argmax(np.frombuffer(vs, np.int32) < 0))
                t = first + int(np.flatnonzero(mask[first:])[k])
                raise ValueError(
                    f"sample {sid!r}: generated token {t} has version {vs[k]} (< 0)")
        if not math.isfinite(self.reward):
            raise ValueError(f"sample {sid!r}: reward {self.reward} is not finite")
        if self.num_turns < 0:
            raise ValueError(f"sample {sid!r}: num_turns {self.num_turns} < 0")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Response length: number of policy-generated tokens (sum of ``loss_mask``)."""
        return self._num_generated

    @property
    def min_version(self) -> int | None:
        """Oldest policy version among generated tokens; ``None`` if none was generated."""
        return self._min_version

    def full_behaviour_logprobs(self) -> array.array:
        """float32 ``array.array`` of ``num_tokens`` items: the behaviour logprob of each
        generated token at its position, 0.0 elsewhere (a new array each call)."""
        return _spread(self.num_tokens, _generated_positions(self.loss_mask),
                       np.frombuffer(cast(memoryview, self.behaviour_logprobs), np.float32),
                       "f", 0.0)

    def full_versions(self) -> array.array:
        """int32 ``array.array`` of ``num_tokens`` items: the policy version of each generated
        token at its position, -1 elsewhere (a new array each call)."""
        return _spread(self.num_tokens, _generated_positions(self.loss_mask),
                       np.frombuffer(cast(memoryview, self.versions), np.int32), "i", -1)


class BufferStats(msgspec.Struct, kw_only=True):
    """Counters of a ``SampleBuffer`` (cumulative since construction or restore, unless noted).

    Gauges (now): ``version``, ``groups_in_flight`` (admitted, not yet consumed/retired, or still
    with live members), ``running`` (trajectories generating, incl. ones told to restart),
    ``held`` (completed samples not yet consumed), ``in_flight`` = running + held,
    ``in_flight_bound`` = (alpha + 1) * batch_size + redundancy * groups_in_flight,
    ``ready_samples``.

    Cumulative: ``started`` trajectories (incl. retries/restarts), ``completed`` (``complete``
    calls accepted), ``consumed`` samples, ``batches``, ``retries`` (failure replacements),
    ``failed`` by reason, ``restarted_stale`` (running trajectories aborted by the per-turn check),
    ``replaced_stale`` (held samples replaced after going stale), ``dropped`` samples by reason
    (``stale``, ``unselected``, ``retired``), ``cancelled``, ``groups_retired``,
    ``wasted_tokens`` (generated tokens thrown away) by reason (``redundancy``, ``failed``,
    ``stale``, ``unselected``, ``retired``, ``shutdown``; ``resume``: running at a checkpoint,
    so restarted on resume), ``late_calls`` (calls on already-finished trajectories, ignored).

    Selection bias: ``finished_mean_len`` is the mean response length (generated tokens) of every
    finished member, ``kept_mean_len`` of the members kept in groups, ``cancelled_mean_len`` the
    mean generated tokens of cancelled members at cancel time (a lower bound of what they would
    have produced). Staleness of the last batch: ``version`` at consumption minus each sample's
    oldest generated-token version (max and mean), in versions.
    """

    version: int
    alpha: int
    batch_size: int
    group_size: int
    redundancy: int
    max_groups: int
    groups_in_flight: int
    running: int
    held: int
    in_flight: int
    in_flight_bound: int
    ready_samples: int
    started: int
    completed: int
    consumed: int
    batches: int
    retries: int
    failed: dict[str, int]
    restarted_stale: int
    replaced_stale: int
    dropped: dict[str, int]
    cancelled: int
    groups_retired: int
    wasted_tokens: dict[str, int]
    late_calls: int
    finished_members: int
    finished_mean_len: float
    kept_members: int
    kept_mean_len: float
    cancelled_mean_len: float
    last_batch_max_staleness: int
    last_batch_mean_staleness: float
    #: every generated token is in exactly one of trained / wasted (by reason) / in flight
    generated_tokens: int = 0
    trained_tokens: int = 0
    in_flight_tokens: int = 0
    #: the same accounting per task domain (see ``DomainCounts``)
    domains: dict[str, DomainCounts] = {}
    #: groups given up by reason (``attempts_exhausted``: a slot used ``max_attempts``;
    #: ``failure_budget``: ``run.retry.max_failures_per_group``)
    groups_dropped: dict[str, int] = {}


class DomainCounts(msgspec.Struct, kw_only=True):
    """Cumulative counters of one task domain in the sample buffer (selection bias, waste).

    ``groups_started`` groups admitted; ``started`` trajectories (incl. retries, restarts and
    redundant members); ``finished`` completed with a reward; ``trained`` consumed by a batch.
    ``*_tokens`` are generated (policy) tokens and ``*_turns`` env turns summed over those
    samples (means: divide by the count). ``generated_tokens`` is every token generated for the
    domain; ``wasted_tokens`` the part thrown away, by reason (``SampleBuffer`` docstring).
    """

    groups_started: int = 0
    started: int = 0
    finished: int = 0
    finished_tokens: int = 0
    finished_turns: int = 0
    trained: int = 0
    trained_tokens: int = 0
    trained_turns: int = 0
    generated_tokens: int = 0
    wasted_tokens: dict[str, int] = {}
