"""Runs reward functions off the event loop, under a timeout, and classifies every failure.

Async functions run on the loop; sync ones run inline (trivial functions only), in a thread
pool, or in a process pool (CPU-bound scoring: sympy holds the GIL, so threads would stall the
server). Every call is bounded by the function's ``timeout_s``, which includes queueing for a pool
slot. A timed-out thread or process task cannot be killed: the caller gets its 504 at once, but
the pool slot stays busy until the task returns (the built-in math scorer bounds itself with
math-verify's own timeouts; user functions should bound themselves too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rollart.reward.protocol import InvalidRewardError, RewardResponse, validate_result
from rollart.reward.registry import RewardFunction, RewardInputError

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


class RewardRunner:
    """Owns the thread and process pools of one service.

    Args:
        num_threads: thread-pool size for ``executor="thread"`` functions.
        num_processes: process-pool size for ``executor="process"`` functions (spawned, not
            forked: forking a process that runs an event loop and threads is unsafe).
        default_timeout_s: limit for functions that do not set ``timeout_s``, in seconds.
        warm_up: pre-import math-verify and reasoning-gym in each worker process.
    """

    def __init__(
        self,
        *,
        num_threads: int = 8,
        num_processes: int | None = None,
        default_timeout_s: float = 30.0,
        warm_up: bool = True,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        self.num_processes = num_processes or max(1, min(4, os.cpu_count() or 1))
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.default_timeout_s = default_timeout_s
        self._threads = cf.ThreadPoolExecutor(num_threads, thread_name_prefix=THREAD_PREFIX)
        self._warm_up = warm_up
        self._processes: cf.ProcessPoolExecutor | None = None

    def _process_pool(self) -> cf.ProcessPoolExecutor:
        # Created lazily: a service that only serves thread/async functions never spawns workers.
        if self._processes is None:
            self._processes = cf.ProcessPoolExecutor(
                self.num_processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_warm_up if self._warm_up else None,
            )
        return self._processes

    def start_process_pool(self) -> None:
        """Spawn the worker processes now (instead of on the first process-pool call)."""
        pool = self._process_pool()
        for _ in range(self.num_processes):
            pool.submit(int)

    async def score(
        self, spec: RewardFunction, prompt: str, response: str, reference: Any, metadata: dict
    ) -> RewardResponse:
        """Run ``spec`` on one request and validate the result.

        Raises:
            ScoringError: 422 (RewardInputError or invalid reward), 500 (the function raised),
                503 (process pool broken; it is rebuilt for later calls), 504 (timeout).
        """
        timeout_s = spec.timeout_s if spec.timeout_s is not None else self.default_timeout_s
        args = (prompt, response, reference, metadata)
        deadline = asyncio.timeout(timeout_s)
        pool: cf.ProcessPoolExecutor | None = None
        try:
            async with deadline:
                if spec.is_async:
                    result = await spec.fn(*args)
                elif spec.executor == "inline":
                    result = spec.fn(*args)
                elif spec.executor == "thread":
                    loop = asyncio.get_running_loop()
                    result = await loop.run_in_executor(
                        self._threads, functools.partial(_call, spec.fn, *args)
                    )
                else:
                    loop = asyncio.get_running_loop()
                    pool = self._process_pool()
                    result = await loop.run_in_executor(
                        pool, functools.partial(_call, spec.fn, *args)
                    )
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
        except BrokenProcessPool as exc:
            # A worker died (e.g. OOM-killed): the pool is unusable; start a fresh one next call.
            # Only the first failed call replaces it; others may already see the new pool.
            if pool is not None and pool is self._processes:
                self._processes = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ScoringError(
                503, f"reward function {spec.name!r}: process pool broken ({exc}); retry"
            ) from None
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except BaseException as exc:
            # BaseException too: a SystemExit raised in a worker would otherwise stop the server.
            raise ScoringError(
                500, f"reward function {spec.name!r} raised {type(exc).__name__}: {exc}"
            ) from None
        try:
            return validate_result(spec.name, result)
        except InvalidRewardError as exc:
            raise ScoringError(422, str(exc)) from None

    def close(self) -> None:
        """Shut the pools down without waiting for timed-out tasks still running."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            pool, self._processes = self._processes, None
            # A hung task would otherwise block interpreter exit (concurrent.futures joins its
            # workers at exit); 3.11 has no public terminate, so use the executor's process map.
            procs = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()

    def wait_threads(self, timeout_s: float) -> int:
        """After :meth:`close`, wait up to ``timeout_s`` for pool threads to finish.

        Returns the number still running: calls that timed out earlier and never returned, which
        would otherwise keep the interpreter from exiting (pool threads are joined at exit).
        """
        deadline = time.monotonic() + timeout_s
        alive = []
        for t in threading.enumerate():
            if t.name.startswith(THREAD_PREFIX):
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    alive.append(t)
        return len(alive)
