"""Routing of env and reward calls: env hosts, in-process envs, reward endpoints.

- :class:`EnvRouter`: opens each session on the live env host with the fewest open sessions
  (from this controller), remembers which host holds it, and routes step / close there. Env
  names registered in-process (``Cluster.register_env``) are served by a
  :class:`~rollart.controller.rollout.localenv.LocalEnvBackend` instead (closed on every path). A host
  that dies is skipped for new sessions; when none is left, :class:`EnvHostsExhaustedError`
  (fatal) is raised.
- :class:`RewardRouter`: a domain's reward goes to the reward service (``reward_url =
  "service"``), to any endpoint speaking the reward contract (an http(s) URL), or to a local
  function (``"local"``): ``env_return`` (the env's summed step rewards), ``env_success`` (the
  game's outcome: 1 won, 0 lost) or one registered with
  ``Cluster.register_reward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from rollart.controller.ports import EnvBackend, RewardBackend, RewardOutcome
from rollart.controller.rollout.localenv import LocalEnvBackend
from rollart.controller.rollout.offloop import OffLoopCalls
from rollart.reward.builtins import env_outcome
from rollart.reward.protocol import InvalidRewardError, validate_result
from rollart.transport import messages as m
from rollart.transport.errors import (
    ConfigError,
    EnvError,
    PeerDeadError,
    RewardError,
    RewardTooLargeError,
)


class EnvHostsExhaustedError(PeerDeadError):
    """Fatal: no live env host is left to open sessions on."""


class EnvRouter:
    """Env sessions across hosts (see the module docstring). Same call shapes as EnvBackend."""

    def __init__(self, hosts: list[EnvBackend], local: LocalEnvBackend | None = None) -> None:
        self.hosts = list(hosts)
        self.local = local or LocalEnvBackend()
        self._where: dict[str, EnvBackend] = {}
        self._open_count: dict[int, int] = {id(h): 0 for h in self.hosts}

    def _pick(self, env_name: str) -> EnvBackend:
        if env_name in self.local.factories:
            return self.local
        if len(self.hosts) == 1 and not self.hosts[0].dead:  # one host: nothing to compare
            return self.hosts[0]
        live = [h for h in self.hosts if not h.dead]
        if not live:
            raise EnvHostsExhaustedError(
                f"no live env host for env {env_name!r} (hosts: {[h.name for h in self.hosts]})"
            )
        return min(live, key=lambda h: self._open_count.get(id(h), 0))

    async def open(self, env_name: str, seed: int, options: dict[str, Any] | None = None, *,
                   timeout_s: float | None = None) -> m.EnvOpened:
        """Open a session on the least-busy live host. Raises EnvError / PeerDeadError
        (that host died: per trajectory) / EnvHostsExhaustedError (fatal)."""
        host = self._pick(env_name)
        opened = await host.open(env_name, seed, options, timeout_s=timeout_s)
        self._where[opened.session_id] = host
        self._open_count[id(host)] = self._open_count.get(id(host), 0) + 1
        return opened

    def _host(self, session_id: str) -> EnvBackend:
        try:
            return self._where[session_id]
        except KeyError:
            raise EnvError("not_found", f"session {session_id!r} is not open") from None

    async def step(self, session_id: str, action: str, *, timeout_s: float | None = None
                   ) -> m.EnvStepResult:
        """Step a session; one its host closed with this step (``EnvStepResult.closed``: the
        episode ended) is forgotten, so ``close_session`` on it sends nothing."""
        result = await self._host(session_id).step(session_id, action, timeout_s=timeout_s)
        if result.closed:
            self._forget(session_id)
        return result

    def is_open(self, session_id: str) -> bool:
        """Whether ``session_id`` is open as far as this router knows (opened here, not yet
        closed by ``close_session`` nor by its host with an episode's last step)."""
        return session_id in self._where

    def _forget(self, session_id: str) -> EnvBackend | None:
        host = self._where.pop(session_id, None)
        if host is not None:
            self._open_count[id(host)] = self._open_count.get(id(host), 1) - 1
        return host

    async def close_session(self, session_id: str) -> None:
        """Close and forget a session; a dead host's sessions, and those their host already
        closed, are just forgotten."""
        host = self._forget(session_id)
        if host is not None and not host.dead:
            await host.close_session(session_id)


class _LocalResult(msgspec.Struct):
    reward: float
    details: dict[str, Any] = {}


RewardFn = Callable[[str, str, Any, dict[str, Any]], Any]
_json = msgspec.json.Encoder()


def env_return_reward(prompt: str, response: str, reference: Any, metadata: dict) -> float:
    """The env's own return: the sum of its step rewards (``metadata["env_return"]``)."""
    return float(metadata["env_return"])


def env_success_reward(prompt: str, response: str, reference: Any, metadata: dict) -> float:
    """The game's outcome (1.0 won, 0.0 lost, a negative return kept): the reward service's
    ``env_success``, computed in place."""
    return env_outcome(float(metadata["env_return"]))


#: the env-derived rewards every router has, computed on the event loop (trivial)
ENV_REWARDS: dict[str, RewardFn] = {"env_return": env_return_reward,
                                    "env_success": env_success_reward}


class RewardRouter:
    """Scores a domain's trajectories at its configured endpoint.

    Args:
        service: client of the scenario's reward service (``reward_url = "service"``).
        endpoints: URL -> client for domains naming an http(s) URL.
        local: name -> function ``fn(prompt, response, reference, metadata)`` returning a float
            or ``(float, details)`` (sync or async); ``env_return`` and ``env_success`` are
            always available.
            Sync ones run off the event loop (``calls``), each within ``local_timeout_s``.
        calls: the bounded threads local functions run on.
        local_timeout_s: deadline of one local reward call, seconds (``None``: none).
        max_details_bytes: largest JSON-encoded ``details`` a local function may return
            (larger: ``RewardTooLargeError``, like the HTTP client's limit).
    """

    def __init__(self, service: RewardBackend | None = None,
                 endpoints: Mapping[str, RewardBackend] | None = None,
                 local: Mapping[str, RewardFn] | None = None,
                 calls: OffLoopCalls | None = None,
                 local_timeout_s: float | None = 60.0,
                 max_details_bytes: int = 64 << 10) -> None:
        self.service = service
        self.endpoints = dict(endpoints or {})
        self.calls = calls or OffLoopCalls(what="local reward")
        self.local_timeout_s = local_timeout_s
        self.max_details_bytes = max_details_bytes
        self.local: dict[str, RewardFn] = {**ENV_REWARDS, **(local or {})}

    def register(self, name: str, fn: RewardFn) -> None:
        self.local[name] = fn

    def check(self, domain: str, reward: str, reward_url: str) -> None:
        """Raise ConfigError if the domain's reward cannot be routed (before the run starts)."""
        if reward_url == "local" and reward not in self.local:
            raise ConfigError(f"domain {domain!r}: no local reward function {reward!r} "
                              f"(registered: {sorted(self.local)})")
        if reward_url == "service" and self.service is None:
            raise ConfigError(f"domain {domain!r}: reward_url 'service' but no reward service")
        if reward_url not in ("local", "service") and reward_url not in self.endpoints:
            raise ConfigError(f"domain {domain!r}: no client for reward endpoint {reward_url!r}")

    async def score(self, reward: str, reward_url: str, prompt: str, response: str,
                    reference: Any, metadata: dict[str, Any]) -> RewardOutcome:
        """Score one response. Raises RewardError (the trajectory fails; never reward 0)."""
        if reward_url == "local":
            return await self._score_local(reward, prompt, response, reference, metadata)
        client = self.service if reward_url == "service" else self.endpoints.get(reward_url)
        if client is None:
            raise RewardError(f"no reward client for {reward_url!r}")
        return await client.score(reward, prompt, response, reference, metadata)

    async def _score_local(self, name: str, prompt: str, response: str, reference: Any,
                           metadata: dict[str, Any]) -> RewardOutcome:
        fn = self.local.get(name)
        if fn is None:
            raise RewardError(f"no local reward function {name!r}")
        try:
            if fn in ENV_REWARDS.values():  # trivial: not worth a thread
                out = fn(prompt, response, reference, metadata)
            else:
                out = await self.calls.run(fn, prompt, response, reference, metadata,
                                           timeout_s=self.local_timeout_s, name=name)
        except TimeoutError as exc:
            raise RewardError(f"local reward {name!r}: no result within "
                              f"{self.local_timeout_s} s") from exc
        except Exception as exc:
            raise RewardError(f"local reward {name!r} raised {type(exc).__name__}: {exc}") from exc
        # The reward service's own contract (a finite real, or (reward, details) with details a
        # dict or None): a bad return value fails this trajectory (reward_error), never the run.
        try:
            checked = validate_result(name, out)
        except InvalidRewardError as exc:
            raise RewardError(f"local {exc}") from None
        reward, details = checked.reward, checked.details
        if details:
            try:
                size = len(_json.encode(details))
            except (TypeError, msgspec.EncodeError) as exc:
                raise RewardError(f"local reward {name!r} returned details that are not JSON: "
                                  f"{exc}") from None
            if size > self.max_details_bytes:
                raise RewardTooLargeError(
                    f"local reward {name!r}: details of {size} bytes (JSON) exceed "
                    f"max_details_bytes = {self.max_details_bytes}")
        return _LocalResult(float(reward), dict(details))
