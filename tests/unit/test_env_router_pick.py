"""``EnvRouter`` opens a session on its only host without comparing loads, refuses a dead one
(fatal ``EnvHostsExhaustedError``), spreads sessions over several hosts by open count, and sends
no ``EnvClose`` for a session its host closed when the episode ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollart.controller.routing.routers import EnvHostsExhaustedError, EnvRouter, LocalEnvBackend
from rollart.transport import messages as m


class FakeHost:
    def __init__(self, name: str, dead: bool = False) -> None:
        self.name, self.dead, self.opened = name, dead, 0
        self.closes: list[str] = []
        self.ends_with_close = False  # what EnvStepResult.closed says

    async def open(self, env_name: str, seed: int, options: Any = None, *,
                   timeout_s: float | None = None) -> m.EnvOpened:
        self.opened += 1
        return m.EnvOpened(session_id=f"{self.name}-{self.opened}", observation="o")

    async def step(self, session_id: str, action: str, *, timeout_s: float | None = None
                   ) -> m.EnvStepResult:
        return m.EnvStepResult(session_id=session_id, observation="", reward=0.0,
                               terminated=True, truncated=False, closed=self.ends_with_close)

    async def close_session(self, session_id: str) -> None:
        self.closes.append(session_id)


def test_one_host_and_a_dead_one() -> None:
    host = FakeHost("h")
    router = EnvRouter([host])
    assert asyncio.run(router.open("e", 0)).session_id == "h-1"
    host.dead = True
    with pytest.raises(EnvHostsExhaustedError, match="no live env host"):
        asyncio.run(router.open("e", 0))


def test_several_hosts_least_open_first() -> None:
    hosts = [FakeHost("a"), FakeHost("b"), FakeHost("c", dead=True)]
    router = EnvRouter(hosts)

    async def main() -> list[str]:
        return [(await router.open("e", i)).session_id for i in range(4)]

    assert asyncio.run(main()) == ["a-1", "b-1", "a-2", "b-2"]


def test_a_session_the_host_closed_with_its_last_step_is_not_closed_again() -> None:
    hosts = [FakeHost("a"), FakeHost("b")]
    router = EnvRouter(hosts)

    async def main() -> None:
        old = await router.open("e", 0)  # on a: an older host, whose replies say closed=False
        hosts[1].ends_with_close = True
        new = await router.open("e", 1)  # on b
        for sid in (old.session_id, new.session_id):
            await router.step(sid, "x")
            await router.close_session(sid)
        # b closed its session itself and is no longer counted as holding it
        assert (hosts[0].closes, hosts[1].closes) == (["a-1"], [])
        assert (await router.open("e", 2)).session_id == "a-2"
        assert (await router.open("e", 3)).session_id == "b-2"

    asyncio.run(main())


def test_an_in_process_env_closes_with_the_step_that_ends_it() -> None:
    closed: list[int] = []

    class OneStep:
        def reset(self, seed: int) -> tuple[str, dict]:
            self.seed = seed
            return "o", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            return "done", 1.0, True, False, {}

        def close(self) -> None:
            closed.append(self.seed)

    router = EnvRouter([], LocalEnvBackend({"one": OneStep}))

    async def main() -> m.EnvStepResult:
        s = await router.open("one", 5)
        result = await router.step(s.session_id, "x")
        await router.close_session(s.session_id)  # nothing left to close
        return result

    result = asyncio.run(main())
    assert (result.terminated, result.closed) == (True, True) and closed == [5]
