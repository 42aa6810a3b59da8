"""Weight synchronisation between the trainer and the inference workers (paper §6.2-6.3).

Two shapes, one per family of modes:

- overlap (``one_off``, ``areal``, ``rollart``): after training version v+1, its push to the
  workers (staging only) starts in the background and overlaps rollout
  (:meth:`WeightSync.start_push`); at the next step, once the batch is taken,
  :meth:`WeightSync.apply_newest` waits for that push if still running, then pauses generation,
  applies v+1 on every worker and resumes. Only that wait and the pause are *exposed*.
- no overlap (``sync``, ``sync_plus``): generation is paused before training
  (:meth:`WeightSync.pause`) and :meth:`WeightSync.push_apply_resume` pushes, applies and
  resumes right after it; all of it is exposed.

Eager apply (``run.weight_apply = "eager"``, overlap modes): the background task that pushes
v+1 goes on to apply it at once, in ``apply_waves`` waves of workers
(:meth:`LLMProxy.apply_in_waves`), instead of waiting for the next step's batch. Root cause it
removes: with the apply at the next batch, every token generated while that batch fills is of
version v, which is too old (alpha = 1) for the batch after it, so about half of the
``(alpha + 1) x batch`` in flight was generated under a version already too old to be trained.
:meth:`apply_newest` then only waits for that task (its wait is the exposed part).

A trainer whose ``push_needs_pause`` is true (collective NCCL / gloo broadcast, which writes into
the serving models) cannot push in the background: its push happens at the pause point, before
the apply, and is all exposed.

``total_s`` counts push + pause/apply/resume seconds of a version; ``exposed_s`` the seconds the
training loop waited for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollart.controller.ports import TrainerBackend
from rollart.controller.routing.proxy import LLMProxy


class WeightSync:
    """Coordinates pushes and applies. ``on_applied()`` runs after each apply (wakes the
    trajectories that wait for new weights); ``on_push_done(task)`` supervises background
    pushes (a failed push is fatal)."""

    def __init__(self, proxy: LLMProxy, trainer: TrainerBackend, clock: Callable[[], float], *,
                 reprefill: bool, on_applied: Callable[[], None],
                 on_push_done: Callable[[asyncio.Task[float]], None],
                 eager: bool = False, waves: int = 1) -> None:
        self.proxy, self.trainer, self.clock = proxy, trainer, clock
        self.reprefill = reprefill
        self.eager, self.waves = eager, waves
        self._on_applied = on_applied
        self._on_push_done = on_push_done
        self._push_task: asyncio.Task[float] | None = None
        self._eager_task: asyncio.Task[float] | None = None

    async def _push(self, version: int) -> float:
        t0 = self.clock()
        await self.trainer.push_weights(version, self.proxy.workers())
        return self.clock() - t0

    @property
    def push_needs_pause(self) -> bool:
        return self.trainer.push_needs_pause

    def start_push(self, version: int) -> None:
        """Stage ``version`` on the workers in the background (overlapping rollout); with
        ``eager``, apply it as soon as it is staged."""
        if self.eager:
            self._eager_task = asyncio.create_task(self._push_and_apply(version),
                                                   name=f"push-apply-v{version}")
            self._eager_task.add_done_callback(self._on_push_done)
            return
        if self.push_needs_pause:
            return
        self._push_task = asyncio.create_task(self._push(version), name=f"push-v{version}")
        self._push_task.add_done_callback(self._on_push_done)

    async def _push_and_apply(self, version: int) -> float:
        """Eager: push then apply ``version`` in waves; returns push + apply seconds. A push
        that writes into the serving models (``push_needs_pause``) pauses every worker."""
        t0 = self.clock()
        if self.push_needs_pause:
            await self.proxy.pause("keep")
            try:
                await self._push(version)
                await self.proxy.apply_weights(version, reprefill=self.reprefill)
            finally:
                await self.proxy.resume()
        else:
            await self._push(version)
            await self.proxy.apply_in_waves(version, self.waves, reprefill=self.reprefill)
        self._on_applied()
        return self.clock() - t0

    async def _apply_and_resume(self, version: int) -> None:
        try:
            await self.proxy.apply_weights(version, reprefill=self.reprefill)
        finally:
            await self.proxy.resume()
        self._on_applied()

    async def apply_newest(self) -> tuple[float, float]:
        """Overlap modes: apply the trainer's newest version if the workers lag behind it.
        Returns ``(total_s, exposed_s)``."""
        version = self.trainer.version
        if self._eager_task is not None:
            t0 = self.clock()
            total_s = await self._eager_task
            self._eager_task = None
            return total_s, self.clock() - t0
        if self.proxy.version >= version:
            return 0.0, 0.0
        t0 = self.clock()
        if self.push_needs_pause:
            await self.proxy.pause("keep")
            try:
                await self._push(version)
            except BaseException:
                await self.proxy.resume()
                raise
            await self._apply_and_resume(version)
            # All of it is exposed: one reading, so total and exposed are equal (two readings
            # differ by the clock's step, a visible share of a sync of a few ms).
            waited = self.clock() - t0
            return waited, waited
        if self._push_task is not None:
            push_s = await self._push_task
            self._push_task = None
        else:
            push_s = await self._push(version)
        t_apply = self.clock()
        await self.proxy.pause("keep")
        await self._apply_and_resume(version)
        return push_s + (self.clock() - t_apply), self.clock() - t0

    async def pause(self) -> float:
        """No-overlap modes: suspend generation before training; returns seconds taken."""
        t0 = self.clock()
        await self.proxy.pause("keep")
        return self.clock() - t0

    async def push_apply_resume(self, version: int) -> float:
        """No-overlap modes: stage, apply and resume right after training; returns seconds."""
        t0 = self.clock()
        await self._push(version)
        await self._apply_and_resume(version)
        return self.clock() - t0

    async def close(self) -> None:
        """Cancel a push still running (the run ends; the next run re-publishes)."""
        for task in (self._push_task, self._eager_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
