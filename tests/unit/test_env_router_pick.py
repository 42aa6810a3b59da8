"""``EnvRouter`` opens a session on its only host without comparing loads, refuses a dead one
(fatal ``EnvHostsExhaustedError``), and spreads sessions over several hosts by open count."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollart.controller.services import EnvHostsExhaustedError, EnvRouter
from rollart.transport import messages as m


class FakeHost:
    def __init__(self, name: str, dead: bool = False) -> None:
        self.name, self.dead, self.opened = name, dead, 0

    async def open(self, env_name: str, seed: int, options: Any = None, *,
                   timeout_s: float | None = None) -> m.EnvOpened:
        self.opened += 1
        return m.EnvOpened(session_id=f"{self.name}-{self.opened}", observation="o")

    async def step(self, session_id: str, action: str, *, timeout_s: float | None = None
                   ) -> m.EnvStepResult:
        raise NotImplementedError

    async def close_session(self, session_id: str) -> None:
        return None


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
