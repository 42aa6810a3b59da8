"""A training step that gets no batch: the fatal stall error, and the watchdog's report of
what the batch waits on.

``get_batch`` raises :class:`ControllerStalledError` when no batch can ever come (nothing
running, admission cannot start a group; also after too many trajectory failures in a row);
while a batch is merely slow, :func:`stall_watchdog` logs :func:`stall_report` every
``run.stall_log_s``. Functions over the :class:`~rollart.controller.controller.Controller`'s
state, which calls them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.controller import Controller

# The controller's messages keep the logger name they always had (``trajtasks`` says why).
log = logging.getLogger("rollart.controller.controller")


class ControllerStalledError(RollartError):
    """Fatal: no batch can be produced (nothing running, admission cannot start a group)."""


async def stall_watchdog(c: Controller) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        await asyncio.sleep(c.run.stall_log_s)
        log.warning("%s", c.stall_report(loop.time() - t0))


def stall_report(c: Controller, waited_s: float, max_groups: int, max_members: int) -> str:
    """``Controller.stall_report`` (its docstring)."""
    now = c.clock()
    activity = c._ctx.activity if c._ctx is not None else {}
    groups = c.buffer.open_groups()
    lines = [f"no batch for {waited_s:.0f} s at version {c.buffer.version}: "
             f"{c.buffer.ready_samples()}/{c.run.batch_size} samples ready, "
             f"{len(groups)} group(s) collecting, {len(c._tasks)} trajectories running"]
    for key, domain, kept, live in groups[:max_groups]:
        doing = []
        for tid in live[:max_members]:
            act = activity.get(tid)
            doing.append(f"{tid} {act.phase} for {now - act.since:.0f} s" if act is not None
                         else f"{tid} not started")
        more = f", +{len(live) - max_members} more" if len(live) > max_members else ""
        lines.append(f"  group {key} ({domain}): {kept}/{c.run.group_size} kept; "
                     f"{'; '.join(doing) or 'no member running'}{more}")
    if len(groups) > max_groups:
        lines.append(f"  +{len(groups) - max_groups} more group(s)")
    return "\n".join(lines)
