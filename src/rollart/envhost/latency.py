"""Latency and failure injection for env steps, to reproduce slow, heavy-tailed environments.

The RollArt paper (§7, see shared/notes/rollart-paper.md) studies envs whose per-turn latency has
mean 10 s and std 1..10 s; a ``LatencyConfig`` per env family reproduces that on cheap envs.
Every draw is a pure function of ``(config.seed, session key, step index)``, so a scenario
replays the same delays and injected failures whatever the interleaving of sessions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

import msgspec
import numpy as np

Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)]


class LatencyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Per-step delay distribution and failure rate of one env family.

    Fields:
        distribution: ``none`` (no delay), ``normal`` (mean ``mean_s``, std ``std_s``),
            ``lognormal`` (the *delay's* mean and std are ``mean_s`` / ``std_s``; underlying
            ``sigma^2 = ln(1 + std^2/mean^2)``, ``mu = ln(mean) - sigma^2/2``), ``exponential``
            (mean ``mean_s``; its std equals its mean, so ``std_s`` must be left 0).
        mean_s, std_s: seconds, in [0, 3600].
        min_s, max_s: every drawn delay is clipped to [min_s, max_s] seconds (a normal draw can
            be negative; a lognormal one unbounded).
        failure_rate: probability in [0, 1] that a step fails with an injected ``env_error``
            (after its delay), failing the session like a real env crash.
        seed: base seed of the draws.
    Raises (at construction / decoding):
        ValueError (``msgspec.ValidationError`` when decoded): inconsistent parameters.
    """

    distribution: Literal["none", "normal", "lognormal", "exponential"] = "none"
    mean_s: Seconds = 0.0
    std_s: Seconds = 0.0
    min_s: Seconds = 0.0
    max_s: Seconds = 3600.0
    failure_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s ({self.min_s}) must be <= max_s ({self.max_s})")
        if self.distribution == "none":
            if self.mean_s or self.std_s:
                raise ValueError("distribution 'none' takes no mean_s / std_s")
        elif self.distribution in ("lognormal", "exponential") and self.mean_s <= 0:
            raise ValueError(f"distribution {self.distribution!r} needs mean_s > 0")
        if self.distribution == "exponential" and self.std_s:
            raise ValueError("an exponential's std equals its mean: leave std_s at 0")


def _session_digest(session_key: str) -> int:
    # Python's hash() is salted per process; a stable digest keeps draws reproducible.
    return int.from_bytes(hashlib.blake2b(session_key.encode(), digest_size=8).digest(), "big")


class LatencyModel:
    """Draws ``(delay_s, fail)`` for a step of a session under one ``LatencyConfig``."""

    def __init__(self, config: LatencyConfig) -> None:
        self.config = config
        if config.distribution == "lognormal":
            self._sigma = math.sqrt(math.log1p((config.std_s / config.mean_s) ** 2))
            self._mu = math.log(config.mean_s) - self._sigma**2 / 2

    def draw(self, session_key: str, step_index: int) -> tuple[float, bool]:
        """Delay (seconds, float in [min_s, max_s]) and whether to inject a failure, for step
        ``step_index`` (0-based) of the session identified by ``session_key``. Pure: the same
        arguments always give the same result."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, _session_digest(session_key), step_index])
        fail = bool(rng.random() < cfg.failure_rate)
        if cfg.distribution == "none":
            delay = 0.0
        elif cfg.distribution == "normal":
            delay = rng.normal(cfg.mean_s, cfg.std_s)
        elif cfg.distribution == "lognormal":
            delay = rng.lognormal(self._mu, self._sigma)
        else:
            delay = rng.exponential(cfg.mean_s)
        return float(min(max(delay, cfg.min_s), cfg.max_s)), fail


_L = TypeVar("_L")


def select_latency(latency: Mapping[str, _L], env_name: str) -> _L | None:
    """The config for ``env_name``: an exact env-name key, else its family (``game``, ``rg``,
    ``py``), else ``"*"``; ``None`` when nothing matches."""
    family = env_name.partition(":")[0]
    for key in (env_name, family, "*"):
        if key in latency:
            return latency[key]
    return None
