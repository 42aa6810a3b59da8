"""Hung inference workers: alive to their heartbeats, answering no generate call.

A worker whose engine hangs still answers heartbeats (its event loop runs), so it is never
declared dead; without this check its calls time out one by one, each failing a trajectory.
The LLM proxy (``rollart.controller.routing.proxy``) keeps this record and acts on it:

Suspicion
    A generate call to worker ``W`` timed out, no reply (a result or an error) came from ``W``
    since that call was sent, and another worker's reply did: the controller's loop and the
    network delivered replies meanwhile, only ``W`` was silent. If every worker was silent (the
    controller stalled, or every engine is slow) nobody is suspected. Replies are counted, not
    timed: two integer stores per reply, no clock.

Probe
    A suspected worker gets one ``Generate`` of a single prompt token with ``max_tokens = 1``,
    sent past its send window (which its unanswered calls may hold), with its own timeout
    (``run.worker_checks.hang_probe_timeout_s``), and only while the controller has not paused
    the worker (a weight update): a pause during the probe makes it start over. It passes when
    it is answered (a result or an error reply) or when any other reply comes from ``W`` while
    it runs (a deep queue that moves). Calls that time out on ``W`` meanwhile wait for the same
    probe.

Verdict
    A failed probe quarantines ``W`` (``LLMProxy.quarantine``): it leaves its pool first, so its
    send-window waiters, woken, route to the pool's other workers (least-loaded routing can no
    longer pick it), and each of its calls still in flight is re-sent elsewhere when its
    timeout ends instead of failing its trajectory. A healthy slow worker answers the probe and
    keeps serving; its timed-out call fails its trajectory as before (and is retried).

The last worker of a pool
    is never quarantined on a failed probe: nothing could serve its pool's domains after it,
    and an engine that is only swamped (a long prefill queue) fails a probe like a hung one. It
    is kept serving as *overloaded*: its timed-out calls fail their trajectories as overload
    (retried, not counted toward ``run.retry.max_failures_in_a_row``) and one warning says so.
    If it answers nothing for ``max_overload_s`` (``run.retry.max_overload_s``) after its first
    failed probe, the next failed probe stops the run (``ControllerStalledError`` naming the
    worker, its pool and the bound); any reply from it ends the episode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable

from rollart.controller.ports import GenerationBackend
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import PeerDeadError, RemoteError

log = logging.getLogger(__name__)
#: ``run.worker_checks.hang_probe_timeout_s`` unless set, seconds
DEFAULT_PROBE_TIMEOUT_S = 30.0
#: probes of one suspicion at most, when a pause keeps interrupting them
MAX_PROBE_TRIES = 3
#: ``RemoteError.code`` of a call that got no reply within its timeout
TIMEOUT = "timeout"
#: ``run.retry.max_overload_s`` unless set, seconds
DEFAULT_MAX_OVERLOAD_S = 3600.0


class HangCheck:
    """The proxy's record of which worker answered last, its pauses, and its probes.

    Args:
        probe_timeout_s: timeout of one probe, seconds (> 0).
        max_overload_s: how long a pool's last worker may stay silent after its first failed
            probe before the run stops, seconds (> 0).

    Attributes:
        replies: replies received from any worker so far (a count; a call's ``sent_at``).
        hung: names of workers quarantined as hung (their in-flight calls re-route).
        num_probes / num_probes_failed: probes sent / failed so far.
    """

    def __init__(self, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 max_overload_s: float = DEFAULT_MAX_OVERLOAD_S) -> None:
        if not probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s}")
        if not max_overload_s > 0:
            raise ValueError(f"max_overload_s must be > 0, got {max_overload_s}")
        self.probe_timeout_s = probe_timeout_s
        self.max_overload_s = max_overload_s
        #: last workers of their pools kept as overloaded: name -> (loop time of the episode's
        #: first failed probe, the worker's ``_last`` then; a later reply ends the episode)
        self._overloaded: dict[str, tuple[float, int]] = {}
        self.replies = 0
        self._last: dict[str, int] = {}
        self.hung: set[str] = set()
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self._paused: dict[str, asyncio.Future[None]] = {}
        self._pauses: dict[str, int] = {}
        self._seq = 0
        self.num_probes = 0
        self.num_probes_failed = 0

    def answered(self, name: str) -> None:
        """Worker ``name`` replied to a generate call (a result or an error reply)."""
        self.replies += 1
        self._last[name] = self.replies

    def suspect(self, name: str, sent_at: int) -> bool:
        """Whether a call to ``name`` sent when ``replies`` was ``sent_at`` and now timed out
        makes ``name`` suspect: nothing came from it since, something came from another."""
        return self._last.get(name, 0) <= sent_at < self.replies

    def overloaded(self, name: str, now: float) -> tuple[bool, float]:
        """Worker ``name``, the last of its pool, failed a probe at loop time ``now`` (seconds)
        and is kept serving. Returns (whether this starts an episode: no earlier failed probe
        of it, or it replied since; seconds since the episode's first failed probe)."""
        episode = self._overloaded.get(name)
        last = self._last.get(name, 0)
        if episode is None or episode[1] != last:
            self._overloaded[name] = (now, last)
            return True, 0.0
        return False, now - episode[0]

    def pausing(self, names: Iterable[str]) -> None:
        """The controller pauses these workers (a weight update): no probe meanwhile."""
        loop = asyncio.get_running_loop()
        for name in names:
            self._pauses[name] = self._pauses.get(name, 0) + 1
            if name not in self._paused:
                self._paused[name] = loop.create_future()

    def resumed(self, names: Iterable[str]) -> None:
        """The controller resumed these workers (or gave up pausing them)."""
        for name in names:
            fut = self._paused.pop(name, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def resumed_all(self) -> None:
        """Every paused worker resumed."""
        self.resumed(list(self._paused))

    async def probe(self, worker: GenerationBackend, token: int) -> bool:
        """Probe ``worker`` (one probe at a time per worker; concurrent callers share it) with
        one prompt token ``token`` (a valid id of the model). True if it failed: hung."""
        task = self._probes.get(worker.name)
        if task is None:
            task = asyncio.ensure_future(self._probe(worker, token))
            self._probes[worker.name] = task
            task.add_done_callback(functools.partial(self._probe_done, worker.name))
        return await asyncio.shield(task)

    def _probe_done(self, name: str, task: asyncio.Task[bool]) -> None:
        if self._probes.get(name) is task:
            del self._probes[name]

    async def _probe(self, worker: GenerationBackend, token: int) -> bool:
        name = worker.name
        for _ in range(MAX_PROBE_TRIES):
            while (paused := self._paused.get(name)) is not None:
                await asyncio.shield(paused)
            pauses, before = self._pauses.get(name, 0), self._last.get(name, 0)
            self._seq += 1
            self.num_probes += 1
            request = m.Generate(request_id=f"hang-probe-{self._seq}",
                                 new_token_ids=tb.pack_i32([token]),
                                 sampling=m.SamplingParams(max_tokens=1))
            try:
                await worker.generate(request, timeout_s=self.probe_timeout_s)
            except PeerDeadError:
                return False  # dead, not hung: the proxy's dead-worker path takes it out
            except RemoteError as exc:
                if exc.code != TIMEOUT:
                    return False  # an error reply: its loop and engine answer
                if self._last.get(name, 0) != before:
                    return False  # its queue moved while the probe waited in it
                if self._pauses.get(name, 0) != pauses:
                    continue  # paused by the controller meanwhile: not conclusive
                self.num_probes_failed += 1
                return True
            except Exception as exc:  # an in-process worker's own bug: it answered, not hung
                log.warning("hang probe of worker %s raised %s: %s", name, type(exc).__name__,
                            exc)
                return False
            return False
        return False
