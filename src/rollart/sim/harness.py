"""Run the REAL rollart controller against SIMULATED workers, envs, reward and trainer.

``run_simulated(sim, seed)`` builds a ``rollart.config.Scenario`` from a ``SimScenario``, the
real ``Controller`` (``rollart.controller.build.build_controller``, as every run builds it) over
simulated backends (``rollart.sim.worker``, ``.env``, ``.trainer``), runs ``steps`` training steps
and returns their metrics. With ``virtual=True`` (default) it runs on the looptime virtual clock, so hundreds of
simulated GPUs and thousands of trajectories finish in seconds of real time, deterministically
for a seed; ``virtual=False`` runs the same code in real time (use small latencies).

Every result carries ``simulated: True``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollart.config import (
    AdaptiveAffinityConfig,
    DomainConfig,
    EngineConfig,
    PoolConfig,
    RetryConfig,
    RunConfig,
    Scenario,
    TrainerConfig,
    validate_scenario,
)
from rollart.controller.build import Backends, build_controller
from rollart.sim import costs
from rollart.sim.clock import run_real, run_virtual
from rollart.sim.env import ENV_PREFIX, SimEnvHost, SimReward
from rollart.sim.hardware import HardwareProfile, get_hardware
from rollart.sim.models import get_model
from rollart.sim.trainer import SimTrainer
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import Dist, DomainSpec, DomainTable, SimTokenizer, const

#: the alpha each mode requires (``rollart.config.validate_scenario``); None = any >= 1
MODE_ALPHA: dict[str, int | None] = {
    "sync": 0, "sync_plus": 0, "one_off": 1, "areal": None, "rollart": None,
}


@dataclass(frozen=True)
class SimPool:
    """A pool of ``num_workers`` simulated engines, each on ``tp`` x ``hardware``."""

    name: str
    hardware: str
    num_workers: int
    tp: int = 1
    max_batch: int = 256

    @property
    def num_gpus(self) -> int:
        return self.num_workers * self.tp


@dataclass(frozen=True)
class SimDomain:
    """A simulated domain served by pool ``pool``, sampled with relative ``weight``."""

    spec: DomainSpec
    pool: str
    weight: float = 1.0
    #: this domain's own staleness bound (``DomainConfig.alpha``); None = the run's
    alpha: int | None = None


@dataclass(frozen=True)
class SimScenario:
    """Everything a simulated run needs (SIMULATED hardware and workloads; REAL controller).

    ``alpha`` is used by ``areal`` / ``rollart``; ``sync``/``sync_plus`` use 0 and ``one_off``
    1, as ``rollart.config`` requires. ``trainer_gpus`` x ``trainer_hardware`` train; the trainer
    is separate from the rollout pools (disaggregated, as in the paper).
    """

    pools: tuple[SimPool, ...]
    domains: tuple[SimDomain, ...]
    model: str = "qwen3-8b"
    mode: str = "rollart"
    alpha: int = 1
    steps: int = 4
    batch_size: int = 64
    group_size: int = 8
    redundancy: int = 0
    selection: str = "first"
    selection_deadline_s: float = 30.0
    max_turns: int = 8
    max_tokens_per_turn: int = 4096
    max_tokens_per_trajectory: int = 32768
    trainer_hardware: str = "h800"
    trainer_gpus: int = 32
    env_hosts: int = 4
    env_max_concurrent_steps: int | None = None
    reward_latency_s: Dist = field(default_factory=lambda: const(0.02))
    eff: costs.Efficiency = costs.DEFAULT_EFFICIENCY
    max_attempts: int = 3
    reprefill: bool = False
    #: the staleness policy: ``RunConfig.weight_apply`` / ``apply_waves`` / ``domain_mix`` /
    #: ``fresh_start`` / ``hold_batch_for_groups`` / ``hold_batch_max_s`` / ``admission``;
    #: ``None``: ``RunConfig``'s default (the waste-free policy, where it applies)
    weight_apply: str | None = None
    apply_waves: int | None = None
    domain_mix: str | None = None
    fresh_start: bool | None = None
    abort_stale: bool = False
    hold_batch_for_groups: bool | None = None
    hold_batch_max_s: float | None = None
    admission: str | None = None
    generate_timeout_s: float = 1e6
    env_timeout_s: float = 1e6
    #: ``RunConfig.trajectory_timeout_s`` / ``group_timeout_s`` (simulated seconds; ``None``:
    #: no limit), the run's defaults unless set. A simulated engine never hangs, so these only
    #: bite when queueing makes trajectories long: a sweep that multiplies the load scales them
    #: (``benchmarks.modes.regime_sim``) so a loaded regime is measured, not failed.
    trajectory_timeout_s: float | None = RunConfig().trajectory_timeout_s
    group_timeout_s: float | None = RunConfig().group_timeout_s
    #: override every engine's weight-transfer link / host-to-device bandwidth (bytes/s)
    link_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    #: the trainer's pushes share its nodes' NICs (ceil(trainer_gpus / gpus_per_node) x the
    #: trainer hardware's ``link_bytes_per_s``); False: every engine's own link alone
    shared_trainer_egress: bool = True
    #: delta weight transfer (``SimTrainer``): delta bytes / full bytes per version (None:
    #: full versions), a full version every ``weight_full_every``, the trainer's encode and a
    #: worker's rebuild rate (bytes of the whole version per second)
    weight_delta_fraction: float | None = None
    weight_full_every: int = 10
    delta_encode_bytes_per_s: float | None = None
    delta_rebuild_bytes_per_s: float | None = None
    gpus_per_node: int = 8
    #: engines' chunked-prefill token budget (vLLM ``max_num_batched_tokens``)
    max_num_batched_tokens: int = 8192
    #: engines reuse a previous turn's KV (vLLM automatic prefix caching); False: every turn
    #: prefills its whole prompt
    prefix_cache: bool = True
    #: ablation knobs (simulation only). ``reward_gpus`` > 0: rewards are scored on that many
    #: dedicated ``reward_hardware`` GPUs, one call at a time each, a call costing one prefill
    #: of its prompt + final response on the policy's model profile (an LLM judge of the
    #: policy's size: an assumption, the paper names no reward model); 0: serverless (elastic,
    #: only ``reward_latency_s``). ``check``: override the mode's staleness check
    #: (``"admission"``: rollart without its per-turn check; the bound still holds at
    #: completion). ``push_at_pause``: the trainer's push is not overlapped with rollout but
    #: made at the pause point, blocking (as a collective broadcast is).
    reward_gpus: int = 0
    reward_hardware: str = "h800"
    check: str | None = None
    push_at_pause: bool = False
    #: online affinity (``RunConfig.adaptive_affinity``); ``None``: the static mapping
    adaptive_affinity: AdaptiveAffinityConfig | None = None
    #: a drifting task mix: ``(k, domain, weight)`` sets that domain's weight after step k
    #: (``Controller.set_domain_weight``)
    weight_changes: tuple[tuple[int, str, float], ...] = ()

    def engine_hardware(self, name: str) -> HardwareProfile:
        """The profile ``name`` with this scenario's bandwidth overrides applied."""
        hw = get_hardware(name)
        changes = {k: v for k, v in (("link_bytes_per_s", self.link_bytes_per_s),
                                     ("h2d_bytes_per_s", self.h2d_bytes_per_s)) if v is not None}
        return dataclasses.replace(hw, **changes) if changes else hw

    def replace(self, **changes: Any) -> SimScenario:
        return dataclasses.replace(self, **changes)


@dataclass
class SimResult:
    """Metrics of one simulated run (``simulated`` is always True).

    ``steps``: one dict per training step (``rollart.controller.observe.metrics.StepMetrics`` fields);
    ``step_time_s``: mean step time over steps after ``warmup`` (seconds of simulated time);
    ``total_time_s``: simulated time of the whole run; ``wall_s``: real seconds it took.
    """

    mode: str
    steps: list[dict[str, Any]]
    step_time_s: float
    total_time_s: float
    wall_s: float
    buffer: dict[str, Any]
    workers: dict[str, dict[str, float]]
    env_step_latencies: list[float]
    #: per env session: (open time, step latencies), ordered by open time
    session_latencies: list[tuple[float, list[float]]] = field(default_factory=list)
    #: the trainer's ``push_times_s`` (seconds of each weight push, all workers together)
    push_times_s: list[float] = field(default_factory=list)
    #: dedicated reward GPUs' busy share of the run (0 when serverless)
    reward_utilisation: float = 0.0
    #: reward calls scored, and the GPU seconds they took (0 when serverless): utilisation =
    #: ``reward_busy_s / (total_time_s * reward_gpus)``
    reward_calls: int = 0
    reward_busy_s: float = 0.0
    simulated: bool = True


#: ``SimScenario``'s staleness policy fields, passed to ``RunConfig`` where not ``None``
POLICY_FIELDS = ("weight_apply", "apply_waves", "domain_mix", "fresh_start",
                 "hold_batch_for_groups", "hold_batch_max_s", "admission")


def _turn_cap(spec: DomainSpec) -> int | None:
    """A single-turn domain's ``max_turns``, 1, as a scenario of single-turn tasks declares
    it (and as the controller reads it from a single-turn env family, ``rg:``): one whose
    turns do not draw and come out at one (as ``rollart.sim.env`` counts them); ``None`` (the
    run's) for any other."""
    turns = spec.num_turns
    return 1 if not turns.draws and max(1, round(turns.sample(None))) == 1 else None


def scenario_of(sim: SimScenario, seed: int) -> Scenario:
    """The controller's ``Scenario`` for ``sim`` (validated; raises ``ConfigError``)."""
    alpha = MODE_ALPHA.get(sim.mode, sim.alpha)
    run = RunConfig(
        seed=seed, steps=sim.steps, mode=sim.mode,  # type: ignore[arg-type]
        alpha=sim.alpha if alpha is None else alpha, batch_size=sim.batch_size,
        group_size=sim.group_size, redundancy=sim.redundancy,
        selection=sim.selection,  # type: ignore[arg-type]
        selection_deadline_s=sim.selection_deadline_s,
        max_turns=sim.max_turns, max_tokens_per_turn=sim.max_tokens_per_turn,
        max_tokens_per_trajectory=sim.max_tokens_per_trajectory, reprefill=sim.reprefill,
        generate_timeout_s=sim.generate_timeout_s, env_timeout_s=sim.env_timeout_s,
        trajectory_timeout_s=sim.trajectory_timeout_s, group_timeout_s=sim.group_timeout_s,
        abort_stale=sim.abort_stale, retry=RetryConfig(max_attempts=sim.max_attempts),
        adaptive_affinity=sim.adaptive_affinity or AdaptiveAffinityConfig(),
        **{f: v for f in POLICY_FIELDS if (v := getattr(sim, f)) is not None},
    )
    pools = [PoolConfig(name=p.name, hardware=p.hardware, num_workers=p.num_workers,
                        engine=EngineConfig(max_num_seqs=p.max_batch, tensor_parallel_size=p.tp))
             for p in sim.pools]
    domains = [DomainConfig(name=d.spec.name, env=ENV_PREFIX + d.spec.name, pool=d.pool,
                            reward="sim", reward_url="service", weight=d.weight,
                            alpha=d.alpha, max_turns=_turn_cap(d.spec))
               for d in sim.domains]
    # The simulated trainer's micro-batch budget only has to admit a full-length sample.
    trainer = TrainerConfig(max_tokens_per_microbatch=max(8192, sim.max_tokens_per_trajectory))
    return validate_scenario(Scenario(pools=pools, domains=domains, run=run, trainer=trainer),
                             "<simulated>")


class SimCluster:
    """The simulated backends of one run, and the real controller wired to them."""

    def __init__(self, sim: SimScenario, seed: int) -> None:
        self.sim, self.seed = sim, seed
        self.scenario = scenario_of(sim, seed)
        self.table = DomainTable([d.spec for d in sim.domains])
        model = get_model(sim.model)
        self.workers: dict[str, list[SimInferenceWorker]] = {
            p.name: [SimInferenceWorker(f"{p.name}-{i}", hardware=sim.engine_hardware(p.hardware),
                                        model=model, domains=self.table, seed=seed, tp=p.tp,
                                        max_batch=p.max_batch, eff=sim.eff,
                                        max_num_batched_tokens=sim.max_num_batched_tokens,
                                        prefix_cache=sim.prefix_cache)
                     for i in range(p.num_workers)]
            for p in sim.pools
        }
        opens: collections.Counter[tuple[str, int]] = collections.Counter()
        self.env_hosts = [SimEnvHost(f"env-{i}", self.table, seed=seed, opens=opens,
                                     max_concurrent_steps=sim.env_max_concurrent_steps)
                          for i in range(sim.env_hosts)]
        service: Callable[[str, str], float] | None = None
        if sim.reward_gpus:
            tok, reward_hw = SimTokenizer(self.table), get_hardware(sim.reward_hardware)

            def judge_s(prompt: str, response: str) -> float:
                n = len(tok.encode(prompt)) + _generated(response)
                return costs.prefill_s(model, reward_hw, n, eff=sim.eff)

            service = judge_s

        self.reward = SimReward(latency_s=sim.reward_latency_s, seed=seed,
                                max_concurrency=sim.reward_gpus or None, service_s=service)
        trainer_hw = sim.engine_hardware(sim.trainer_hardware)
        nodes = -(-sim.trainer_gpus // sim.gpus_per_node)
        self.trainer: SimTrainer = SimTrainer(model=model, hardware=trainer_hw, num_gpus=sim.trainer_gpus,
                                  eff=sim.eff,
                                  egress_bytes_per_s=(nodes * trainer_hw.link_bytes_per_s
                                                      if sim.shared_trainer_egress else None),
                                  delta_bytes_fraction=sim.weight_delta_fraction,
                                  full_every=sim.weight_full_every,
                                  delta_encode_bytes_per_s=sim.delta_encode_bytes_per_s,
                                  delta_rebuild_bytes_per_s=sim.delta_rebuild_bytes_per_s,
                                  push_needs_pause=sim.push_at_pause)
        if sim.check not in (None, "per_turn", "admission"):
            raise ValueError(f"SimScenario.check must be per_turn or admission, got {sim.check!r}")
        # No stall watchdog: its timer would hide a deadlock from the virtual clock's idle
        # detection. The loop's clock (virtual or not) is the controller's.
        self.controller = build_controller(
            self.scenario, Backends(pools=self.workers, trainer=self.trainer,
                                    tokenizer=SimTokenizer(self.table),
                                    env_hosts=self.env_hosts, reward_service=self.reward),
            stall_watchdog=False, check=sim.check)
        self.proxy = self.controller.proxy

    async def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` (default ``sim.steps``) training steps; metrics as dicts."""
        out = []
        try:
            for k in range(1, (steps if steps is not None else self.sim.steps) + 1):
                metrics = await self.controller.step()
                out.append(_as_dict(metrics))
                for after, domain, weight in self.sim.weight_changes:
                    if after == k:
                        self.controller.set_domain_weight(domain, weight)
        finally:
            await self.controller.close()
        return out


def _generated(response: str) -> int:
    """Tokens of a simulated response text (``SimTokenizer.decode`` writes ``<gen:N>``)."""
    if response.startswith("<gen:") and response.endswith(">"):
        return int(response[5:-1])
    return len(response.split())


def _as_dict(metrics: Any) -> dict[str, Any]:
    if isinstance(metrics, msgspec.Struct):
        return msgspec.to_builtins(metrics)  # nested structs (by_domain) too
    if hasattr(metrics, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(metrics)
    return dict(metrics)


def run_simulated(sim: SimScenario, seed: int = 0, *, virtual: bool = True,
                  warmup: int = 1) -> SimResult:
    """Run ``sim`` with the real controller and return its metrics (see ``SimResult``).

    ``warmup``: leading steps left out of ``step_time_s`` (the first step of an overlapping
    mode has nothing to overlap with). Raises ``ValueError`` if ``steps <= warmup``.
    """
    if sim.steps <= warmup:
        raise ValueError(f"steps ({sim.steps}) must exceed warmup ({warmup})")
    cluster_box: list[SimCluster] = []
    times: list[float] = []

    async def main() -> list[dict[str, Any]]:
        cluster = SimCluster(sim, seed)
        cluster_box.append(cluster)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            return await cluster.run()
        finally:
            times.append(loop.time() - t0)

    wall0 = time.perf_counter()
    steps = run_virtual(main) if virtual else run_real(main, use_uvloop=False)
    wall = time.perf_counter() - wall0
    cluster = cluster_box[0]
    return SimResult(
        mode=sim.mode, steps=steps,
        step_time_s=statistics.fmean(s["step_time_s"] for s in steps[warmup:]),
        total_time_s=times[0], wall_s=wall,
        buffer=msgspec.to_builtins(cluster.controller.buffer.stats()),
        workers={w.name: {"busy_s": w.busy_s, "generated_tokens": w.num_generated_tokens,
                          "prefill_tokens": w.prefill_tokens,
                          "prefix_hit_tokens": w.prefix_hit_tokens,
                          "cache_evicted_tokens": w.cache_evicted_tokens}
                 for ws in cluster.workers.values() for w in ws},
        env_step_latencies=[x for h in cluster.env_hosts for x in h.step_latencies],
        session_latencies=sorted((v for h in cluster.env_hosts
                                  for v in h.session_latencies.values()), key=lambda v: v[0]),
        push_times_s=list(cluster.trainer.push_times_s),
        reward_utilisation=(cluster.reward.busy_s / (times[0] * sim.reward_gpus)
                            if sim.reward_gpus and times[0] > 0 else 0.0),
        reward_calls=cluster.reward.num_calls, reward_busy_s=cluster.reward.busy_s,
    )
