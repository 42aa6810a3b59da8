"""The controller's checkpoint format: ``Controller.snapshot()`` and the restore a resumed
``Controller`` starts from.

A controller snapshot (``format`` 1) wraps the sample buffer's own
(``rollart.controller.buffer.snapshot``) with what the buffer does not know: each held group's
domain and env seed, the group counter and the admission RNG's state
(:meth:`~rollart.controller.rollout.admission.Admission.snapshot`), the step count and the
counters gained since the last step (``StepCounters.since_last_step``), so a resumed run
admits the same groups with the same seeds. Checkpoints already written must keep restoring:
the layout changes only with a new format number. Each part saves and restores its own state;
this module owns the layout.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.rollout.admission import Admission
    from rollart.controller.training.step import StepRunner

#: scenario field of each ``SampleBuffer`` setting whose name differs (for resume errors)
_SCENARIO_FIELD = {"check": "run.mode", "max_attempts": "run.retry.max_attempts"}


def snapshot(buffer: SampleBuffer, admission: Admission, steps: StepRunner) -> dict[str, Any]:
    """``Controller.snapshot()`` (its docstring)."""
    snap = buffer.snapshot()
    keys = {g["key"] for g in snap["groups"]}
    part = admission.snapshot(keys)
    return {
        "format": 1,
        "step": steps.step_index,
        "buffer": snap,
        # counters gained since the last step's metrics: the first step after a resume
        # reports them (absent in older checkpoints: nothing is added)
        "since_last_step": steps.counters.since_last_step(),
        "groups": part["groups"],
        "group_seq": part["group_seq"],
        "rng": part["rng"],
    }


def restore_buffer(snap: dict[str, Any], *, scenario_buffer: SampleBuffer,
                   buffer_class: type[SampleBuffer], seed: int, trainer_version: int,
                   on_forget: Callable[[str], None],
                   on_drop: Callable[[str, str], None] | None) -> SampleBuffer:
    """The sample buffer of ``snap`` (a :func:`snapshot`), checked against the scenario's
    (``scenario_buffer``, built from the scenario's settings) and the trainer's version.
    ``seed``: ``run.seed`` (the buffer's RNG is seeded ``seed + 1``).

    Raises:
        RollartError: an unknown format, settings other than the scenario's, a version other
            than the trainer's.
    """
    if snap.get("format") != 1:
        raise RollartError(f"controller snapshot: unknown format {snap.get('format')!r}")
    wanted = scenario_buffer.snapshot()["config"]
    buffer = buffer_class.restore(snap["buffer"], rng=random.Random(seed + 1),
                                  on_forget=on_forget, on_drop=on_drop)
    # The restored buffer runs on the snapshot's settings: a scenario edited since (alpha,
    # abort_stale, ...) would be ignored without a word.
    had = {k: getattr(buffer, k) for k in wanted}
    changed = [f"{_SCENARIO_FIELD.get(k, 'run.' + k)} (checkpoint {had[k]!r}, scenario "
               f"{v!r})" for k, v in wanted.items() if had.get(k) != v]
    if changed:
        raise RollartError("controller snapshot was taken with other settings: "
                           f"{', '.join(changed)}; resume with the scenario it was taken with")
    # Not in the checkpoint (they decide when a batch is taken and how a stale group is
    # replaced, not what the groups hold): a resumed run follows its scenario.
    buffer.hold_for_groups = scenario_buffer.hold_for_groups
    buffer.readmit_stale_groups = scenario_buffer.readmit_stale_groups
    if buffer.version != trainer_version:
        raise RollartError(
            f"controller snapshot is at version {buffer.version}, the trainer at "
            f"{trainer_version}"
        )
    return buffer


def restore_parts(snap: dict[str, Any], admission: Admission, steps: StepRunner) -> None:
    """Restore the admitted groups, the admission RNG, the step count and the counters
    carried over (the buffer already restored by :func:`restore_buffer`).

    Raises:
        RollartError: a group of a domain the scenario lacks.
    """
    admission.restore(snap)
    steps.restore(snap["step"])
    # The first step's metrics are deltas from here: the restart's waste shows in them.
    steps.counters.restore(snap.get("since_last_step"))
