"""The controller's checkpoint format: ``Controller.snapshot()`` and the restore a resumed
``Controller`` starts from.

A controller snapshot (``format`` 1) wraps the sample buffer's own
(``rollart.controller.buffer.snapshot``) with what the buffer does not know: each held group's
domain and env seed, the group counter, the step count and the admission RNG's state, so a
resumed run admits the same groups with the same seeds. Checkpoints already written must keep
restoring: the layout changes only with a new format number.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from rollart.controller.buffer.snapshot import carried_over, counts_since
from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.controller import Controller

#: scenario field of each ``SampleBuffer`` setting whose name differs (for resume errors)
_SCENARIO_FIELD = {"check": "run.mode", "max_attempts": "run.retry.max_attempts"}


def snapshot(c: Controller) -> dict[str, Any]:
    """``Controller.snapshot()`` (its docstring)."""
    snap = c.buffer.snapshot()
    keys = {g["key"] for g in snap["groups"]}
    return {
        "format": 1,
        "step": c._step,
        "buffer": snap,
        # counters gained since the last step's metrics: the first step after a resume
        # reports them (absent in older checkpoints: nothing is added)
        "since_last_step": counts_since(c.buffer.stats(), c._stats_at_end),
        "groups": {k: [c._groups[k][0].name, c._groups[k][1]] for k in sorted(keys)},
        "group_seq": c._group_seq,
        "rng": list(c._rng.getstate()[1]),
    }


def restore(c: Controller, snap: dict[str, Any]) -> None:
    """Continue from ``snap`` (a :func:`snapshot`): the buffer restored with its checked
    settings, the groups' domains and seeds, the step count and the admission RNG.

    Raises:
        RollartError: an unknown format, settings other than the scenario's, a version other
            than the trainer's, or a group of a domain the scenario lacks.
    """
    if snap.get("format") != 1:
        raise RollartError(f"controller snapshot: unknown format {snap.get('format')!r}")
    wanted = c.buffer.snapshot()["config"]  # the scenario's, before the restore
    c.buffer = c._buffer_class.restore(
        snap["buffer"], rng=random.Random(c.run.seed + 1), on_forget=c._forget_group,
        on_drop=c.transcripts.dropped if c.transcripts is not None else None)
    # The restored buffer runs on the snapshot's settings: a scenario edited since (alpha,
    # abort_stale, ...) would be ignored without a word.
    had = {k: getattr(c.buffer, k) for k in wanted}
    changed = [f"{_SCENARIO_FIELD.get(k, 'run.' + k)} (checkpoint {had[k]!r}, scenario "
               f"{v!r})" for k, v in wanted.items() if had.get(k) != v]
    if changed:
        raise RollartError("controller snapshot was taken with other settings: "
                           f"{', '.join(changed)}; resume with the scenario it was taken with")
    if c.buffer.version != c.trainer.version:
        raise RollartError(
            f"controller snapshot is at version {c.buffer.version}, the trainer at "
            f"{c.trainer.version}"
        )
    for key, (domain, seed) in snap["groups"].items():
        if domain not in c.domains:
            raise RollartError(f"controller snapshot: group {key!r} of unknown domain "
                               f"{domain!r}")
        c._groups[key] = (c.domains[domain], seed)
    c._group_seq = snap["group_seq"]
    c._step = snap["step"]
    # The first step's metrics are deltas from here: the restart's waste shows in them.
    c._stats_at_end = carried_over(c.buffer.stats(), snap.get("since_last_step"))
    c._rng.setstate((3, tuple(snap["rng"]), None))
