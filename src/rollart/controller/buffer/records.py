"""The states of the sample buffer's trajectory records (``groups.Traj``) and its errors.

Nothing outside the buffer sees them. The protocol they record is in ``rollart.controller.buffer.core``'s module docstring.
"""

from __future__ import annotations

import enum
from typing import Literal

from rollart.transport.errors import RollartError

__all__ = ["LIVE", "SampleBufferError", "TrajState", "TurnVerdict"]

TurnVerdict = Literal["continue", "restart", "drop", "wait", "cancel"]


class SampleBufferError(RollartError, RuntimeError):
    """The buffer protocol was misused (unknown id, wrong call order); names the id and rule."""


class TrajState(enum.Enum):
    RUNNING = "running"
    ABORTING = "aborting"  # told "restart", awaiting restart_trajectory / cancel
    HELD = "held"  # completed, sample kept or awaiting selection
    DONE = "done"  # any terminal state


LIVE = (TrajState.RUNNING, TrajState.ABORTING)
