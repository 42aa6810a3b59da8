"""Sync calls on daemon threads that an awaiting caller may give up on (abandon).

Shared by the controller's in-process envs and rewards (``rollart.controller.rollout.offloop``) and the
reward service's thread functions (``rollart.reward.runner``): a thread cannot be killed, so a
caller that stops waiting (its deadline passed, or it was cancelled) *abandons* the call. The
call is then counted in ``num_hung`` until it returns, its result is discarded with a log line,
and the owner bounds how many may hang at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class _Call:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fut: asyncio.Future[Any] = loop.create_future()
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False

    def settle(self, ok: bool, value: Any) -> None:
        if self.fut.done():
            return
        if ok:
            self.fut.set_result(value)
        else:
            self.fut.set_exception(value)


class AbandonableThreads:
    """Runs each call on a fresh daemon thread named ``{prefix}-N``; ``what`` names the calls
    in log lines. Slots and limits are the owner's: this only counts hung calls."""

    def __init__(self, prefix: str, what: str) -> None:
        self.prefix, self.what = prefix, what
        #: calls abandoned by their caller and still running (gauge)
        self.num_hung = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()

    async def run(self, fn: Callable[..., Any], args: tuple, name: str) -> Any:
        """``fn(*args)`` on a new daemon thread; returns its result or raises what it raised
        (any ``BaseException``, ``CancelledError`` included: the caller tells it from its own
        cancellation). Cancelling the caller abandons the call."""
        call = _Call(asyncio.get_running_loop())
        threading.Thread(target=self._main, args=(call, fn, args, name),
                         name=f"{self.prefix}-{next(self._ids)}", daemon=True).start()
        try:
            return await call.fut
        except asyncio.CancelledError:
            with call.lock:
                if not call.finished:
                    call.abandoned = True
                    with self._lock:
                        self.num_hung += 1
                    log.warning("%s call %s abandoned past its deadline (%d hung)",
                                self.what, name, self.num_hung)
            raise

    def _main(self, call: _Call, fn: Callable[..., Any], args: tuple, name: str) -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            ok, value = False, exc
        with call.lock:
            call.finished = True
            if call.abandoned:
                with self._lock:
                    self.num_hung -= 1
                log.warning("%s call %s returned after its deadline; result discarded",
                            self.what, name)
                return
        try:
            call.loop.call_soon_threadsafe(call.settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for this process's ``prefix`` threads to finish;
        returns how many are still running (daemon threads: they never keep the interpreter
        alive)."""
        deadline = time.monotonic() + timeout_s
        alive = 0
        for t in threading.enumerate():
            if t.name.startswith(self.prefix):
                t.join(max(0.0, deadline - time.monotonic()))
                alive += t.is_alive()
        return alive
