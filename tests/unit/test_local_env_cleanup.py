"""In-process envs are closed on every path: a reset that raises, times out (sync: closed when
the abandoned thread returns, never under it; async: at once), returns a malformed result, or is
cancelled; a factory that returns after its deadline; a step that raises, times out or returns a
malformed result. Each case counts the envs built and closed (closed exactly once)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from rollart.controller.rollout.localenv import LocalEnvBackend
from rollart.controller.rollout.offloop import OffLoopCalls
from rollart.transport.errors import EnvError, InvalidActionError

WAIT_S = 60.0  # generous: the machine running the tests may be loaded


class CountingEnvFactory:
    """Builds ``CountingEnv``s behaving as ``reset`` / ``step`` say; counts builds and closes.

    ``reset`` / ``step``: "ok", "raise", "malformed", "block" (sync, until ``release``), "hang"
    (async, forever), "invalid" (step: InvalidActionError), "end" (step: episode over).
    """

    def __init__(self, reset: str = "ok", step: str = "ok", factory_blocks: bool = False) -> None:
        self.reset, self.step, self.factory_blocks = reset, step, factory_blocks
        self.built = 0
        self.closes = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # unblocks "block" calls and a blocking factory
        self.entered = threading.Event()  # a "block" call has started
        self.closed = threading.Event()  # at least one close happened
        self.closed_while_running = False

    def __call__(self, **options: Any) -> Any:
        if self.factory_blocks:
            self.entered.set()
            self.release.wait(WAIT_S)
        with self.lock:
            self.built += 1
        if self.reset == "hang" or self.step == "hang":
            return CountingAsyncEnv(self)
        return CountingEnv(self)

    def wait_closed(self) -> None:
        assert self.closed.wait(WAIT_S), "the env was never closed"


class CountingEnv:
    def __init__(self, f: CountingEnvFactory) -> None:
        self.f, self.running = f, False

    def _behave(self, how: str, ok: Any) -> Any:
        if how == "raise":
            raise RuntimeError("env broke")
        if how == "malformed":
            return 42
        if how == "invalid":
            raise InvalidActionError("bad action")
        if how == "block":
            self.running = True
            self.f.entered.set()
            self.f.release.wait(WAIT_S)
            self.running = False
        return ok

    def reset(self, seed: int) -> Any:
        return self._behave(self.f.reset, ("obs", {}))

    def step(self, action: str) -> Any:
        return self._behave(self.f.step, ("obs", 0.0, self.f.step == "end", False, {}))

    def close(self) -> None:
        with self.f.lock:
            self.f.closes += 1
            self.f.closed_while_running |= self.running
        self.f.closed.set()


class CountingAsyncEnv(CountingEnv):
    async def reset(self, seed: int) -> Any:  # type: ignore[override]
        if self.f.reset == "hang":
            await asyncio.Event().wait()
        return ("obs", {})

    async def step(self, action: str) -> Any:  # type: ignore[override]
        await asyncio.Event().wait()


def backend(f: CountingEnvFactory) -> LocalEnvBackend:
    return LocalEnvBackend({"e": f}, OffLoopCalls(max_threads=4, what="local env"))


@pytest.mark.parametrize("how,code", [("raise", "env_error"), ("malformed", "env_error")])
async def test_a_reset_that_fails_closes_its_env(how: str, code: str) -> None:
    f = CountingEnvFactory(reset=how)
    envs = backend(f)
    for seed in range(5):
        with pytest.raises(EnvError) as err:
            await envs.open("e", seed, timeout_s=WAIT_S)
        assert err.value.code == code
    assert (f.built, f.closes, envs.num_open) == (5, 5, 0)


async def test_a_sync_reset_past_its_deadline_is_closed_when_its_thread_returns() -> None:
    f = CountingEnvFactory(reset="block")
    envs = backend(f)
    try:
        with pytest.raises(EnvError) as err:
            await envs.open("e", 0, timeout_s=0.2)
        assert err.value.code == "env_timeout"
        assert f.entered.is_set() and f.closes == 0  # not closed under the running reset
    finally:
        f.release.set()
    await asyncio.to_thread(f.wait_closed)
    assert (f.built, f.closes, f.closed_while_running, envs.num_open) == (1, 1, False, 0)


async def test_an_async_reset_past_its_deadline_is_closed_at_once() -> None:
    f = CountingEnvFactory(reset="hang")
    envs = backend(f)
    with pytest.raises(EnvError, match="no result within"):
        await envs.open("e", 0, timeout_s=0.2)
    assert (f.built, f.closes) == (1, 1)


async def test_a_factory_returning_after_its_deadline_has_its_env_closed() -> None:
    f = CountingEnvFactory(factory_blocks=True)
    envs = backend(f)
    try:
        with pytest.raises(EnvError) as err:
            await envs.open("e", 0, timeout_s=0.2)
        assert err.value.code == "env_timeout"
    finally:
        f.release.set()
    await asyncio.to_thread(f.wait_closed)
    assert (f.built, f.closes) == (1, 1)


async def test_an_open_cancelled_during_reset_closes_its_env_after_the_reset() -> None:
    f = CountingEnvFactory(reset="block")
    envs = backend(f)
    task = asyncio.create_task(envs.open("e", 0, timeout_s=WAIT_S))
    try:
        assert await asyncio.to_thread(f.entered.wait, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert f.closes == 0
    finally:
        f.release.set()
    await asyncio.to_thread(f.wait_closed)
    assert (f.built, f.closes, f.closed_while_running) == (1, 1, False)


@pytest.mark.parametrize("how,code", [("raise", "env_error"), ("malformed", "env_error")])
async def test_a_step_that_fails_closes_its_session(how: str, code: str) -> None:
    f = CountingEnvFactory(step=how)
    envs = backend(f)
    opened = await envs.open("e", 0, timeout_s=WAIT_S)
    with pytest.raises(EnvError) as err:
        await envs.step(opened.session_id, "a", timeout_s=WAIT_S)
    assert err.value.code == code
    assert (f.built, f.closes, envs.num_open) == (1, 1, 0)
    await envs.close_session(opened.session_id)  # what the trajectory's cleanup does: a no-op
    assert f.closes == 1


async def test_a_step_past_its_deadline_closes_its_session_when_the_step_returns() -> None:
    f = CountingEnvFactory(step="block")
    envs = backend(f)
    opened = await envs.open("e", 0, timeout_s=WAIT_S)
    try:
        with pytest.raises(EnvError) as err:
            await envs.step(opened.session_id, "a", timeout_s=0.2)
        assert err.value.code == "env_timeout"
        await envs.close_session(opened.session_id)
        assert f.closes == 0  # not under the running step
    finally:
        f.release.set()
    await asyncio.to_thread(f.wait_closed)
    assert (f.built, f.closes, f.closed_while_running, envs.num_open) == (1, 1, False, 0)


async def test_an_async_step_past_its_deadline_closes_its_session() -> None:
    f = CountingEnvFactory(step="hang")
    envs = backend(f)
    opened = await envs.open("e", 0, timeout_s=WAIT_S)
    with pytest.raises(EnvError, match="no result within"):
        await envs.step(opened.session_id, "a", timeout_s=0.2)
    assert (f.built, f.closes, envs.num_open) == (1, 1, 0)


async def test_an_invalid_action_keeps_the_session_and_the_last_step_closes_it() -> None:
    f = CountingEnvFactory(step="invalid")
    envs = backend(f)
    opened = await envs.open("e", 0, timeout_s=WAIT_S)
    with pytest.raises(InvalidActionError):
        await envs.step(opened.session_id, "a", timeout_s=WAIT_S)
    assert (f.closes, envs.num_open) == (0, 1)
    f.step = "end"
    result = await envs.step(opened.session_id, "a", timeout_s=WAIT_S)
    assert result.closed and (f.built, f.closes, envs.num_open) == (1, 1, 0)


async def test_async_factories_and_factories_returning_awaitables_still_work() -> None:
    f = CountingEnvFactory(reset="raise")

    async def async_factory() -> CountingEnv:
        return f()

    def awaitable_factory():
        return async_factory()

    envs = LocalEnvBackend({"a": async_factory, "b": awaitable_factory})
    for name in ("a", "b"):
        with pytest.raises(EnvError, match="env broke"):
            await envs.open(name, 0, timeout_s=WAIT_S)
    assert (f.built, f.closes) == (2, 2)
