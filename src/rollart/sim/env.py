"""SIMULATED environment host and reward service.

``SimEnvHost`` has the methods of ``rollart.envhost.client.EnvClient`` (the controller's
``EnvBackend`` port); ``SimReward`` those of ``RewardClient.score``. Observations are
``<sim:DOMAIN:N>`` texts (see ``rollart.sim.workload``), latencies are drawn from the domain's
distributions and slept on the running loop's clock.

Seeding keeps comparisons fair across controller modes: an episode's turn count depends on
``(host seed, env_name, seed)`` (so GRPO group members share it, like a shared task), and the
latencies of the ``k``-th session opened for one ``(env_name, seed)`` on turn ``t`` depend on
``(host seed, env_name, seed, k, t)`` only — not on when or in which order a mode asks.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollart.reward.client import RewardResult
from rollart.sim.workload import (
    Dist,
    DomainSpec,
    DomainTable,
    const,
    observation,
    seeded_rng,
)
from rollart.transport import messages as m
from rollart.transport.errors import EnvError, PeerDeadError, RewardError

ENV_PREFIX = "sim:"


@dataclass
class _Session:
    spec: DomainSpec
    key: tuple[Any, ...]
    num_turns: int
    turn: int = 0


def turn_draws(spec: DomainSpec, key: tuple[Any, ...], turn: int) -> tuple[float, bool, int]:
    """``(latency_s, fails, obs_tokens)`` of turn ``turn`` of the session with ``key``
    ``= (host seed, env_name, seed, k)`` (the ``k``-th session of that env and seed).
    Benchmarks call it to recompute the exact latencies a run used."""
    rng = seeded_rng(*key, "turn", turn)
    latency = spec.step_latency_s.sample(rng)
    fails = rng.random() < spec.step_failure_prob
    return latency, fails, spec.obs_tokens.sample_int(rng)


class SimEnvHost:
    """A SIMULATED env host serving the domains of ``domains`` as env ``"sim:<domain>"``.

    Args:
        name: host name.
        domains: the simulated task domains.
        seed: base seed of turn counts, latencies and failures.
        max_concurrent_steps: env steps running at once (CPU slots); ``None`` = unlimited.
        opens: session counter per ``(env_name, seed)``; pass one ``collections.Counter`` to
            every host of a run so that a group split across hosts still draws distinct
            latencies per member (each host counting from 0 would repeat them).
    """

    def __init__(self, name: str, domains: DomainTable, *, seed: int = 0,
                 max_concurrent_steps: int | None = None,
                 opens: collections.Counter[tuple[str, int]] | None = None) -> None:
        if max_concurrent_steps is not None and max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps must be >= 1 or None, got "
                             f"{max_concurrent_steps}")
        self.name, self.domains, self.seed = name, domains, seed
        self.dead = False
        self._sessions: dict[str, _Session] = {}
        self._opens = opens if opens is not None else collections.Counter()
        self._ids = itertools.count()
        self._slots = (asyncio.Semaphore(max_concurrent_steps)
                       if max_concurrent_steps is not None else None)
        self.num_steps = 0
        self.num_errors = 0
        #: every step latency drawn, in seconds (benchmarks compute ideal speedups from them)
        self.step_latencies: list[float] = []
        #: step latencies per session, in open order: (open time, [latency_s per turn])
        self.session_latencies: dict[str, tuple[float, list[float]]] = {}

    def _spec(self, env_name: str) -> DomainSpec:
        if not env_name.startswith(ENV_PREFIX):
            raise EnvError("not_found", f"{self.name}: simulated env names start with "
                           f"{ENV_PREFIX!r}, got {env_name!r}")
        try:
            return self.domains.by_name(env_name[len(ENV_PREFIX):])
        except KeyError as exc:
            raise EnvError("not_found", f"{self.name}: {exc.args[0]}") from None

    async def _sleep(self, latency_s: float, timeout_s: float | None, what: str) -> None:
        if timeout_s is not None and latency_s > timeout_s:
            await asyncio.sleep(timeout_s)
            self.num_errors += 1
            raise EnvError("env_timeout", f"{self.name}: {what} exceeded timeout_s={timeout_s}")
        await asyncio.sleep(latency_s)

    async def open(self, env_name: str, seed: int, options: dict[str, Any] | None = None, *,
                   timeout_s: float | None = None) -> m.EnvOpened:
        """Open a session of ``sim:<domain>``; raises ``EnvError`` (``not_found`` for an unknown
        domain, ``env_timeout`` when the reset latency exceeds ``timeout_s``)."""
        self._check_alive()
        spec = self._spec(env_name)
        k = self._opens[(env_name, seed)]
        self._opens[(env_name, seed)] += 1
        key = (self.seed, env_name, seed, k)
        await self._sleep(spec.reset_latency_s.sample(seeded_rng(*key, "reset")), timeout_s,
                          f"open {env_name}")
        num_turns = max(1, spec.num_turns.sample_int(seeded_rng(self.seed, env_name, seed)))
        sid = f"{self.name}-s{next(self._ids)}"
        self._sessions[sid] = _Session(spec, key, num_turns)
        self.session_latencies[sid] = (asyncio.get_running_loop().time(), [])
        obs = observation(spec.name, spec.prompt_tokens.sample_int(seeded_rng(*key, "prompt")),
                          tag=sid)
        return m.EnvOpened(session_id=sid, observation=obs,
                           info={"simulated": True, "domain": spec.name, "num_turns": num_turns})

    async def step(self, session_id: str, action: str, *,
                   timeout_s: float | None = None) -> m.EnvStepResult:
        """One simulated turn. Raises ``EnvError``: ``not_found`` (unknown session),
        ``env_error`` (injected failure, probability ``step_failure_prob``), ``env_timeout``."""
        self._check_alive()
        sess = self._sessions.get(session_id)
        if sess is None:
            raise EnvError("not_found", f"{self.name}: no session {session_id!r}")
        latency, fails, obs_tokens = turn_draws(sess.spec, sess.key, sess.turn)
        self.step_latencies.append(latency)
        self.session_latencies[session_id][1].append(latency)
        if self._slots is not None:
            async with self._slots:
                await self._sleep(latency, timeout_s, f"step {session_id}")
        else:
            await self._sleep(latency, timeout_s, f"step {session_id}")
        self.num_steps += 1
        if fails:
            self.num_errors += 1
            raise EnvError("env_error", f"{self.name}: injected failure in {session_id} turn "
                           f"{sess.turn}")
        sess.turn += 1
        done = sess.turn >= sess.num_turns
        # Closed by the host when its episode ends, as EnvHost does; one the client closed
        # during this step's latency was closed by the client, not here (closed=False).
        closed = done and self._sessions.pop(session_id, None) is not None
        return m.EnvStepResult(session_id=session_id,
                               observation="" if done else observation(sess.spec.name, obs_tokens),
                               reward=0.0, terminated=done, truncated=False,
                               info={"simulated": True, "turn": sess.turn}, closed=closed)

    async def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def stats(self) -> m.EnvHostStats:
        self._check_alive()
        return m.EnvHostStats(host=self.name, num_sessions=len(self._sessions),
                              num_steps=self.num_steps, num_errors=self.num_errors)

    async def close(self) -> None:
        self._sessions.clear()

    def kill(self) -> None:
        """Fault injection: later calls raise ``PeerDeadError``."""
        self.dead = True

    def _check_alive(self) -> None:
        if self.dead:
            raise PeerDeadError(f"simulated env host {self.name} is dead")


#: Serverless reward remote I/O per call (paper §7.5, Table 4: mean 0.01-0.02 s, max ~2 s):
#: lognormal with mean 0.015 s (the middle of the range), std 0.03 s (not given by the paper;
#: a heavy tail so that ~2 s maxima occur among thousands of calls), capped at 2.1 s (the
#: paper's reward maximum).
SERVERLESS_REWARD_LATENCY = Dist("lognormal", 0.015, 0.03, 0.0, 2.1)


class SimReward:
    """A SIMULATED reward service (``RewardBackend``): sleeps ``latency_s`` per call, returns a
    reward in {0.0, 1.0} seeded by ``(seed, prompt, response)``.

    Two shapes (paper §3 / §7.5, "reward offload"): *serverless* (``max_concurrency=None``,
    elastic: every call only pays its remote I/O ``latency_s``, e.g.
    ``SERVERLESS_REWARD_LATENCY``) and *dedicated* reward GPUs (``max_concurrency`` = number of
    GPUs, each scoring one call at a time; ``service_s(prompt, response)`` seconds of GPU work
    per call, e.g. one prefill of the sample on a reward model, queued behind earlier calls).

    Args:
        latency_s: per-call latency distribution (seconds), outside the GPU.
        failure_prob: probability that a call raises ``RewardError``.
        max_concurrency: calls served at once (reward GPUs / workers); ``None`` = elastic.
        service_s: GPU seconds a call occupies its slot (``None``: 0).
        rng: the seeded generator factory of its draws: ``seeded_rng`` (default: the draws every
            simulated benchmark's published results were made with) or ``counter_rng`` (same
            distributions, other draws, ~20 us cheaper per call: for a benchmark where this
            in-process reward's own CPU is counted, ``controller_overhead``).

    Attributes: ``num_calls``; ``busy_s`` (GPU seconds spent scoring, all slots together:
    utilisation = ``busy_s / (elapsed * max_concurrency)``).
    """

    def __init__(self, *, latency_s: Dist | None = None, seed: int = 0,
                 failure_prob: float = 0.0, max_concurrency: int | None = None,
                 service_s: Callable[[str, str], float] | None = None,
                 rng: Callable[..., random.Random] = seeded_rng) -> None:
        if not 0.0 <= failure_prob <= 1.0:
            raise ValueError(f"failure_prob must be in [0, 1], got {failure_prob}")
        self.latency_s = latency_s or const(0.0)
        self.seed, self.failure_prob = seed, failure_prob
        self.max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._service_s = service_s
        self._rng = rng
        self._calls = itertools.count()
        self.num_calls = 0
        self.busy_s = 0.0

    async def score(self, name: str, prompt: str, response: str, reference: Any = None,
                    metadata: dict[str, Any] | None = None) -> RewardResult:
        call = next(self._calls)
        # The call's own generator is only built when a draw needs it (a constant latency and
        # no failures draw nothing): the same results, one seeding less per call.
        draws = self.failure_prob > 0.0 or self.latency_s.draws
        rng = self._rng(self.seed, name, prompt, response, call) if draws else None
        latency = self.latency_s.sample(rng)
        work = self._service_s(prompt, response) if self._service_s is not None else 0.0
        await asyncio.sleep(latency)
        if self._slots is not None:
            async with self._slots:
                await asyncio.sleep(work)
        else:
            await asyncio.sleep(work)
        self.busy_s += work
        self.num_calls += 1
        if rng is not None and rng.random() < self.failure_prob:
            raise RewardError(f"simulated reward {name!r}: injected failure")
        reward = float(self._rng(self.seed, prompt, response).random() < 0.5)
        return RewardResult(reward=reward, details={"simulated": True})
