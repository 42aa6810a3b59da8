"""Scripted solvers: the next action for an env given the conversation so far.

Used by tests (an episode played by a solver must end in a win) and to produce supervised
warm-up demonstrations. A conversation is the observations the env returned and the actions
taken: ``observations[0]`` is the reset observation and ``observations[i]`` the one returned by
``actions[i - 1]``, so ``len(observations) == len(actions) + 1``. ``info`` is the reset info
(``EnvOpened.info``); reasoning-gym solvers need it to regenerate the entry.

Supported: ``game:GuessTheNumber-*`` (bisection on the higher/lower hints, which wins within
``ceil(log2(range + 1))`` guesses: 4 for the easy variant's 1..10 in 4 turns) and every ``rg:*``
dataset (the entry's reference answer).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rollart.envhost.families import rg_entry

_RANGE = re.compile(r"between (-?\d+) and (-?\d+)")
_HINT = re.compile(r"you guessed (-?\d+), and the target number is (higher|lower) than")


class NoSolverError(ValueError):
    """No scripted solver exists for this env, or the conversation cannot be read by it."""


def has_solver(env_name: str) -> bool:
    """Whether ``next_action`` supports ``env_name``."""
    return env_name.startswith(("game:GuessTheNumber-", "rg:"))


def next_action(
    env_name: str,
    observations: Sequence[str],
    actions: Sequence[str],
    info: Mapping[str, Any] | None = None,
) -> str:
    """The solver's next action text (a ``\\boxed{...}`` answer) for ``env_name``.

    Raises:
        ValueError: ``len(observations) != len(actions) + 1``.
        NoSolverError: no solver for ``env_name``, or the conversation / info lacks what the
            solver needs (e.g. an ``rg:`` call without the reset info).
    """
    if len(observations) != len(actions) + 1:
        raise ValueError(
            f"expected len(observations) == len(actions) + 1, got {len(observations)} "
            f"observations and {len(actions)} actions"
        )
    if env_name.startswith("game:GuessTheNumber-"):
        return f"\\boxed{{{bisection_guess(observations)}}}"
    if env_name.startswith("rg:"):
        return f"\\boxed{{{reasoning_gym_answer(env_name, info)}}}"
    raise NoSolverError(f"no scripted solver for {env_name!r}")


def bisection_guess(observations: Sequence[str]) -> int:
    """Midpoint of the range still consistent with GuessTheNumber's hints.

    Raises:
        NoSolverError: the first observation states no range, or the hints contradict each other.
    """
    lo, hi = consistent_range(observations)
    return (lo + hi) // 2


def exploring_action(
    env_name: str, observations: Sequence[str], rng: random.Random
) -> str | None:
    """A random move for exploring demonstrations, one that ignores the conversation: for
    ``game:GuessTheNumber-*`` a guess drawn uniformly from the game's whole range (stated in
    the first observation), whatever the hints say. A habit that needs no reading of the
    hints is one a small policy can learn from demonstrations exactly, and one that reward
    alone can teach it to drop; ``None`` for envs without one (``rg:*``: a random answer is
    not a move).

    Raises:
        NoSolverError: the first observation states no range.
    """
    if not env_name.startswith("game:GuessTheNumber-"):
        return None
    lo, hi = consistent_range(observations[:1])
    return f"\\boxed{{{rng.randint(lo, hi)}}}"


def consistent_range(observations: Sequence[str]) -> tuple[int, int]:
    """The inclusive range ``(lo, hi)`` of targets still consistent with GuessTheNumber's
    hints.

    Raises:
        NoSolverError: the first observation states no range, or the hints contradict each other.
    """
    found = _RANGE.search(observations[0])
    if found is None:
        raise NoSolverError("GuessTheNumber: the first observation states no 'between A and B'")
    lo, hi = int(found.group(1)), int(found.group(2))
    for obs in observations[1:]:
        for guess, direction in _HINT.findall(obs):
            if direction == "higher":
                lo = max(lo, int(guess) + 1)
            else:
                hi = min(hi, int(guess) - 1)
    if lo > hi:
        raise NoSolverError(f"GuessTheNumber: hints leave an empty range [{lo}, {hi}]")
    return lo, hi


def reasoning_gym_answer(env_name: str, info: Mapping[str, Any] | None) -> str:
    """The reference answer of the entry an ``rg:`` session serves, regenerated from its reset
    info (``dataset``, ``seed``, ``config``).

    Raises:
        NoSolverError: ``info`` lacks ``seed`` or names another dataset.
    """
    dataset = env_name.partition(":")[2]
    if not info or "seed" not in info:
        raise NoSolverError(f"{env_name}: the solver needs the reset info (with 'seed')")
    if info.get("dataset", dataset) != dataset:
        raise NoSolverError(f"{env_name}: reset info is for dataset {info['dataset']!r}")
    return str(rg_entry(dataset, int(info["seed"]), info.get("config") or {})["answer"])
