"""SIGTERM stops a run as Ctrl-C does: every process it started is stopped before it exits.

Without a handler, SIGTERM (``timeout``, a scheduler, ``kill``) ends the Python process at
once: ``async with open_cluster(...)`` never exits, so its services' process groups are never
stopped; each service only gets its parent-death signal, and what *it* started (vLLM's engine
core, a reward process pool) can outlive the run. :func:`sigterm_cancels` turns SIGTERM into a
cancellation of the task that runs the cluster, so ``open_cluster``'s exit (or any ``finally``
around a ``Supervisor``) stops every process group, then raises :class:`Terminated`.

Every program that starts real services uses it: ``rollart run`` (with its
``--checkpoint-on-interrupt`` as ``intercept``), ``benchmarks.real_engine`` and the benchmarks'
``--scenario`` runs (:func:`run_stopping_on_sigterm`). ``open_cluster`` itself does not install
it: a signal's handler belongs to the program's main thread and is one per process, which a
library context manager cannot assume (a driver script may run it in a thread, or handle
SIGTERM its own way).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

#: exit status of a process stopped by SIGTERM (the shell's 128 + signal number)
EXIT_CODE = 128 + signal.SIGTERM


class Terminated(Exception):
    """SIGTERM stopped the run; the cleanup of the cancelled task (every ``finally``, every
    ``async with`` exit) has run."""

    def __init__(self) -> None:
        super().__init__("terminated by SIGTERM")


@contextlib.contextmanager
def sigterm_cancels(intercept: Callable[[], bool] | None = None) -> Iterator[None]:
    """While the ``with`` block runs, SIGTERM cancels the current task; once the cancellation
    has unwound the block, :class:`Terminated` is raised in its place.

    ``intercept()`` is asked first on every SIGTERM; True means it handled that signal (e.g.
    "finish this step, checkpoint, then stop") and nothing is cancelled. A SIGTERM after the
    first cancellation is ignored, so a second signal cannot interrupt the cleanup it waits for
    (``Supervisor.stop_all`` is bounded by its own timeouts; SIGKILL still stops at once).

    Must be entered in a task of a running loop in the main thread (``add_signal_handler``).
    The handler is removed on exit (SIGTERM's default action again).

    Raises:
        Terminated: SIGTERM cancelled the block (or arrived while it finished anyway).
        RuntimeError: no current task.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("sigterm_cancels: not inside a task")
    signalled = False

    def on_sigterm() -> None:
        nonlocal signalled
        if signalled or (intercept is not None and intercept()):
            return
        signalled = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        yield
    except asyncio.CancelledError:
        if not signalled:
            raise
        task.uncancel()  # the cancellation was ours: it ends here as Terminated
        raise Terminated from None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    if signalled:  # the block finished before the cancellation reached an await
        task.uncancel()
        raise Terminated


def run_stopping_on_sigterm(coro: Coroutine[Any, Any, Any], *,
                            run: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run
                            ) -> Any:
    """``run(coro)`` (``asyncio.run``, or e.g. ``uvloop.run``) under :func:`sigterm_cancels`:
    returns what ``coro`` returns; on SIGTERM, once its cleanup has run, raises
    ``SystemExit(143)`` (:data:`EXIT_CODE`). Must run in the main thread."""

    async def main() -> Any:
        with sigterm_cancels():
            return await coro

    try:
        return run(main())
    except Terminated:
        raise SystemExit(EXIT_CODE) from None
