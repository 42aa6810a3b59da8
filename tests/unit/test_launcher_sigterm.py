"""``rollart.launcher.sigterm``: SIGTERM cancels the task running the cluster, its cleanup runs,
then ``Terminated`` (``SystemExit(143)`` from ``run_stopping_on_sigterm``). The signals are
real (``os.kill`` of this process); the handler is removed again afterwards."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rollart.launcher.sigterm import Terminated, run_stopping_on_sigterm, sigterm_cancels


async def _loop_turns(n: int = 10) -> None:
    # A self-signal is read from the loop's wakeup pipe and its handler runs within a couple of
    # loop iterations (asyncio's unix loop); enough turns for it, independent of machine load.
    for _ in range(n):
        await asyncio.sleep(0)


def test_sigterm_cancels_then_cleans_up_then_exits_143() -> None:
    cleaned: list[str] = []

    async def cluster_run() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.Event().wait()  # never set: only the cancellation ends it
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one must not cut the cleanup short
            await _loop_turns()
            cleaned.append("services stopped")

    with pytest.raises(SystemExit) as stopped:
        run_stopping_on_sigterm(cluster_run())
    assert stopped.value.code == 143 and cleaned == ["services stopped"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handler removed again
    assert run_stopping_on_sigterm(asyncio.sleep(0, result=7)) == 7


def test_intercept_handles_the_first_signal_the_next_cancels() -> None:
    seen: list[str] = []

    def intercept() -> bool:
        seen.append("signal")
        return len(seen) == 1  # the first: "finish the step", nothing cancelled

    async def main() -> None:
        with sigterm_cancels(intercept):
            os.kill(os.getpid(), signal.SIGTERM)
            await _loop_turns()
            seen.append("still running")
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.Event().wait()

    with pytest.raises(Terminated):
        asyncio.run(main())
    assert seen == ["signal", "still running", "signal"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_cancellation_not_from_sigterm_stays_a_cancellation() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        with sigterm_cancels():
            asyncio.get_running_loop().call_soon(task.cancel)
            await asyncio.Event().wait()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
