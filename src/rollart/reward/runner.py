"""Runs reward functions off the event loop, under a timeout, and classifies every failure.

Async functions run on the loop; sync ones run inline (trivial functions only), in threads, or
in worker processes (CPU-bound scoring: sympy holds the GIL, so threads would stall the server).
Every call is bounded by the function's ``timeout_s`` from the moment it has a thread or worker
process; waiting for one is bounded by ``timeout_s`` too and answered 503 (saturated: retry)
past it, so a saturated service is never mistaken for a hung function.

A call that outlives its timeout must not starve later calls (a few hung calls used to occupy
every pool slot, so every later call timed out too):

- process functions run in ``num_processes`` single-process slots; a call past its timeout has
  its process killed (SIGTERM) and the slot gets a fresh process (``num_killed_processes``).
- thread functions run one daemon thread per call, at most ``num_threads`` at once. A thread
  cannot be killed: past its timeout it is *abandoned* (its slot is freed at once, it is
  counted in ``num_hung_threads`` until it returns, and its result is discarded). At most
  ``max_hung_threads`` may be abandoned at once; beyond that thread calls get 503 (the service
  keeps serving process and async functions) until one returns. Chosen over running sync
  functions in processes by default because thread functions may be closures or hold state
  that cannot be sent to another process; functions that may hang should use
  ``executor="process"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import logging
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rollart.reward.protocol import InvalidRewardError, RewardResponse, validate_result
from rollart.reward.registry import RewardFunction, RewardInputError
from rollart.threadcalls import AbandonableThreads

log = logging.getLogger("rollart.reward.runner")

THREAD_PREFIX = "rollart-reward"


class ScoringError(Exception):
    """A call could not produce a reward; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _warm_up() -> None:
    # Import the heavy scorers once per worker so the first request does not pay for it.
    import math_verify  # noqa: F401
    import reasoning_gym  # noqa: F401


def _call(fn: Any, prompt: str, response: str, reference: Any, metadata: dict) -> Any:
    return fn(prompt, response, reference, metadata)


def _terminate(pool: cf.ProcessPoolExecutor) -> None:
    """Kill ``pool``'s worker processes and shut it down without waiting."""
    # 3.11 has no public terminate, so use the executor's process map.
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()


class RewardRunner:
    """Owns the threads and worker processes of one service.

    Args:
        num_threads: thread functions running at once (``executor="thread"``), >= 1.
        num_processes: worker processes for ``executor="process"`` functions (forked from a
            forkserver, never from the service: forking a process that runs an event loop and
            threads is unsafe).
        default_timeout_s: limit for functions that do not set ``timeout_s``, in seconds.
        warm_up: pre-import math-verify and reasoning-gym in each worker process.
        max_hung_threads: thread calls past their timeout still running (abandoned) before
            further thread calls are refused with 503, >= 1. An abandoned thread costs its
            stack's touched pages (tens of KiB) and whatever the function holds.

    Raises:
        ValueError: an argument out of range, named.
    """

    def __init__(
        self,
        *,
        num_threads: int = 8,
        num_processes: int | None = None,
        default_timeout_s: float = 30.0,
        warm_up: bool = True,
        max_hung_threads: int = 1024,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        if max_hung_threads < 1:
            raise ValueError(f"max_hung_threads must be >= 1, got {max_hung_threads}")
        self.num_processes = num_processes or max(1, min(4, os.cpu_count() or 1))
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.num_threads = num_threads
        self.max_hung_threads = max_hung_threads
        self.default_timeout_s = default_timeout_s
        self._warm_up = warm_up
        #: worker processes killed because a call outlived its timeout (cumulative)
        self.num_killed_processes = 0
        #: worker processes replaced after dying on their own (cumulative)
        self.num_broken_processes = 0
        self._threads = AbandonableThreads(THREAD_PREFIX, "reward function")
        self._thread_slots: asyncio.Semaphore | None = None
        # Single-process executors: one hung call is killed without touching the others.
        self._procs: list[cf.ProcessPoolExecutor] = []
        self._idle: asyncio.Queue[cf.ProcessPoolExecutor] | None = None
        self._spawning: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def num_hung_threads(self) -> int:
        """Thread calls abandoned after their timeout and still running (gauge)."""
        return self._threads.num_hung

    def stats(self) -> dict[str, int]:
        """Gauges ``hung_threads``, ``idle_processes`` (started, free); counters
        ``killed_processes``, ``broken_processes``."""
        return {
            "hung_threads": self.num_hung_threads,
            "idle_processes": self._idle.qsize() if self._idle is not None else 0,
            "killed_processes": self.num_killed_processes,
            "broken_processes": self.num_broken_processes,
        }

    # ------------------------------------------------------------------ process slots
    def _slots(self) -> asyncio.Queue[cf.ProcessPoolExecutor]:
        # Created lazily: a service that only serves thread/async functions never spawns workers.
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.num_processes):
                self._spawn()
        return self._idle

    def _spawn(self) -> None:
        """Start a worker process in the background; it joins the idle slots once warmed up,
        so no call's deadline is spent on a process start (and no starting process is killed
        for being slow: that would never let a replacement finish warming up)."""
        task = asyncio.get_running_loop().create_task(self._start_slot())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _start_slot(self) -> None:
        delay_s = 0.5
        while not self._closed:
            pool = cf.ProcessPoolExecutor(
                1, mp_context=self._mp_context(),
                initializer=_warm_up if self._warm_up else None,
            )
            self._procs.append(pool)
            try:
                await asyncio.get_running_loop().run_in_executor(pool, int)
            except BrokenProcessPool as exc:  # e.g. the warm-up imports failed
                log.error("reward worker process failed to start (%s); retrying in %g s",
                          exc, delay_s)
                self._procs.remove(pool)
                _terminate(pool)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, 30.0)
                continue
            if self._closed:
                return
            assert self._idle is not None
            self._idle.put_nowait(pool)
            return

    def _mp_context(self) -> Any:
        # Workers fork from a forkserver that imported the heavy scorers once: a replacement
        # for a killed worker starts in milliseconds instead of re-importing them (seconds),
        # and nothing forks the service itself (an event loop and threads: unsafe to fork).
        ctx = multiprocessing.get_context("forkserver")
        if self._warm_up:
            ctx.set_forkserver_preload(["math_verify", "reasoning_gym"])
        return ctx

    def start_process_pool(self) -> None:
        """Start the worker processes now (instead of on the first process call); call from
        inside the event loop."""
        self._slots()

    def _replace(self, pool: cf.ProcessPoolExecutor) -> None:
        """Kill ``pool``'s process and start a fresh slot in its place."""
        if pool in self._procs:
            self._procs.remove(pool)
        _terminate(pool)
        if not self._closed:
            self._spawn()

    async def _run_process(self, spec: RewardFunction, args: tuple,
                           pool: cf.ProcessPoolExecutor) -> Any:
        slots = self._slots()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(pool, functools.partial(_call, spec.fn, *args))
        try:
            result = await fut
        except BrokenProcessPool as exc:
            # The worker died (e.g. OOM-killed, os._exit): replace it; this call fails (503).
            self.num_broken_processes += 1
            self._replace(pool)
            raise ScoringError(
                503, f"reward function {spec.name!r}: worker process died ({exc}); retry"
            ) from None
        except asyncio.CancelledError:
            # Timed out (or the caller went away) while the function runs: kill it, else the
            # slot stays busy until the function returns, which may be never.
            if not fut.done() or fut.cancelled():
                self.num_killed_processes += 1
                log.warning("killing the worker process of reward function %r (past its "
                            "deadline); a fresh one replaces it", spec.name)
                self._replace(pool)
            else:
                slots.put_nowait(pool)
            raise
        except BaseException:
            slots.put_nowait(pool)
            raise
        slots.put_nowait(pool)
        return result

    # ------------------------------------------------------------------ thread calls
    async def _run_thread(self, spec: RewardFunction, args: tuple) -> Any:
        """Run on a fresh daemon thread (the caller holds a thread slot)."""
        return await self._threads.run(_call, (spec.fn, *args), repr(spec.name))

    async def _acquire(self, spec: RewardFunction, timeout_s: float
                       ) -> cf.ProcessPoolExecutor | None:
        """A thread slot (``None``) or an idle worker process for ``spec``, waiting at most
        ``timeout_s``. Raises ScoringError 503 (retryable: the service is saturated, the
        function did not run) past it, or while too many thread calls hang."""
        try:
            async with asyncio.timeout(timeout_s):
                if spec.executor == "process":
                    return await self._slots().get()
                if self._thread_slots is None:
                    self._thread_slots = asyncio.Semaphore(self.num_threads)
                await self._thread_slots.acquire()
        except TimeoutError:
            what = "worker process" if spec.executor == "process" else "thread slot"
            raise ScoringError(
                503, f"reward function {spec.name!r}: no free {what} within {timeout_s:g} s "
                "(the service is saturated); retry") from None
        # Checked holding a slot, so at most num_threads more can be abandoned past it.
        if self.num_hung_threads >= self.max_hung_threads:
            self._thread_slots.release()
            raise ScoringError(
                503,
                f"reward function {spec.name!r}: {self.num_hung_threads} thread calls hung "
                f"past their timeout (limit {self.max_hung_threads}); refusing thread calls "
                "until one returns (use executor='process' for functions that may hang)",
            )
        return None

    # ------------------------------------------------------------------ scoring
    async def score(
        self, spec: RewardFunction, prompt: str, response: str, reference: Any, metadata: dict
    ) -> RewardResponse:
        """Run ``spec`` on one request and validate the result.

        Raises:
            ScoringError: 422 (RewardInputError or invalid reward), 500 (the function raised),
                503 (no free thread / worker process within ``timeout_s``, its worker process
                died and was replaced, or too many hung thread calls: retryable), 504 (it ran
                past ``timeout_s``; a process call is killed, a thread call abandoned).
        """
        timeout_s = spec.timeout_s if spec.timeout_s is not None else self.default_timeout_s
        args = (prompt, response, reference, metadata)
        deadline = asyncio.timeout(timeout_s)
        pooled = not spec.is_async and spec.executor in ("thread", "process")
        # Waiting for a slot is not running: past timeout_s it is a 503 (saturated, retry),
        # and the function's own timeout_s starts once it has a thread or process.
        pool = await self._acquire(spec, timeout_s) if pooled else None
        try:
            async with deadline:
                if spec.is_async:
                    result = await spec.fn(*args)
                elif spec.executor == "inline":
                    result = spec.fn(*args)
                elif spec.executor == "thread":
                    result = await self._run_thread(spec, args)
                else:
                    assert pool is not None
                    result = await self._run_process(spec, args, pool)
        except TimeoutError as exc:
            if deadline.expired():
                reason = f"timed out after {timeout_s:g} s"
            else:  # the function's own time limit (e.g. math-verify's)
                reason = f"timed out: {exc}"
            raise ScoringError(504, f"reward function {spec.name!r} {reason}") from None
        except RewardInputError as exc:
            raise ScoringError(
                422, f"reward function {spec.name!r} rejected the input: {exc}"
            ) from None
        except ScoringError:
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the request really was cancelled
                raise
            # The function raised it on its own: passed on, it would drop the connection.
            raise ScoringError(
                500, f"reward function {spec.name!r} raised CancelledError although nothing "
                "cancelled it") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            # BaseException too: a SystemExit raised in a worker would otherwise stop the server.
            raise ScoringError(
                500, f"reward function {spec.name!r} raised {type(exc).__name__}: {exc}"
            ) from None
        finally:
            if pooled and spec.executor == "thread":
                assert self._thread_slots is not None
                self._thread_slots.release()  # an abandoned call frees its slot too
        try:
            return validate_result(spec.name, result)
        except InvalidRewardError as exc:
            raise ScoringError(422, str(exc)) from None

    def close(self) -> None:
        """Kill the worker processes; abandon thread calls still running (daemon threads)."""
        self._closed = True
        for task in self._spawning:
            task.cancel()
        procs, self._procs = self._procs, []
        for pool in procs:
            _terminate(pool)

    def wait_threads(self, timeout_s: float) -> int:
        """After :meth:`close`, wait up to ``timeout_s`` for running thread calls to finish.

        Returns the number still running (calls that timed out and never returned; they are
        daemon threads and do not keep the interpreter alive).
        """
        return self._threads.wait(timeout_s)
