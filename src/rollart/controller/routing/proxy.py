"""The LLM proxy: pools of inference workers, domain affinity, least-loaded sticky routing.

Routing of one generate call for trajectory ``traj_id`` of domain ``d``:

1. the pool is ``affinity[d]`` (from the scenario; ``set_affinity`` changes it at run time),
   unless online affinity (``spill``, ``rollart.controller.routing.spill``) sends the
   trajectory's first turn to another pool because ``affinity[d]`` is saturated; a trajectory
   stays on the pool its first turn went to. With the KV working-set hold
   (``rollart.controller.routing.workingset``) the first turn may wait there until the pool's
   KV cache has room for the trajectory's working set;
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

Parts: ``LLMProxy`` here routes and generates; it is also a
``rollart.controller.routing.fleet.FleetCalls`` (pause, resume, weights on every worker) and
a ``rollart.controller.routing.health.WorkerHealth`` (removal, quarantine, hung workers).
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence

from rollart.controller.ports import GenerationBackend
from rollart.controller.routing.fleet import FleetCalls
from rollart.controller.routing.hangcheck import TIMEOUT, HangCheck
from rollart.controller.routing.health import Pool, PoolExhaustedError
from rollart.controller.routing.sendwindow import SendWindow
from rollart.controller.routing.spill import PoolGauge, PoolPressure, SpillPolicy
from rollart.controller.routing.workercheck import (
    BAD_REPLY,
    ENGINE_ERROR,
    ViolationWindow,
    check_generate_result,
)
from rollart.controller.routing.workingset import KVWorkingSet
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError, PeerDeadError, RemoteError

__all__ = ["LLMProxy", "Pool", "PoolExhaustedError", "TRANSIENT_RETRIES"]


#: finished trajectory ids kept per worker until a Generate carries them; beyond this the
#: oldest are forgotten (the worker's LRU bound frees those prefixes anyway)
MAX_PENDING_RELEASES = 1024
#: first pause before a request the engine refused for now (``fault = "transient"``) is sent
#: again, seconds; it doubles per retry
TRANSIENT_BACKOFF_S = 0.05
#: transient refusals of one request retried at most (0.05 .. 1.6 s of pauses, ~3 s in all)
TRANSIENT_RETRIES = 6


class LLMProxy(FleetCalls):
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
        kv_working_set: ``(share, prior_tokens, max_turns, max_tokens_per_turn)``: hold a
            new trajectory's first turn while its pool's KV cache cannot keep one more
            trajectory's working set (``rollart.controller.routing.workingset``; the pool is
            judged saturated then): ``share`` of the pool's reported KV capacity
            (``WorkerStats.kv_capacity_tokens``; each trajectory charged in whole blocks of
            ``WorkerStats.kv_block_tokens``); ``prior_tokens``: the longest a trajectory
            may grow (every projection's cap, and the estimate before its domain's first turn
            returned); ``max_turns``: domain -> its cap on turns, for the projection before its
            first finish; ``max_tokens_per_turn``: the cap on a response (a one-turn domain's
            estimate before its first turn returned is its prompt plus this when less than
            ``prior_tokens``; ``None``: ``prior_tokens``). Turns that found most of the prefix
            their worker held evicted (``GenerateResult.num_cached_tokens``) are counted.
            ``None``: no such hold.

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
        kv_working_set: tuple[float, int, Mapping[str, int], int | None] | None = None,
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
        self._gauge = PoolGauge()
        self.working_set = None if kv_working_set is None else KVWorkingSet(
            self._kv_capacity, share=kv_working_set[0], prior_tokens=kv_working_set[1],
            max_turns=kv_working_set[2], max_tokens_per_turn=kv_working_set[3],
            block_tokens=self._kv_block_tokens)
        #: turns whose held prefix the worker's cache had mostly evicted (counted with the
        #: working-set hold on)
        self.num_prefix_evicted_turns = 0
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

    def pool_pressure(self, name: str, domain: str | None = None,
                      num_prompt_tokens: int = 0) -> PoolPressure:
        """Pool ``name``'s pressure now (``rollart.controller.routing.spill``); with ``domain``,
        its working sets count as full also when a new trajectory of that domain, its first
        prompt ``num_prompt_tokens`` long (0: not known), would not fit (so the spill policy
        does not keep it home to wait while another pool has room)."""
        p = self._gauge.pressure(self._pools[name].workers, self._window.waiting,
                                 lambda w: self._window.in_flight.get(w, 0))
        ws = self.working_set
        if ws is not None and (ws.full(name) or (
                domain is not None and not ws.fits(name, domain, num_prompt_tokens))):
            return dataclasses.replace(p, working_set_full=True)
        return p

    def _kv_capacity(self, pool: str) -> int | None:
        """KV tokens pool ``pool``'s live workers hold in all; ``None`` (not gated) when none
        reported a capacity above 0. A worker whose last stats carry none (its engine had not
        sized its KV cache when they were taken: ``SchedulerCounts``) counts at its pool's
        reported mean: a pool's workers share one engine configuration and hardware label,
        and leaving the pool ungated until that worker's next stats would let the cache
        thrash meanwhile."""
        workers = self._pools[pool].workers
        known = [w.last_stats.kv_capacity_tokens for w in workers
                 if w.last_stats is not None and w.last_stats.kv_capacity_tokens is not None]
        total = sum(known)
        return total * len(workers) // len(known) if total else None

    def _kv_block_tokens(self, pool: str) -> int | None:
        """Tokens per KV-cache block of pool ``pool``'s engines (the largest its workers
        reported: a trajectory may run on any of them); ``None`` when none reported one."""
        sizes = [w.last_stats.kv_block_tokens for w in self._pools[pool].workers
                 if w.last_stats is not None and w.last_stats.kv_block_tokens is not None]
        return max(sizes, default=None)

    def pool_of_trajectory(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> Pool:
        """The pool ``traj_id`` (of ``domain``) generates on: its domain's, or with online
        affinity the one its first turn went to (chosen at the first call, its first prompt
        ``num_prompt_tokens`` long; 0: not known). Raises ConfigError for a domain without
        affinity."""
        home = self.pool_of(domain)
        if self.spill is None or not traj_id:
            return home
        pool = self._started_on.get(traj_id)
        if pool is None:
            live = [name for name, p in self._pools.items() if p.workers]
            pool = self._pools[self.spill.pool_for(
                domain, home.name,
                lambda name: self.pool_pressure(name, domain, num_prompt_tokens), live)]
            self._started_on[traj_id] = pool
        return pool

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
        ws = self.working_set
        await self.admit(traj_id, domain, len(prompt))
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
            if ws is not None and traj_id:
                self._account_kv(ws, traj_id, domain, held, total, result)
            return result

    async def admit(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> None:
        """With the KV working-set hold: wait until ``traj_id`` (of ``domain``, first prompt
        ``num_prompt_tokens`` long) may start on its pool (``generate`` does it for a first
        turn; callers whose own clock starts at the first turn, such as an agent's HTTP client,
        call it before). A no-op without the hold, for ``traj_id = ""`` and for a live
        trajectory."""
        ws = self.working_set
        if ws is not None and not self.try_admit(traj_id, domain, num_prompt_tokens):
            await ws.admit(traj_id, self.pool_of_trajectory(traj_id, domain,
                                                            num_prompt_tokens).name, domain,
                           num_prompt_tokens, asyncio.get_running_loop().time)

    def try_admit(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> bool:
        """:meth:`admit` without waiting: ``True`` when ``traj_id`` may generate now (started on
        its pool at once, live already, or no hold); ``False``: :meth:`admit` would wait."""
        ws = self.working_set
        if ws is None or not traj_id:
            return True
        return ws.try_start(traj_id, self.pool_of_trajectory(traj_id, domain,
                                                             num_prompt_tokens).name, domain,
                            num_prompt_tokens)

    def _account_kv(self, ws: KVWorkingSet, traj_id: str, domain: str, held: int, total: int,
                    result: m.GenerateResult) -> None:
        """After a checked turn: the trajectory's footprint, the eviction count, and the
        pool's waiters (its expected sum or its capacity may have changed)."""
        pool = self.pool_of_trajectory(traj_id, domain).name
        if result.finish_reason != "abort":
            ws.held(traj_id, total + result.num_tokens)
        cached = result.num_cached_tokens
        if held and cached is not None and 2 * cached < held:
            # Most of the prefix its worker held for it was evicted: the pool's cache did not
            # keep its trajectories between turns.
            self.num_prefix_evicted_turns += 1
        ws.poke(pool)

    def served_by(self, traj_id: str) -> str | None:
        """Name of the worker that served ``traj_id``'s last (not aborted) turn, until
        :meth:`release`; ``None`` if none holds it."""
        held = self._held.get(traj_id)
        return held[0].name if held is not None else None

    def release(self, traj_id: str, *, finished: bool = True) -> None:
        """Forget ``traj_id``'s sticky worker (the trajectory ended); that worker is told to
        drop the trajectory's prefix with its next ``Generate``. ``finished``: it ended its
        turns (``KVWorkingSet.ended``); ``False`` for one cut short."""
        if self.working_set is not None:
            self.working_set.ended(traj_id, finished=finished)
        self._sticky.pop(traj_id, None)
        self._started_on.pop(traj_id, None)
        held_by, _ = self._held.pop(traj_id, (None, 0))
        if held_by is not None:
            self._releases[held_by.name].append(traj_id)

