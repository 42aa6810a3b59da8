"""Health of the controller's event loop: lag monitor, garbage-collection policy and pauses.

One asyncio process drives every trajectory, so anything that holds the loop (a long callback, a
garbage-collection pass) delays every trajectory's next request at once. This module measures
that and keeps the collector's share of it small:

- :class:`LoopLagMonitor`: a task that sleeps ``interval_s`` and records how late it wakes
  (milliseconds); :meth:`LoopLagMonitor.take` gives p50 / p99 / max since the last call (one
  training step). Cost: one timer per ``interval_s`` (20 wake-ups per second by default).
- :func:`tune_gc` / :func:`freeze_startup_objects`: the collector policy of the controller
  process (``GC_THRESHOLDS``), and ``gc.freeze()`` after start-up, which moves imported
  modules, the config and the cluster's clients out of every later collection.
- :class:`GcPauses`: ``gc.callbacks`` timing of every collection (count and seconds per
  generation, longest pause), for benchmarks and logs.

Not for virtual-clock (looptime) runs: a periodic timer would keep a virtual loop from ever
being idle, so the controller only monitors when given a monitor.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import math
import time
from typing import Any

__all__ = ["GcPauses", "LagStats", "LoopLagMonitor", "freeze_startup_objects", "tune_gc"]

#: generation thresholds of :func:`tune_gc` (CPython's default is (700, 10, 10)). Measured with
#: ``benchmarks.controller_overhead --quick`` at 10k trajectories (4k-token contexts held as
#: Python lists; 2-core machine under load): the default spent 46-50% of the window in
#: collections, 2-5 full (generation-2) ones each traversing every held token, longest pause
#: 4-7 s; (700, 10, 1000) 21% (generation 1 now dominant), (50k, 20, 20) 7% but a 2.9 s
#: generation-0 pause (the young generation then holds thousands of new token lists);
#: (10k, 50, 100) 8%, no generation-1/2 pass in the window, longest pause 1.45 s. A full
#: collection needs 50 x 100 generation-0 passes (and, by CPython's own rule, 25% of the
#: long-lived objects being new), so it is rare, not disabled: cyclic garbage that reached
#: generation 2 is still freed.
GC_THRESHOLDS = (10_000, 50, 100)


class LagStats:
    """Event-loop lag over a window, milliseconds (``count`` wake-ups measured)."""

    __slots__ = ("count", "max_ms", "p50_ms", "p99_ms")

    def __init__(self, samples_ms: list[float]) -> None:
        xs = sorted(samples_ms)
        self.count = len(xs)
        self.p50_ms = _quantile(xs, 0.50)
        self.p99_ms = _quantile(xs, 0.99)
        self.max_ms = xs[-1] if xs else 0.0

    def __repr__(self) -> str:
        return (f"LagStats(count={self.count}, p50_ms={self.p50_ms:.3f}, "
                f"p99_ms={self.p99_ms:.3f}, max_ms={self.max_ms:.3f})")


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank quantile (0.0 for no samples)."""
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


class LoopLagMonitor:
    """Measures how late the running loop wakes a task that sleeps ``interval_s`` seconds.

    The lag of one wake-up is ``wake time - (sleep start + interval_s)`` (seconds of
    ``time.perf_counter``, recorded in ms, never negative). A loop held for ``B`` seconds by a
    blocking callback yields a wake-up at least ``B - interval_s`` late.

    Args:
        interval_s: sleep between probes (> 0).
        max_samples: most recent samples kept between two :meth:`take` calls (memory bound).

    Raises:
        ValueError: ``interval_s <= 0`` or ``max_samples < 1``.
    """

    def __init__(self, interval_s: float = 0.05, max_samples: int = 100_000) -> None:
        if not interval_s > 0:
            raise ValueError(f"LoopLagMonitor: interval_s must be > 0, got {interval_s}")
        if max_samples < 1:
            raise ValueError(f"LoopLagMonitor: max_samples must be >= 1, got {max_samples}")
        self.interval_s = interval_s
        self._samples: collections.deque[float] = collections.deque(maxlen=max_samples)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start probing on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe(), name="loop-lag")

    async def stop(self) -> None:
        """Stop probing (samples are kept for a last :meth:`take`)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def take(self) -> LagStats:
        """Lag statistics of the wake-ups since the last call; clears them."""
        samples = list(self._samples)
        self._samples.clear()
        return LagStats(samples)

    async def _probe(self) -> None:
        interval, clock, record = self.interval_s, time.perf_counter, self._samples.append
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            record(max(0.0, clock() - due) * 1e3)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Set the process's collector thresholds (see ``GC_THRESHOLDS``); call at start-up."""
    gc.set_threshold(*thresholds)


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now to the permanent generation
    (``gc.freeze``), so later collections never traverse start-up state again. Call once the
    process is set up (modules imported, clients connected), before the rollout starts."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Times every garbage collection through ``gc.callbacks`` while installed.

    ``seconds[g]`` / ``count[g]``: total pause seconds (wall clock, ``time.perf_counter``) /
    collections of generation ``g`` (0-2); ``max_s``: longest single pause (wall);
    ``cpu_seconds[g]``: the collecting thread's CPU seconds (``time.thread_time``) in those
    pauses: the collector's own work, which, unlike the wall-clock pause, does not stretch
    when the thread is descheduled (a loaded machine, a VM's CPU steal). Use as a context
    manager or ``install`` / ``remove``.
    """

    def __init__(self) -> None:
        self.reset()
        self._t0 = self._cpu0 = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            self._cpu0 = time.thread_time()
            return
        dt = time.perf_counter() - self._t0
        g = info["generation"]
        self.seconds[g] += dt
        self.cpu_seconds[g] += time.thread_time() - self._cpu0
        self.count[g] += 1
        self.max_s = max(self.max_s, dt)

    def reset(self) -> None:
        self.seconds, self.count, self.max_s = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        self.cpu_seconds = [0.0, 0.0, 0.0]

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    def install(self) -> GcPauses:
        gc.callbacks.append(self._cb)
        return self

    def remove(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def __enter__(self) -> GcPauses:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()
