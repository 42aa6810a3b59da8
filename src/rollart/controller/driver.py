"""The async driver API for user scripts.

::

    import asyncio
    import rollart

    async def main() -> None:
        # Starts the scenario's services on this machine; writes runs/demo (metrics,
        # TensorBoard, transcripts, checkpoints); every process stops when the block ends.
        async with rollart.open_cluster("scenarios/quickstart.toml",
                                        run_dir="runs/demo") as cluster:

            @cluster.reward("length_penalty")          # domains with reward_url = "local"
            def length_penalty(prompt, response, reference, metadata):
                return -len(response) / 1000

            cluster.set_affinity("guess20", "short")   # move a domain to another pool

            @cluster.agent("swe")                      # an OpenAI-API agent runs this domain
            async def solve(client, task):             # client: openai.AsyncOpenAI
                ...                                    # -> reward, or None: the reward fn scores
            async for step in cluster.train(steps=20):
                print(step.step, step.metrics.reward_mean_by_domain)

    asyncio.run(main())

Register local rewards and envs before the cluster starts (``async with`` or the first
``train``): the controller checks at start that every domain's reward and env exist. A
scenario whose envs are all registered so needs no ``[[env_hosts]]``; with the default tiny
model it must set ``[model] tiny_warmup = false`` (the warm-up imitates the built-in envs'
scripted solvers only; ``open_cluster`` refuses it otherwise, naming that line).
``rollart.open_cluster(scenario)`` builds the backends from a scenario by starting its services
on this machine; ``Cluster.from_scenario(scenario, backends=...)`` takes backends built
otherwise (``rollart.sim`` builds simulated ones).

``backends`` holds the clients the cluster drives (inference workers per pool, env hosts, the
reward service, the trainer, the tokenizer): the real clients of running services (the launcher
builds them) or simulated in-process ones (``rollart.sim``). The cluster does not own them: their
owner closes them after the cluster exits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rollart.config import Scenario, load_scenario, validate_scenario
from rollart.controller.agents.runner import AgentFn, AgentRunner, AgentSpec
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample
from rollart.controller.build import Backends, build_controller
from rollart.controller.controller import Controller, check_domain_weight
from rollart.controller.evaluation.runner import Evaluator
from rollart.controller.observe.metrics import StepMetrics
from rollart.controller.observe.transcripts import TranscriptRecorder
from rollart.controller.routing.routers import RewardFn
from rollart.transport.errors import ConfigError

__all__ = ["Backends", "Cluster", "StepHook", "TrainStep"]


@dataclass
class TrainStep:
    """One finished training step: its number (1-based), metrics and the samples trained on."""

    step: int
    metrics: StepMetrics
    samples: list[Sample]


#: ``await hook(cluster, step)`` after each training step (:meth:`Cluster.add_step_hook`)
StepHook = Callable[["Cluster", TrainStep], Awaitable[None]]


class Cluster:
    """A scenario bound to its backends; use ``async with``. See the module docstring."""

    def __init__(self, scenario: Scenario, backends: Backends,
                 resume: dict[str, Any] | None = None, *,
                 buffer_class: type[SampleBuffer] = SampleBuffer,
                 transcripts: TranscriptRecorder | None = None,
                 run_dir: Path | None = None, run_folder: Any = None, run_key: Any = None,
                 trainer_client: Any = None) -> None:
        self.scenario = validate_scenario(scenario)
        self.backends = backends
        self._resume = resume
        self.buffer_class = buffer_class
        self.transcripts = transcripts
        # Set by ``open_cluster`` (None for a cluster over backends built otherwise):
        #: the run folder
        self.run_dir = run_dir
        #: its writer (``rollart.launcher.rundir.RunFolder``: metrics, checkpoints, summary)
        self.run_folder = run_folder
        #: the run's key (``rollart.run_credentials``; ``INSECURE`` under ``insecure``)
        self.run_key = run_key
        #: the trainer service's client (checkpoints are saved through it)
        self.trainer_client = trainer_client
        self._step_hooks: list[StepHook] = []
        missing = {p.name for p in scenario.pools} - set(backends.pools)
        if missing:
            raise ConfigError(f"backends: no workers for pools {sorted(missing)}")
        self._affinity = {d.name: d.pool for d in scenario.domains}
        self._local_rewards: dict[str, RewardFn] = {}
        self._local_envs: dict[str, Callable[[], Any]] = {}
        self._agents: dict[str, AgentSpec] = {}
        self._agent_runner: AgentRunner | None = None
        self.controller: Controller | None = None
        #: held-out evaluation (``[eval] enabled``), once started
        self.evaluator: Evaluator | None = None

    @classmethod
    def from_scenario(cls, scenario: str | Path | Scenario, *, backends: Backends,
                      resume: dict[str, Any] | None = None,
                      buffer_class: type[SampleBuffer] = SampleBuffer,
                      transcripts: TranscriptRecorder | None = None) -> Cluster:
        """A cluster for a scenario file path or a ``Scenario``; ``resume``: a
        :meth:`snapshot` of an earlier run (the trainer restored to its version);
        ``buffer_class``: a ``SampleBuffer`` subclass with your own admission or batch
        assembly (see ``Controller``); ``transcripts``: a ``TranscriptRecorder``.
        Raises ConfigError."""
        if not isinstance(scenario, Scenario):
            scenario = load_scenario(scenario)
        return cls(scenario, backends, resume, buffer_class=buffer_class,
                   transcripts=transcripts)

    def add_step_hook(self, hook: StepHook) -> None:
        """Await ``hook(cluster, train_step)`` after every training step, before the step is
        yielded (``open_cluster`` writes the run folder with one)."""
        self._step_hooks.append(hook)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able controller state between steps, for :meth:`from_scenario` ``resume``;
        with ``[eval] enabled`` it also holds the evaluator's (``"eval"``: its baselines and
        the step of its newest evaluation, ``Evaluator.snapshot``)."""
        if self.controller is None:
            raise RuntimeError("snapshot() needs a started cluster")
        snap = self.controller.snapshot()
        if self.evaluator is not None:
            snap["eval"] = self.evaluator.snapshot()
        return snap

    # ------------------------------------------------------------------ registration
    def register_reward(self, name: str, fn: RewardFn) -> None:
        """Register local reward ``fn(prompt, response, reference, metadata) -> float |
        (float, details)`` (sync or async) for domains with ``reward_url = "local"``. A sync
        ``fn`` runs on a thread (``run.local_threads``), never on the event loop; each call is
        bounded by ``run.local_reward_timeout_s`` (past it the trajectory fails with
        ``reward_error``, never a reward of 0)."""
        if self.controller is not None:
            self.controller.rewards.register(name, fn)
        self._local_rewards[name] = fn

    def reward(self, name: str) -> Callable[[RewardFn], RewardFn]:
        """Decorator form of :meth:`register_reward`."""

        def deco(fn: RewardFn) -> RewardFn:
            self.register_reward(name, fn)
            return fn

        return deco

    def register_env(self, name: str, factory: Callable[[], Any]) -> None:
        """Serve env ``name`` in-process: ``factory(**domain.env_options)`` returns an object
        with ``reset(seed)`` and ``step(action)`` (see ``LocalEnvBackend``); sync methods run on
        threads (``run.local_threads``) within ``run.env_timeout_s`` each; ``step`` may raise
        ``rollart.InvalidActionError`` for a malformed action. Register before entering."""
        if self.controller is not None:
            raise RuntimeError("register_env must be called before the cluster starts")
        self._local_envs[name] = factory

    def register_agent(self, domain: str, fn: AgentFn, *, tool_parser: str = "hermes") -> None:
        """Run ``domain``'s trajectories with agent ``fn``: ``await fn(client, task)`` where
        ``client`` is an ``openai.AsyncOpenAI`` whose base URL is that trajectory's own
        (``rollart.controller.agents``) and ``task`` is ``{"prompt", "system_prompt",
        "observation", "info", "seed", "domain"}`` from the domain's env. Returning a float
        makes it the reward; ``None`` lets the domain's reward function score the last
        assistant message. ``tool_parser``: the vLLM tool parser for the model's tool-call
        format (``""``: requests with ``tools`` are refused). Register before the cluster
        starts. Raises ConfigError for an unknown domain, RuntimeError once started."""
        if self.controller is not None:
            raise RuntimeError("register_agent must be called before the cluster starts")
        if domain not in self._affinity:
            raise ConfigError(f"agent: unknown domain {domain!r}; "
                              f"domains: {sorted(self._affinity)}")
        self._agents[domain] = AgentSpec(fn, tool_parser)

    def agent(self, domain: str, *, tool_parser: str = "hermes") -> Callable[[AgentFn], AgentFn]:
        """Decorator form of :meth:`register_agent`."""

        def deco(fn: AgentFn) -> AgentFn:
            self.register_agent(domain, fn, tool_parser=tool_parser)
            return fn

        return deco

    def set_domain_weight(self, domain: str, weight: float) -> None:
        """Change ``domain``'s share of new groups (its ``weight``, relative to the other
        domains') from the next group admitted: a curriculum, or a drifting task mix. Before
        the cluster starts it changes the scenario's weight. Raises ConfigError for an unknown
        domain or a weight that is not a finite number > 0."""
        if self.controller is not None:
            self.controller.set_domain_weight(domain, weight)
            return
        check_domain_weight(domain, weight, [d.name for d in self.scenario.domains])
        self.scenario = msgspec.structs.replace(self.scenario, domains=[
            msgspec.structs.replace(d, weight=float(weight)) if d.name == domain else d
            for d in self.scenario.domains])

    def set_affinity(self, domain: str, pool: str) -> None:
        """Route ``domain``'s generations to ``pool`` (takes effect at the next turn).
        Raises ConfigError for an unknown domain or pool."""
        if domain not in self._affinity:
            raise ConfigError(f"set_affinity: unknown domain {domain!r}; "
                              f"domains: {sorted(self._affinity)}")
        if pool not in self.backends.pools:
            raise ConfigError(f"set_affinity: unknown pool {pool!r}; "
                              f"pools: {sorted(self.backends.pools)}")
        self._affinity[domain] = pool
        if self.controller is not None:
            self.controller.proxy.set_affinity(domain, pool)

    # ------------------------------------------------------------------ running
    async def start(self) -> None:
        """Start the controller (``async with`` and ``train`` do this for you)."""
        if self.controller is not None:
            return
        if self._agents and self._agent_runner is None:
            self._agent_runner = AgentRunner(self._agents)
            await self._agent_runner.start()
        try:
            self.controller = build_controller(
                self.scenario, self.backends, affinity=self._affinity,
                local_rewards=self._local_rewards, local_envs=self._local_envs,
                resume=self._resume, transcripts=self.transcripts,
                buffer_class=self.buffer_class, agents=self._agent_runner)
        except BaseException:
            # ``async with`` calls no ``__aexit__`` when entering fails: nothing else closes it
            if self._agent_runner is not None:
                await self._agent_runner.close()
                self._agent_runner = None
            raise
        await self.controller.start()
        if self.scenario.eval.enabled:
            self.evaluator = Evaluator(self.controller, self.scenario.eval)
            if self._resume is not None and self._resume.get("eval") is not None:
                self.evaluator.restore(self._resume["eval"], self.controller.step_index)

    async def close(self) -> None:
        """Stop every trajectory and the controller's background work (idempotent)."""
        if self.evaluator is not None:  # its env sessions close before the controller's
            await self.evaluator.close()
        if self.controller is not None:
            await self.controller.close()
        if self._agent_runner is not None:  # after the trajectories that use it
            await self._agent_runner.close()
            self._agent_runner = None

    async def __aenter__(self) -> Cluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def train(self, steps: int | None = None) -> AsyncIterator[TrainStep]:
        """Run ``steps`` training steps (default ``run.steps``), yielding each as it ends.

        With ``[eval] enabled`` (``rollart.controller.evaluation.runner``): the first call evaluates
        before its first step (training waits for it, rollout goes on; not when the cluster
        resumed from a checkpoint whose newest evaluation was at that step), every
        ``eval.every``-th step starts an evaluation that runs beside the next steps (on the
        versions the workers serve meanwhile: its record names them), and the last step of
        each call is followed by one that it waits for, on the newest version. Each step's
        ``metrics.eval`` holds the evaluations that ended by then.

        Starts the cluster if needed. Raises the controller's fatal errors (see
        ``Controller.step``), and an evaluation's."""
        await self.start()
        assert self.controller is not None
        ev = self.evaluator
        total = self.scenario.run.steps if steps is None else steps
        if ev is not None and not ev.has_run and total > 0:
            ev.launch(self.controller.step_index)
            await ev.finish_pending()
        for i in range(total):
            metrics = await self.controller.step()
            if ev is not None:
                ev.observe_step(metrics, self.controller.last_batch)
                if i == total - 1:
                    # the last evaluation measures the trained policy, not the one before it
                    await self.controller.apply_newest_weights()
                    metrics.eval = await ev.finish(metrics.step)
                else:
                    if ev.cfg.every and metrics.step % ev.cfg.every == 0:
                        ev.launch(metrics.step)
                    metrics.eval = ev.take_finished()
            out = TrainStep(metrics.step, metrics, self.controller.last_batch)
            for hook in self._step_hooks:
                await hook(self, out)
            yield out
