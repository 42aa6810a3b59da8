"""Calls on every worker of the LLM proxy at once: pause, resume and weight application
(all at once or in waves), a worker whose call fails taken out of its pool.

``FleetCalls`` is a part of ``rollart.controller.routing.proxy.LLMProxy``; the state it reads
lives on the proxy.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from rollart.controller.routing.health import PoolExhaustedError, WorkerHealth
from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError, RemoteError


class FleetCalls(WorkerHealth):
    """Pause, resume and weight application on every live worker, for ``LLMProxy``."""

    version: int
    max_version: int

    async def _on_all(self, what: str, call, only: set[str] | None = None) -> list:
        """Run ``call(worker)`` on every live worker (of the names in ``only``, if given) at
        once; dead ones are removed, and so are (quarantined) ones whose call failed with a
        ``RemoteError`` (e.g. a failed weight apply or prefix-cache reset): a worker that
        cannot pause or apply weights must not serve on with other weights than its pool's.

        Raises PoolExhaustedError if that empties a pool; other errors propagate.
        """
        pairs = [(pool, w) for pool in self._pools.values() for w in pool.workers
                 if only is None or w.name in only]
        results = await asyncio.gather(*(call(w) for _, w in pairs), return_exceptions=True)
        out = []
        for (pool, w), res in zip(pairs, results, strict=True):
            if isinstance(res, PeerDeadError):
                self._remove(pool, w, f"{what}: {res}")
            elif isinstance(res, RemoteError):
                self._remove(pool, w, f"quarantined: {what} failed: {res}")
                self.quarantined.append(w.name)
            elif isinstance(res, BaseException):
                raise res
            else:
                out.append(res)
        for pool in self._pools.values():
            if not pool.workers:
                raise PoolExhaustedError(f"pool {pool.name!r}: no worker left after {what} "
                                         f"(removed: {pool.removed})")
        return out

    async def pause(self, mode: Literal["keep", "abort"] = "keep") -> None:
        """Suspend generation on every worker (``keep``: in-flight requests wait)."""
        self.hang.pausing(w.name for w in self.workers())  # no hang probe while paused
        await self._on_all("pause", lambda w: w.pause(mode))

    async def resume(self) -> None:
        try:
            await self._on_all("resume", lambda w: w.resume())
        finally:
            self.hang.resumed_all()

    async def apply_weights(self, version: int, *, reprefill: bool = False) -> list[m.WeightsApplied]:
        """Apply the staged ``version`` on every worker; afterwards ``self.version == version``.

        Call between :meth:`pause` and :meth:`resume` (paper §6.2). ``reprefill``: recompute the
        KV cache of in-flight requests under the new weights.
        """
        self.max_version = max(self.max_version, version)
        out = await self._on_all(
            f"apply_weights({version})", lambda w: w.apply_weights(version, reprefill=reprefill)
        )
        self.version = version
        return out

    async def apply_in_waves(self, version: int, waves: int, *, reprefill: bool = False) -> None:
        """Pause, apply the staged ``version`` and resume, one wave of workers at a time: wave
        ``i`` holds workers ``i, i + waves, ...`` of every pool, so while one wave loads, the
        others keep generating (with ``waves >= 2`` a pool of two or more workers never stops).

        ``self.version`` (the version *every* worker serves, used by the staleness check) becomes
        ``version`` after the last wave; tokens report the version of the worker that generated
        them. Raises as :meth:`apply_weights` (``waves`` >= 1, else ``ValueError``).
        """
        if waves < 1:
            raise ValueError(f"apply_in_waves: waves must be >= 1, got {waves}")
        # Waves fixed up front: a worker removed mid-apply must not shift the later waves.
        self.max_version = max(self.max_version, version)
        plan = [{w.name for pool in self._pools.values() for w in pool.workers[i::waves]}
                for i in range(waves)]
        for names in plan:
            if not names:
                continue
            self.hang.pausing(names)
            await self._on_all("pause", lambda w: w.pause("keep"), names)
            try:
                await self._on_all(f"apply_weights({version})",
                                   lambda w: w.apply_weights(version, reprefill=reprefill), names)
            finally:
                try:
                    await self._on_all("resume", lambda w: w.resume(), names)
                finally:
                    self.hang.resumed(names)
        self.version = version
