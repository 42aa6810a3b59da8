"""The one wiring path: a validated scenario plus the run's backends -> a :class:`Controller`.

Every way of running the controller builds it here: the driver (``Cluster.start``, under
``rollart run`` and ``open_cluster`` alike), the simulator (``rollart.sim.harness``) and the
benchmarks. What differs between them is an input of :func:`build_controller` (the backends,
a virtual clock, the staleness check's placement, the stall watchdog), never an attribute set
on the built controller or its parts afterwards.

::

    backends = Backends(pools={"cpu": [worker]}, trainer=trainer, tokenizer=tokenizer,
                        env_hosts=[env_host], reward_service=reward)
    controller = build_controller(scenario, backends)
    await controller.start()
    metrics = await controller.step()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollart.config import Scenario
from rollart.controller.agents.runner import AgentRunner
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.controller import Controller
from rollart.controller.observe.loophealth import LoopLagMonitor
from rollart.controller.observe.transcripts import TranscriptRecorder
from rollart.controller.ports import (
    EnvBackend,
    GenerationBackend,
    RewardBackend,
    Tokenizer,
    TrainerBackend,
)
from rollart.controller.rollout.localenv import LocalEnvBackend
from rollart.controller.rollout.offloop import OffLoopCalls
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvRouter, RewardFn, RewardRouter
from rollart.controller.routing.spill import SpillPolicy
from rollart.envhost.families import family_turn_cap
from rollart.transport.errors import ConfigError

__all__ = ["Backends", "build_controller"]


@dataclass
class Backends:
    """The services a cluster drives. ``pools`` maps each scenario pool name to its workers;
    ``reward_endpoints`` maps the http(s) URLs domains name to clients; ``clock`` overrides the
    loop's monotonic clock (simulators); ``loop_lag``: an event-loop lag monitor whose p99 each
    step reports (real-time runs only: its timer would keep a virtual clock from idling)."""

    pools: Mapping[str, Sequence[GenerationBackend]]
    trainer: TrainerBackend
    tokenizer: Tokenizer
    env_hosts: Sequence[EnvBackend] = field(default_factory=list)
    reward_service: RewardBackend | None = None
    reward_endpoints: Mapping[str, RewardBackend] = field(default_factory=dict)
    clock: Callable[[], float] | None = None
    loop_lag: LoopLagMonitor | None = None
    #: the model's vocabulary size: generated token ids must be below it (None: unchecked)
    vocab_size: int | None = None


def build_controller(
    scenario: Scenario,
    backends: Backends,
    *,
    affinity: Mapping[str, str] | None = None,
    local_rewards: Mapping[str, RewardFn] | None = None,
    local_envs: Mapping[str, Callable[..., Any]] | None = None,
    resume: dict[str, Any] | None = None,
    transcripts: TranscriptRecorder | None = None,
    buffer_class: type[SampleBuffer] = SampleBuffer,
    agents: AgentRunner | None = None,
    stall_watchdog: bool = True,
    check: Literal["per_turn", "admission"] | None = None,
) -> Controller:
    """Wire ``scenario``'s controller over ``backends`` (not started: ``await c.start()``).

    The LLM proxy routes each domain to its pool (``affinity``, default the scenario's
    ``domain.pool``) with the run's send window (``run.max_generate_in_flight`` requests per
    worker), the trainer's version and the model's vocabulary (``backends.vocab_size``); env
    sessions go to ``backends.env_hosts`` or, for env names in ``local_envs``, to in-process
    envs on ``run.local_threads`` threads; rewards go to the reward service, the http(s)
    endpoints or ``local_rewards`` (each call within ``run.local_reward_timeout_s``, details up
    to ``reward.max_details_bytes``).

    Args:
        scenario: a validated scenario (``rollart.config.validate_scenario``).
        backends: the workers per pool, env hosts, reward clients, trainer, tokenizer, and
            optionally a clock and an event-loop lag monitor.
        affinity: domain name -> pool name (``Cluster.set_affinity``); default the scenario's.
        local_rewards: reward name -> function for domains with ``reward_url = "local"``.
        local_envs: env name -> factory of an in-process env (``Cluster.register_env``).
        resume: a ``Controller.snapshot`` to continue from (the trainer at its version).
        transcripts: told of every finished trajectory, dropped sample and batch.
        buffer_class: ``SampleBuffer`` or a subclass with its own admission / batch assembly.
        agents: the agent domains' trajectory bodies, started by the caller.
        stall_watchdog: log what a step waits on every ``run.stall_log_s`` (off on a virtual
            clock, whose idle detection its timer would defeat).
        check: where the staleness bound is checked (``per_turn`` / ``admission``), overriding
            the mode's; ``None``: the mode's.

    Raises:
        ConfigError: a scenario pool with no workers in ``backends.pools``; no env host while
            some domain's env is not served in-process; a domain whose reward cannot be
            routed; an affinity naming an unknown pool.
    """
    run = scenario.run
    missing = sorted({p.name for p in scenario.pools} - set(backends.pools))
    if missing:
        raise ConfigError(f"backends: no workers for pools {missing}")
    local_envs = dict(local_envs or {})
    if not backends.env_hosts:
        remote = sorted({d.env for d in scenario.domains} - set(local_envs))
        if remote:
            raise ConfigError(f"no env host, and envs {remote} are not registered "
                              f"in-process (register_env); registered: {sorted(local_envs)}")
    hardware = {p.name: p.hardware for p in scenario.pools}
    home = dict(affinity) if affinity is not None else {d.name: d.pool for d in scenario.domains}
    aa = run.adaptive_affinity
    clock = backends.clock or (lambda: asyncio.get_running_loop().time())
    spill = SpillPolicy(
        saturated_waiting_share=aa.saturated_waiting_share,
        room_waiting_share=aa.room_waiting_share, kv_usage_high=aa.kv_usage_high,
        min_hold_s=aa.min_hold_s, clock=clock) if aa.enabled else None
    # A turn is one LLM call: one env step for a gym domain, whose env family may end it after
    # one; any number of the agent's calls for an agent domain, whatever its env. An env
    # registered in-process under a family's name is the user's, not the family's.
    agent_domains = set(agents.agents) if agents is not None else set()
    turn_caps = {d.name: min(d.max_turns or run.max_turns,
                             (None if d.name in agent_domains or d.env in local_envs
                              else family_turn_cap(d.env)) or run.max_turns)
                 for d in scenario.domains}
    proxy = LLMProxy(
        {name: (hardware.get(name, "?"), workers) for name, workers in backends.pools.items()},
        home,
        version=backends.trainer.version,
        vocab_size=backends.vocab_size,
        max_generate_in_flight=run.max_generate_in_flight,
        spill=spill,
        kv_working_set=(aa.kv_working_set_share, run.max_tokens_per_trajectory, turn_caps,
                        run.max_tokens_per_turn)
        if run.effective_kv_working_set else None,
    )
    envs = EnvRouter(list(backends.env_hosts), LocalEnvBackend(
        local_envs, OffLoopCalls(run.local_threads, what="local env")))
    rewards = RewardRouter(
        backends.reward_service, backends.reward_endpoints, local_rewards,
        calls=OffLoopCalls(run.local_threads, what="local reward"),
        local_timeout_s=run.local_reward_timeout_s,
        max_details_bytes=scenario.reward.max_details_bytes)
    return Controller(
        scenario,
        proxy=proxy,
        envs=envs,
        rewards=rewards,
        trainer=backends.trainer,
        tokenizer=backends.tokenizer,
        clock=backends.clock,
        resume=resume,
        loop_lag=backends.loop_lag,
        transcripts=transcripts,
        buffer_class=buffer_class,
        stall_watchdog=stall_watchdog,
        agents=agents,
        check=check,
    )
