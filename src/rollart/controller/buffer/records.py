"""The sample buffer's records: one per trajectory (``Traj``) and one per GRPO group (``Group``).

Plain mutable records with no behaviour of their own: ``rollart.controller.buffer.core`` (the
``SampleBuffer`` facade) and its helper modules (``buffergroups``, ``bufferbatch``,
``bufferstats``, ``buffersnapshot``) read and write them; nothing outside the buffer sees them.
The protocol they record is in ``rollart.controller.buffer.core``'s module docstring.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from rollart.controller.buffer.sample import Sample
from rollart.transport.errors import RollartError

__all__ = ["LIVE", "Group", "SampleBufferError", "Traj", "TrajState", "TurnVerdict"]

TurnVerdict = Literal["continue", "restart", "drop", "wait", "cancel"]


class SampleBufferError(RollartError, RuntimeError):
    """The buffer protocol was misused (unknown id, wrong call order); names the id and rule."""


class TrajState(enum.Enum):
    RUNNING = "running"
    ABORTING = "aborting"  # told "restart", awaiting restart_trajectory / cancel
    HELD = "held"  # completed, sample kept or awaiting selection
    DONE = "done"  # any terminal state


LIVE = (TrajState.RUNNING, TrajState.ABORTING)


@dataclass(slots=True, eq=False)
class Traj:
    tid: str
    group: Group
    slot: int
    attempt: int
    state: TrajState = TrajState.RUNNING
    min_version: int | None = None
    num_tokens: int = 0
    turns: int = 0
    doomed: bool = False
    sample: Sample | None = None


@dataclass(slots=True, eq=False)
class Group:
    key: str
    seq: int
    slots: list[Traj | None]  # None: slot closed for good
    kept: list[Traj] = field(default_factory=list)
    finished: list[Traj] = field(default_factory=list)  # unbiased candidates
    selected: bool = False
    closing: bool = False
    status: Literal["open", "consumed", "retired"] = "open"
    #: trajectories started for it so far (first attempts, retries, restarts, replacements)
    started: int = 0
    domain: str = "default"
    alpha: int = 0

    def live(self) -> list[Traj]:
        return [t for t in self.slots if t is not None and t.state in LIVE]
