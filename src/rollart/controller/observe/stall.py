"""A training step that gets no batch: the fatal stall error, and the watchdog's report of
what the batch waits on.

The training step raises :class:`ControllerStalledError` when no batch can ever come (nothing
running, admission cannot start a group; also after too many trajectory failures in a row);
while a batch is merely slow, :meth:`StallWatchdog.watch` logs :meth:`StallWatchdog.report`
every ``run.stall_log_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.config import RunConfig
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.rollout.trajectory import Activity

log = logging.getLogger(__name__)


class ControllerStalledError(RollartError):
    """Fatal: no batch can be produced (nothing running, admission cannot start a group)."""


class RunningTrajectories(Protocol):
    """What the watchdog reads of the trajectory tasks."""

    @property
    def num_running(self) -> int: ...

    def activity(self) -> Mapping[str, Activity]: ...


class StallWatchdog:
    """Says what a batch that does not come waits on.

    Args:
        run: the scenario's run settings (``stall_log_s``, ``batch_size``, ``group_size``).
        buffer: the sample buffer (its open groups and ready samples).
        trajectories: the running trajectories and what each is doing.
        clock: monotonic seconds (the clock the trajectories' activity is stamped with).
    """

    def __init__(self, run: RunConfig, buffer: SampleBuffer,
                 trajectories: RunningTrajectories, clock: Callable[[], float]) -> None:
        self.run, self.buffer, self.trajectories, self.clock = run, buffer, trajectories, clock

    async def watch(self) -> None:
        """Log :meth:`report` every ``run.stall_log_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            await asyncio.sleep(self.run.stall_log_s)
            log.warning("%s", self.report(loop.time() - t0))

    def report(self, waited_s: float, max_groups: int = 8, max_members: int = 8) -> str:
        """``Controller.stall_report`` (its docstring)."""
        now = self.clock()
        activity = self.trajectories.activity()
        buffer, run = self.buffer, self.run
        groups = buffer.open_groups()
        lines = [f"no batch for {waited_s:.0f} s at version {buffer.version}: "
                 f"{buffer.ready_samples()}/{run.batch_size} samples ready, "
                 f"{len(groups)} group(s) collecting, {self.trajectories.num_running} "
                 "trajectories running"]
        for key, domain, kept, live in groups[:max_groups]:
            doing = []
            for tid in live[:max_members]:
                act = activity.get(tid)
                doing.append(f"{tid} {act.phase} for {now - act.since:.0f} s"
                             if act is not None else f"{tid} not started")
            more = f", +{len(live) - max_members} more" if len(live) > max_members else ""
            lines.append(f"  group {key} ({domain}): {kept}/{run.group_size} kept; "
                         f"{'; '.join(doing) or 'no member running'}{more}")
        if len(groups) > max_groups:
            lines.append(f"  +{len(groups) - max_groups} more group(s)")
        return "\n".join(lines)
