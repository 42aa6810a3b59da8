"""Worker health in the LLM proxy: a worker taken out of its pool (found dead, quarantined
for its output or as hung) and a pool's last worker kept as overloaded.

``WorkerHealth`` is a part of ``rollart.controller.routing.proxy.LLMProxy`` (whose module
docstring gives the rules); the state it reads lives on the proxy, and its log lines are the
proxy's (logger ``rollart.controller.routing.proxy``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.ports import GenerationBackend
from rollart.controller.routing.hangcheck import HangCheck
from rollart.controller.routing.sendwindow import SendWindow
from rollart.controller.routing.workercheck import InvalidWorkerOutput, ViolationWindow
from rollart.transport.errors import ConfigError, PeerDeadError, RemoteError

log = logging.getLogger("rollart.controller.routing.proxy")


class PoolExhaustedError(PeerDeadError):
    """Fatal: every worker of a pool is dead, so a domain mapped to it cannot generate."""


@dataclass
class Pool:
    """Workers of one hardware kind. ``workers`` holds the live ones, in declaration order."""

    name: str
    hardware: str
    workers: list[GenerationBackend]
    removed: list[str] = field(default_factory=list)


class WorkerHealth:
    """Taking workers out of their pools, for ``LLMProxy`` (its attributes below)."""

    _pools: dict[str, Pool]
    _window: SendWindow
    _sticky: dict[str, GenerationBackend]
    _held: dict[str, tuple[GenerationBackend, int]]
    stopping: bool
    quarantined: list[str]
    violations: ViolationWindow | None
    num_invalid_replies: int
    hang: HangCheck

    def workers(self) -> list[GenerationBackend]:
        """Every live worker of every pool (workers found dead are removed first, so a weight
        sync never waits on them)."""
        for pool in self._pools.values():
            for w in [w for w in pool.workers if w.dead]:
                self._remove(pool, w, "reported dead")
        return [w for pool in self._pools.values() for w in pool.workers]

    def _remove(self, pool: Pool, worker: GenerationBackend, why: str) -> None:
        self._window.drop(worker.name)  # its waiters route again
        if worker in pool.workers:
            pool.workers.remove(worker)
            pool.removed.append(worker.name)
            # A dead worker's removal once the run stops is the owner's one message; a live
            # one's (quarantined for its output) is news, stopping or not.
            log.log(logging.INFO if self.stopping and worker.dead else logging.WARNING,
                    "pool %s: worker %s removed (%s)", pool.name, worker.name, why)
        for traj, w in list(self._sticky.items()):
            if w is worker:
                del self._sticky[traj]
        for traj, (w, _) in list(self._held.items()):
            if w is worker:
                del self._held[traj]

    def remove_worker(self, name: str, why: str) -> Pool:
        """Take worker ``name`` out of its pool (no later request is routed to it; trajectories
        that were sticky to it go to the pool's other workers, resending their whole prompt)
        and return that pool, which may now be empty (see :meth:`route`). One warning line
        names the worker and ``why`` (an INFO line for a dead worker once ``stopping``).
        Idempotent. Raises ConfigError for an unknown name."""
        for pool in self._pools.values():
            for w in pool.workers:
                if w.name == name:
                    self._remove(pool, w, why)
                    return pool
            if name in pool.removed:
                return pool
        raise ConfigError(f"remove_worker: no worker named {name!r}")

    def quarantine(self, name: str, why: str) -> None:
        """Take a misbehaving (alive) worker out of its pool: :meth:`remove_worker`, counted in
        ``quarantined``.

        Raises:
            PoolExhaustedError: it was its pool's last worker (fatal: the run stops).
        """
        pool = self.remove_worker(name, f"quarantined: {why}")
        if name not in self.quarantined:
            self.quarantined.append(name)
        if not pool.workers:
            raise PoolExhaustedError(
                f"pool {pool.name!r} ({pool.hardware}): its last worker {name!r} was "
                f"quarantined ({why}); removed: {pool.removed}"
            )

    def _record(self, worker: GenerationBackend, problem: str | None) -> None:
        """Count one reply of ``worker`` in its violation window (``problem``: its violation,
        or ``None``); quarantine the worker at the threshold."""
        hit = self.violations is not None and self.violations.record(worker.name, problem is None)
        if hit and problem is not None and worker.name not in self.quarantined:
            assert self.violations is not None
            self.quarantine(
                worker.name,
                f"{self.violations.count(worker.name)} invalid replies among its last "
                f"{self.violations.window} (run.worker_checks); last: {problem}",
            )

    def _judge(self, worker: GenerationBackend, problem: str | None) -> None:
        """:meth:`_record` the reply; raise ``InvalidWorkerOutput`` for a violation."""
        self._record(worker, problem)
        if problem is not None:
            self.num_invalid_replies += 1
            raise InvalidWorkerOutput(worker.name, problem)

    async def _hung(self, worker: GenerationBackend, sent_at: int, token: int,
                    timed_out: RemoteError) -> bool:
        """A call to ``worker`` sent when ``hang.replies`` was ``sent_at`` timed out (with
        ``timed_out``): whether it should be re-sent elsewhere because ``worker`` is hung
        (quarantined, perhaps by now: ``rollart.controller.routing.hangcheck``) or died.
        ``token``: a token id of its prompt, for the probe. A pool's last worker that fails the
        probe stays in its pool: ``timed_out`` is then marked ``overload``.

        Raises:
            ControllerStalledError: the pool's last worker has failed its probes, answering
                nothing, for ``hang.max_overload_s`` seconds.
        """
        name = worker.name
        if name not in self.hang.hung and self.hang.suspect(name, sent_at):
            if await self.hang.probe(worker, token):
                pool = next((p for p in self._pools.values() if worker in p.workers), None)
                if pool is not None and pool.workers == [worker]:
                    self._overloaded(pool, worker)
                    timed_out.overload = True
                    return False
                self.hang.hung.add(name)
                # Every caller sharing the probe gets here; quarantine is idempotent (and
                # raises PoolExhaustedError for each, should the pool be left empty).
                self.quarantine(name, (
                    "hung: a generate call got no reply within its timeout while other "
                    f"workers answered, and a {self.hang.probe_timeout_s:g} s probe of one "
                    "token got none either"))
        if worker.dead:
            self.remove_worker(name, "dead")
            return True
        return name in self.hang.hung

    def _overloaded(self, pool: Pool, worker: GenerationBackend) -> None:
        """``worker``, ``pool``'s last, failed its hang probe: keep it, as overloaded (its pool
        could not generate without it); one warning per episode (until it replies again).

        Raises:
            ControllerStalledError: it has answered nothing since its first failed probe
                ``hang.max_overload_s`` or more seconds ago.
        """
        bound = self.hang.max_overload_s
        first, silent_s = self.hang.overloaded(worker.name, asyncio.get_running_loop().time())
        if first:
            log.warning(
                "pool %s: worker %s timed out and failed a %g s probe while other workers "
                "answered; kept as overloaded since it is the pool's last worker (the run "
                "stops if it stays silent for run.retry.max_overload_s = %g s)",
                pool.name, worker.name, self.hang.probe_timeout_s, bound)
        elif silent_s >= bound:
            raise ControllerStalledError(
                f"pool {pool.name!r} ({pool.hardware}): its last worker {worker.name!r} has "
                f"answered no generate call for {silent_s:.0f} s since its first failed hang "
                f"probe while other workers answered (run.retry.max_overload_s = {bound:g}); "
                f"hung or overloaded beyond the bound (removed from the pool earlier: "
                f"{pool.removed})"
            )
