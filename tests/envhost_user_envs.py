"""User envs loaded by import path (``py:envhost_user_envs:Name``) in env host tests.

Importable once ``tests/`` is on ``sys.path`` (unit tests) or ``PYTHONPATH`` (host subprocess).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

#: session seeds whose env was closed, for tests checking that sessions are released
CLOSED_SEEDS: list[int] = []
_lock = threading.Lock()


class EchoEnv:
    """Multi-turn: echoes the action; reward = len(action); ends after ``max_turns`` steps."""

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns
        self.seed = -1
        self.turn = 0

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.seed = seed
        self.turn = 0
        return f"echo env, seed {seed}", {"seed": seed, "max_turns": self.max_turns}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        info = {"turn": np.int64(self.turn), "arr": np.arange(2)}
        return f"you said {action}", float(len(action)), self.turn >= self.max_turns, False, info

    def close(self) -> None:
        with _lock:
            CLOSED_SEEDS.append(self.seed)


def make_echo(max_turns: int = 3) -> EchoEnv:
    """A factory function works like a class."""
    return EchoEnv(max_turns=max_turns)


class RaisingEnv(EchoEnv):
    """Raises ``RuntimeError("boom")`` on step number ``fail_at`` (1-based)."""

    def __init__(self, fail_at: int = 1) -> None:
        super().__init__(max_turns=100)
        self.fail_at = fail_at

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.turn + 1 >= self.fail_at:
            raise RuntimeError("boom")
        return super().step(action)


class HangingEnv(EchoEnv):
    """Blocks ``hang_s`` seconds in every step whose action is ``"hang"``."""

    def __init__(self, hang_s: float = 30.0) -> None:
        super().__init__(max_turns=100)
        self.hang_s = hang_s

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "hang":
            time.sleep(self.hang_s)
        return super().step(action)


class SlowResetEnv(EchoEnv):
    """Blocks ``reset_s`` seconds in reset."""

    def __init__(self, reset_s: float = 30.0) -> None:
        super().__init__()
        self.reset_s = reset_s

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        time.sleep(self.reset_s)
        return super().reset(seed)


class NanRewardEnv(EchoEnv):
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "nan", float("nan"), False, False, {}


class BadShapeEnv(EchoEnv):
    def step(self, action: str) -> Any:
        return "only an observation"


class NotAnEnv:
    """Has no reset/step."""


class ToolCallEnv(EchoEnv):
    """Actions must be JSON objects (a tool call); anything else is rejected as an invalid action
    (the model's fault: the session goes on)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        import json

        from rollart.transport.errors import InvalidActionError

        try:
            call = json.loads(action)
        except json.JSONDecodeError as exc:
            raise InvalidActionError(f"tool call is not JSON: {exc}") from None
        return super().step(str(call.get("tool")))


class StrayCancelEnv(EchoEnv):
    """Env code that raises ``asyncio.CancelledError`` on its own (nobody cancelled it)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        import asyncio

        raise asyncio.CancelledError()
