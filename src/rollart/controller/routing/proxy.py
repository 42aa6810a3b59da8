"""The LLM proxy: pools of inference workers, domain affinity, least-loaded sticky routing.

Routing of one generate call for trajectory ``traj_id`` of domain ``d``:

1. the pool is ``affinity[d]`` (from the scenario; ``set_affinity`` changes it at run time),
   unless online affinity (``spill``, ``rollart.controller.routing.spill``) sends the
   trajectory's first turn to another pool because ``affinity[d]`` is saturated; a trajectory
   stays on the pool its first turn went to;
2. if the trajectory already has a worker in that pool that is alive, it goes there again
   (sticky: its previous turns are in that worker's prefix cache);
3. otherwise the least-loaded live worker of the pool, load being
   ``max(reported, local)``: ``reported`` = ``num_running + num_waiting`` of the worker's last
   ``WorkerStats`` (covers work from other clients), ``local`` = requests this proxy has in flight
   there or waiting for its send window (covers requests sent since that report). Ties go to
   the first worker in pool order.
4. at most ``max_generate_in_flight`` requests are outstanding on one worker (its send window,
   ``rollart.controller.routing.sendwindow``); more wait here in arrival order, and each one's timeout
   starts when it is sent, so a burst is not failed by its own queue.

Prompts travel as deltas (``Generate.prefix_len``): the proxy remembers, per trajectory, which
worker holds how many of its tokens (the prompt and generated tokens of its last turn there) and
sends only the tokens after them. A re-routed trajectory (new worker) sends its whole prompt; a
worker that answers ``prefix_unknown`` (restarted, evicted the prefix) gets the whole prompt once
more (counted in ``num_prefix_resends``). A finished trajectory's id rides on the next
``Generate`` to its worker (``Generate.release``) so the worker can free its prefix.

A worker that raises ``PeerDeadError`` (or reports ``dead``) is removed from its pool and the
request is re-sent to another worker of the same pool; when a pool has no live worker left the
call raises :class:`PoolExhaustedError`, a fatal error for the run (distinct from per-request
``RemoteError``).

Every reply is checked where it arrives (``rollart.controller.routing.workercheck``): a reply that breaks
the ``GenerateResult`` contract (or did not decode: code ``bad_reply``) raises
:class:`~rollart.controller.routing.workercheck.InvalidWorkerOutput` for that turn only, and a worker
that keeps doing it (``violations``) is quarantined. A request the worker's engine failed (code
``engine_error``) is judged by its ``fault``: ``transient`` (the engine refused it for now:
paused, overloaded, aborted) is sent again after a pause (``TRANSIENT_BACKOFF_S``, doubling, at
most ``TRANSIENT_RETRIES`` times, then its turn fails) and never counts against the worker;
otherwise (``fatal``, or unclassified) it fails its turn with that ``RemoteError`` and counts in
the same window: a worker failing every request answers fastest, so least-loaded routing would
send it everything. It is quarantined: :meth:`quarantine` takes it out of its pool
(one warning line naming it), exactly as :meth:`remove_worker` does for a dead one; a pool left
without workers makes it raise ``PoolExhaustedError``. A worker whose calls time out with
nothing answered while other workers answer is probed and quarantined when it fails the probe,
unless it is its pool's last: that one is kept as overloaded, bounded by ``hang.max_overload_s``
(``rollart.controller.routing.hangcheck``).

Cancelling the awaiting task cancels the worker call, which aborts the request on the worker
(the client's contract).
"""

from __future__ import annotations

import array
import asyncio
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.ports import GenerationBackend
from rollart.controller.routing.hangcheck import TIMEOUT, HangCheck
from rollart.controller.routing.sendwindow import SendWindow
from rollart.controller.routing.spill import PoolPressure, SpillPolicy, pool_pressure
from rollart.controller.routing.workercheck import (
    BAD_REPLY,
    ENGINE_ERROR,
    InvalidWorkerOutput,
    ViolationWindow,
    check_generate_result,
)
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError, PeerDeadError, RemoteError

log = logging.getLogger(__name__)


#: finished trajectory ids kept per worker until a Generate carries them; beyond this the
#: oldest are forgotten (the worker's LRU bound frees those prefixes anyway)
MAX_PENDING_RELEASES = 1024
#: first pause before a request the engine refused for now (``fault = "transient"``) is sent
#: again, seconds; it doubles per retry
TRANSIENT_BACKOFF_S = 0.05
#: transient refusals of one request retried at most (0.05 .. 1.6 s of pauses, ~3 s in all)
TRANSIENT_RETRIES = 6


class PoolExhaustedError(PeerDeadError):
    """Fatal: every worker of a pool is dead, so a domain mapped to it cannot generate."""


@dataclass
class Pool:
    """Workers of one hardware kind. ``workers`` holds the live ones, in declaration order."""

    name: str
    hardware: str
    workers: list[GenerationBackend]
    removed: list[str] = field(default_factory=list)


class LLMProxy:
    """Routes generate calls of trajectories to inference workers.

    Args:
        pools: pool name -> (hardware label, workers); at least one worker per pool.
        affinity: domain name -> pool name.
        version: policy version the workers serve at start (0: the initial weights).
        vocab_size: the model's vocabulary size; generated token ids must be below it
            (``None``: not checked beyond ``>= 0``).
        violations: per-worker violation window deciding quarantine (``None``: a bad reply
            fails its turn, the worker is never quarantined for it).
        max_generate_in_flight: generate requests outstanding on one worker at most
            (``run.max_generate_in_flight``); more wait in the proxy, in arrival order, and
            their timeout starts when sent (``rollart.controller.routing.sendwindow``). ``None``: no
            bound.
        spill: online affinity (``run.adaptive_affinity``): where a new trajectory goes when
            its domain's pool is saturated; ``None``: the static ``affinity`` only.

    Raises:
        ConfigError: an empty pool, a duplicate worker name, or affinity to an unknown pool.
    """

    def __init__(
        self,
        pools: Mapping[str, tuple[str, Sequence[GenerationBackend]]],
        affinity: Mapping[str, str],
        *,
        version: int = 0,
        vocab_size: int | None = None,
        violations: ViolationWindow | None = None,
        max_generate_in_flight: int | None = None,
        spill: SpillPolicy | None = None,
    ) -> None:
        self._pools: dict[str, Pool] = {}
        seen: set[str] = set()
        for name, (hardware, workers) in pools.items():
            if not workers:
                raise ConfigError(f"pool {name!r}: no workers")
            for w in workers:
                if w.name in seen:
                    raise ConfigError(f"pool {name!r}: duplicate worker name {w.name!r}")
                seen.add(w.name)
            self._pools[name] = Pool(name, hardware, list(workers))
        self._affinity: dict[str, str] = {}
        for domain, pool in affinity.items():
            self.set_affinity(domain, pool)
        self._window = SendWindow(seen, max_generate_in_flight)
        self.spill = spill
        #: trajectory -> the pool its first turn went to (kept only with ``spill``)
        self._started_on: dict[str, Pool] = {}
        self._sticky: dict[str, GenerationBackend] = {}
        #: trajectory -> (worker, number of its tokens that worker holds)
        self._held: dict[str, tuple[GenerationBackend, int]] = {}
        self._releases: dict[str, deque[str]] = {
            name: deque(maxlen=MAX_PENDING_RELEASES) for name in seen
        }
        self.version = version
        #: newest version any worker was asked to apply (bound of a token's version)
        self.max_version = version
        self.vocab_size = vocab_size
        self.violations = violations
        #: set by the owner once a fatal fault was found outside the proxy (``Controller.
        #: stop_soon``: a service process died): dead workers removed from then on are
        #: consequences of that fault, reported once by the owner, so that removal is logged at
        #: INFO
        self.stopping = False
        #: worker names taken out of their pool for bad output, in order
        self.quarantined: list[str] = []
        #: replies that broke the contract (a count, for metrics)
        self.num_invalid_replies = 0
        #: requests failed by a worker's engine (``engine_error``), counted towards quarantine
        self.num_engine_errors = 0
        #: requests an engine refused for now (``engine_error``, ``fault = "transient"``),
        #: retried after a pause, not counted towards quarantine
        self.num_transient_errors = 0
        #: which worker answered last, pauses and probes of suspected hung workers
        self.hang = HangCheck()
        #: requests re-sent after their worker died (a count, for metrics)
        self.num_rerouted = 0
        #: whole prompts re-sent because a worker answered ``prefix_unknown``
        self.num_prefix_resends = 0
        #: prompt tokens sent to workers (deltas), and the tokens those prompts held in all
        self.num_prompt_tokens_sent = 0
        self.num_prompt_tokens = 0

    # -- configuration ----------------------------------------------------------------------

    @property
    def pools(self) -> dict[str, Pool]:
        return self._pools

    def set_affinity(self, domain: str, pool: str) -> None:
        """Route ``domain``'s later turns to ``pool``. Raises ConfigError for an unknown pool."""
        if pool not in self._pools:
            raise ConfigError(
                f"affinity of domain {domain!r}: unknown pool {pool!r}; pools: "
                f"{sorted(self._pools)}"
            )
        self._affinity[domain] = pool

    def pool_of(self, domain: str) -> Pool:
        """The pool serving ``domain``. Raises ConfigError for a domain without affinity."""
        try:
            return self._pools[self._affinity[domain]]
        except KeyError:
            raise ConfigError(
                f"domain {domain!r} has no pool affinity; domains: {sorted(self._affinity)}"
            ) from None

    def pool_pressure(self, name: str) -> PoolPressure:
        """Pool ``name``'s pressure now (``rollart.controller.routing.spill``)."""
        return pool_pressure(self._pools[name].workers, self._window.waiting)

    def pool_of_trajectory(self, traj_id: str, domain: str) -> Pool:
        """The pool ``traj_id`` (of ``domain``) generates on: its domain's, or with online
        affinity the one its first turn went to. Raises ConfigError for a domain without
        affinity."""
        home = self.pool_of(domain)
        if self.spill is None or not traj_id:
            return home
        pool = self._started_on.get(traj_id)
        if pool is None:
            live = [name for name, p in self._pools.items() if p.workers]
            pool = self._pools[self.spill.pool_for(domain, home.name, self.pool_pressure, live)]
            self._started_on[traj_id] = pool
        return pool

    def workers(self) -> list[GenerationBackend]:
        """Every live worker of every pool (workers found dead are removed first, so a weight
        sync never waits on them)."""
        for pool in self._pools.values():
            for w in [w for w in pool.workers if w.dead]:
                self._remove(pool, w, "reported dead")
        return [w for pool in self._pools.values() for w in pool.workers]

    # -- routing ----------------------------------------------------------------------------

    def load(self, worker: GenerationBackend) -> int:
        """Routing load of ``worker`` (see the module docstring), a request count."""
        stats = worker.last_stats
        reported = stats.num_running + stats.num_waiting if stats is not None else 0
        return max(reported, self._window.load(worker.name))

    @property
    def num_window_waits(self) -> int:
        """Generate requests that waited for a slot in their worker's send window (a
        cumulative count)."""
        return self._window.num_waits

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

    def route(self, traj_id: str, domain: str) -> GenerationBackend:
        """Pick the worker for ``traj_id``'s next turn (sticky, else least-loaded).

        Raises:
            PoolExhaustedError: no live worker in the domain's pool.
        """
        pool = self.pool_of_trajectory(traj_id, domain)
        for w in pool.workers:
            if w.dead:  # rare: only then is a list of the dead ones built
                for dead in [w for w in pool.workers if w.dead]:
                    self._remove(pool, dead, "reported dead")
                break
        sticky = self._sticky.get(traj_id)
        if sticky is not None and sticky in pool.workers:
            return sticky
        if not pool.workers:
            raise PoolExhaustedError(
                f"pool {pool.name!r} ({pool.hardware}) has no live worker left "
                f"(removed: {pool.removed}); domain {domain!r} cannot generate"
            )
        best = min(pool.workers, key=self.load)  # min keeps the first of equal loads
        self._sticky[traj_id] = best
        return best

    async def generate(
        self,
        traj_id: str,
        domain: str,
        request_id: str,
        prompt: array.array,
        sampling: m.SamplingParams,
        *,
        timeout_s: float | None = None,
        tool_parser: str = "",
    ) -> m.GenerateResult:
        """Generate one turn of ``traj_id`` on a worker of ``domain``'s pool.

        ``prompt``: the whole prompt, an ``array.array('i')`` of token ids (the trajectory's
        sequence so far); only the tokens after what the worker holds are copied and sent.
        ``tool_parser``: a vLLM tool parser name the worker runs on the generated text
        (``Generate.tool_parser``); "" for none.

        Raises:
            InvalidWorkerOutput: the reply broke the contract (see the module docstring).
            RemoteError: the worker failed this request (per trajectory).
            PoolExhaustedError: fatal, see :meth:`route` and :meth:`quarantine`.
        """
        total = len(prompt)
        transient = 0  # transient refusals of this request so far
        while True:
            worker = self.route(traj_id, domain)
            if not self._window.try_acquire(worker.name):
                if not await self._window.wait(worker.name):
                    continue  # the worker left its pool while this request waited
                if worker not in self.pool_of_trajectory(traj_id, domain).workers:
                    # Handed a slot just before its worker left (the reply that freed the slot
                    # quarantined it): route again.
                    self._window.release(worker.name)
                    continue
            min_version = self.version  # every worker serves at least this one now
            pending = self._releases[worker.name]
            release = list(pending)
            pending.clear()
            result = None
            timed_out: RemoteError | None = None
            pause_s = 0.0  # > 0: refused for now, send again after this pause
            sent_at = self.hang.replies
            try:  # from here the slot is released whatever happens
                held_by, held = self._held.pop(traj_id, (None, 0))
                if held_by is not worker or held > total:
                    held = 0
                with memoryview(prompt) as view:
                    new = view[held:].tobytes()
                request = m.Generate(
                    request_id=request_id, new_token_ids=new, sampling=sampling,
                    trajectory_id=traj_id, prefix_len=held, release=release,
                    tool_parser=tool_parser,
                )
                self.num_prompt_tokens_sent += total - held
                self.num_prompt_tokens += total
                result = await worker.generate(request, timeout_s=timeout_s)
                self.hang.answered(worker.name)
            except PeerDeadError as exc:
                # Its own pool: the domain may have moved to another since (set_affinity).
                self.remove_worker(worker.name, f"{type(exc).__name__}: {exc}")
                self.num_rerouted += 1
                continue
            except RemoteError as exc:
                if exc.code == TIMEOUT:
                    timed_out = exc  # judged below, once this slot is free
                else:
                    self.hang.answered(worker.name)
                if exc.code == BAD_REPLY:  # the reply did not even decode
                    self._judge(worker, exc.message)
                elif exc.code == ENGINE_ERROR and exc.fault == "transient":
                    # A healthy engine that refused it for now: no violation; again after a
                    # pause (the last refusal fails the turn, still not held against it).
                    self.num_transient_errors += 1
                    if transient < TRANSIENT_RETRIES:
                        pause_s = TRANSIENT_BACKOFF_S * 2 ** transient
                        transient += 1
                elif exc.code == ENGINE_ERROR:
                    # Counted like a bad reply: a worker that fails every request answers
                    # fastest, so least-loaded routing would otherwise send it everything.
                    self.num_engine_errors += 1
                    self._record(worker, f"{ENGINE_ERROR}: {exc.message}")
                if timed_out is None and not pause_s and (
                        exc.code != "prefix_unknown" or held == 0):
                    raise
                if exc.code == "prefix_unknown":
                    self.num_prefix_resends += 1  # next pass: held_by is gone: prefix_len 0
                    continue
            finally:
                # A suspect's slot stays taken while it is probed: its waiters are not sent to
                # a worker that may be hung (they route elsewhere if it is quarantined).
                suspect = timed_out is not None and self.hang.suspect(worker.name, sent_at)
                if not suspect:
                    self._window.release(worker.name)
                if result is None and not worker.dead:
                    # Failed, cancelled or timed out: the worker may still hold the old prefix,
                    # and may never have read this request's releases (a request refused before
                    # its prompt, or lost with its peer's restart): send them again (idempotent).
                    pending.extend(release)
                    pending.append(traj_id)
            if timed_out is not None:
                # Its worker answered other calls meanwhile (busy), or no worker answered
                # anything (the controller's loop stalled, or every engine is slow): overload,
                # which the controller does not count as a failure in a row.
                timed_out.overload = not suspect
                try:
                    hung = await self._hung(worker, sent_at, prompt[0], timed_out)
                finally:
                    if suspect:
                        self._window.release(worker.name)
                if hung:
                    self.num_rerouted += 1
                    continue  # its worker is out of the pool: another one takes it
                raise timed_out
            if pause_s:
                await asyncio.sleep(pause_s)
                continue
            assert result is not None
            if result.finish_reason != "abort":
                self._held[traj_id] = (worker, total + result.num_tokens)
            self._judge(worker, check_generate_result(
                result, max_tokens=sampling.max_tokens, min_version=min_version,
                max_version=self.max_version, vocab_size=self.vocab_size))
            return result

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

    def served_by(self, traj_id: str) -> str | None:
        """Name of the worker that served ``traj_id``'s last (not aborted) turn, until
        :meth:`release`; ``None`` if none holds it."""
        held = self._held.get(traj_id)
        return held[0].name if held is not None else None

    def release(self, traj_id: str) -> None:
        """Forget ``traj_id``'s sticky worker (the trajectory ended); that worker is told to
        drop the trajectory's prefix with its next ``Generate``."""
        self._sticky.pop(traj_id, None)
        self._started_on.pop(traj_id, None)
        held_by, _ = self._held.pop(traj_id, (None, 0))
        if held_by is not None:
            self._releases[held_by.name].append(traj_id)

    # -- weight sync ------------------------------------------------------------------------

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
