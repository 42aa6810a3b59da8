"""What the planner reads from a scenario: the GPU inventory, the model, the task domains.

The inventory is what the scenario already uses: per hardware label, the GPUs of its pools
(``num_workers`` x ``engine.tensor_parallel_size``) plus the trainer's ranks
(``trainer.num_processes``, one GPU each) on the trainer's label (``trainer.ray_resource``
when it names a pool's hardware, else the label with the most FLOP/s). A layout is a way to
spend that inventory: trainer ranks, one pool per hardware label, each domain on one pool.

Workload profiles (``rollart.sim.workload.DomainSpec``) come from ``profiles=`` when given
(``rollart.planner.measured`` measures them from a run folder), else from each domain's env
family, the benchmarks' two shapes (ASSUMPTION, stated so the
user can override it): a reasoning-gym env (``rg:``) or a single-turn domain is
decode-heavy (512-token prompt, lognormal responses of half ``max_tokens_per_turn`` up to
4000 tokens), anything else is a multi-turn agentic task (6000-token prompt, 1500-token
observations, 200-token actions, up to 8 turns, 3 s +- 3 s env steps), shrunk to fit
``max_tokens_per_trajectory``.

Memory (refusals name what is short):

- an engine holds the weights and one full-length trajectory's KV cache, split over its
  tensor-parallel ranks: ``(weight_bytes + kv_bytes_per_token x max_tokens_per_trajectory) /
  tp <= memory_bytes x gpu_memory_utilization`` (vLLM's default utilisation 0.9); the
  smallest ``tp`` in 1, 2, 4, 8 that fits (at least the pool's own) is used;
- the trainer holds 16 bytes per parameter (mixed-precision Adam: fp16 weights and
  gradients, fp32 master weights and two moments; Rajbhandari et al., ZeRO, SC'20, §3.1)
  sharded over its ranks (FSDP), activations not counted: a lower bound on trainer GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollart.config import Scenario
from rollart.envhost.families import family_turn_cap
from rollart.sim.hardware import HARDWARE, HardwareProfile, get_hardware
from rollart.sim.harness import MODE_ALPHA
from rollart.sim.models import MODELS, ModelProfile, get_model
from rollart.sim.workload import Dist, DomainSpec, const

#: tensor-parallel degrees an engine may use (one node of 8 GPUs at most)
TP_CHOICES = (1, 2, 4, 8)
#: vLLM's default ``gpu_memory_utilization``
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: trainer bytes per parameter (mixed-precision Adam, ZeRO §3.1)
TRAIN_BYTES_PER_PARAM = 16
#: the trainer's ranks run on one node of this many GPUs (``rollart.launcher.placement``)
GPUS_PER_NODE = 8


class PlanError(ValueError):
    """A plan that cannot be made: the message names what is short or unknown."""


@dataclass(frozen=True)
class PlanInputs:
    """The planner's view of a scenario (see the module docstring).

    ``gpus``: GPUs per hardware label (whole inventory, trainer included); ``tp``: the engine
    tensor-parallel degree per label; ``pool_names``: the pool name per label (the input's);
    ``trainer_label`` / ``trainer_min``: where the trainer runs and its fewest GPUs;
    ``profiles``: one workload per domain, in the scenario's order.
    """

    scenario: Scenario
    model: ModelProfile
    gpus: dict[str, int]
    tp: dict[str, int]
    pool_names: dict[str, str]
    max_batch: dict[str, int]
    trainer_label: str
    trainer_min: int
    profiles: tuple[DomainSpec, ...]
    #: alpha and redundancy values to search (None: 1-2 and 0-1 plus the scenario's own)
    alphas: tuple[int, ...] | None = None
    redundancies: tuple[int, ...] | None = None

    @property
    def domain_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.scenario.domains)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.gpus)

    @property
    def searches_alpha(self) -> bool:
        """Whether the run's mode takes any alpha (``areal``, ``rollart``)."""
        return MODE_ALPHA.get(self.scenario.run.mode, 0) is None

    def hardware(self, label: str) -> HardwareProfile:
        return get_hardware(label)


def profile_name(model_path: str) -> str:
    """The simulated profile a ``model.path`` names: its last component, lower case."""
    return model_path.rstrip("/").rsplit("/", 1)[-1].lower()


def option(param: str, cli: bool) -> str:
    """An argument as its user spells it: ``--profiles-from`` on the command line (``cli``),
    ``profiles_from=`` in a ``rollart.plan(...)`` call."""
    return "--" + param.replace("_", "-") if cli else f"{param}="


def given(name: str, value: str) -> str:
    """An argument and its value as the user typed them: ``--budget-s 5`` when ``name`` is a
    command-line option, ``budget_s=5`` when it is a keyword of ``rollart.plan(...)``."""
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


def model_profile(scenario: Scenario, model: str | None, *, cli: bool = False) -> ModelProfile:
    """The simulated profile ``model`` or the one named by ``model.path``'s last component
    (``/models/Qwen3-8B`` -> ``qwen3-8b``). Raises PlanError naming the known profiles and
    the argument as ``cli`` spells it (:func:`option`)."""
    if model is not None:
        try:
            return get_model(model)
        except KeyError:
            raise PlanError(f"{given('--model' if cli else 'model', repr(model))}: no "
                            f"simulated model profile of that name; known: {sorted(MODELS)}"
                            ) from None
    name = profile_name(scenario.model.path)
    try:
        return get_model(name)
    except KeyError:
        raise PlanError(f"model.path {scenario.model.path!r}: no simulated model profile "
                        f"{name!r}; pass {option('model', cli)} one of {sorted(MODELS)}") from None


#: hardware labels the planner lays out: the simulator's GPU profiles
GPU_LABELS = tuple(sorted(k for k in HARDWARE if k != "cpu"))


def _refuse_cpu(scenario: Scenario, model: str | None, cli: bool) -> None:
    """Raise PlanError for a scenario with CPU pools, or the CPU test model without
    ``model``: the planner lays out simulated GPU hardware; a CPU run has no GPUs to split."""
    cpu = [p.name for p in scenario.pools if p.hardware.lower() == "cpu"]
    if cpu or (scenario.model.path == "tiny" and model is None):
        what = (f"pools {cpu} run on hardware 'cpu'" if cpu
                else "model.path 'tiny' is the project's CPU test model")
        raise PlanError(f"{what}: the planner plans layouts of simulated GPU hardware profiles "
                        f"({', '.join(GPU_LABELS)}) for simulated models ({', '.join(sorted(MODELS))}); "
                        f"give each pool one of these hardware labels (and {option('model', cli)} for a model.path "
                        f"without a profile)")


def engine_tp(model: ModelProfile, hw: HardwareProfile, *, utilisation: float,
              max_tokens: int, at_least: int = 1) -> int:
    """Fewest tensor-parallel ranks (of ``TP_CHOICES``, >= ``at_least``) whose memory holds
    the weights and ``max_tokens`` of KV cache. Raises PlanError naming bytes needed and
    available when even 8 ranks do not."""
    need = model.weight_bytes + model.kv_bytes_per_token * max_tokens
    have = hw.memory_bytes * utilisation
    for tp in TP_CHOICES:
        if tp >= at_least and need / tp <= have:
            return tp
    raise PlanError(
        f"hardware {hw.name!r} cannot hold model {model.name!r}: weights "
        f"{model.weight_bytes / 1e9:.1f} GB + KV of one {max_tokens}-token trajectory "
        f"{model.kv_bytes_per_token * max_tokens / 1e9:.1f} GB need "
        f"{need / TP_CHOICES[-1] / 1e9:.1f} GB per GPU even at tensor parallel "
        f"{TP_CHOICES[-1]}, and a GPU gives {have / 1e9:.1f} GB ({hw.memory_bytes / 1e9:.0f} GB "
        f"x gpu_memory_utilization {utilisation:g})")


def default_profile(name: str, env: str, turns: int, max_tokens_per_turn: int,
                    max_tokens_per_trajectory: int) -> DomainSpec:
    """The assumed workload of a domain (module docstring): decode-heavy for ``rg:`` envs or
    one turn, else multi-turn agentic, token counts shrunk to fit the trajectory cap."""
    if family_turn_cap(env) == 1 or turns <= 1:
        mean = min(4000.0, max(16.0, max_tokens_per_turn / 2))
        return DomainSpec(name, prompt_tokens=const(min(512, max_tokens_per_trajectory // 4)),
                          response_tokens=Dist("lognormal", mean, 0.75 * mean, 16, 1e9),
                          num_turns=const(1), step_latency_s=const(0.0))
    turns = min(8, turns)
    prompt, obs, act = 6000.0, 1500.0, 200.0
    shrink = min(1.0, 0.8 * max_tokens_per_trajectory / (prompt + turns * (obs + act)))
    act = max(8.0, min(act * shrink, max_tokens_per_turn / 2))
    return DomainSpec(name, prompt_tokens=const(max(1.0, round(prompt * shrink))),
                      obs_tokens=const(max(1.0, round(obs * shrink))),
                      response_tokens=Dist("lognormal", act, 0.75 * act, 8, 1e9),
                      num_turns=Dist("uniform", turns, turns / 4, 1, 1e9),
                      step_latency_s=Dist("lognormal", 3.0, 3.0, 0.0, 1e9),
                      reset_latency_s=const(0.5))


def read_inputs(scenario: Scenario, *, model: str | None = None,
                profiles: dict[str, DomainSpec] | None = None, cli: bool = False) -> PlanInputs:
    """The planner's inputs from a validated ``scenario`` (module docstring). Raises
    PlanError: a pool given by worker addresses (its size is not the planner's to change), a
    hardware label or model without a simulated profile, hardware that cannot hold the
    model, fewer GPUs than the trainer plus one engine per domain, or CPU pools (the
    planner plans GPU layouts). ``cli``: messages spell arguments as ``rollart plan`` does
    (:func:`option`)."""
    _refuse_cpu(scenario, model, cli)
    mdl = model_profile(scenario, model, cli=cli)
    run = scenario.run
    gpus: dict[str, int] = {}
    tp: dict[str, int] = {}
    names: dict[str, str] = {}
    max_batch: dict[str, int] = {}
    for pool in scenario.pools:
        if pool.addresses:
            raise PlanError(f"pools.{pool.name}: given by worker addresses; the planner sizes "
                            "pools of workers it starts only (num_workers)")
        label = pool.hardware.lower()
        if label not in HARDWARE:
            raise PlanError(f"pools.{pool.name}.hardware: no simulated profile {label!r}; "
                            f"known: {list(GPU_LABELS)}")
        util = pool.engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        need = engine_tp(mdl, get_hardware(label), utilisation=util,
                         max_tokens=run.max_tokens_per_trajectory,
                         at_least=pool.engine.tensor_parallel_size)
        gpus[label] = gpus.get(label, 0) + pool.num_workers * pool.engine.tensor_parallel_size
        tp[label] = max(tp.get(label, 1), need)
        names.setdefault(label, pool.name)
        max_batch.setdefault(label, pool.engine.max_num_seqs or 256)
    resource = (scenario.trainer.ray_resource or "").lower()
    trainer_label = resource if resource in gpus else max(gpus, key=lambda k: get_hardware(k).flops)
    gpus[trainer_label] += scenario.trainer.num_processes
    thw = get_hardware(trainer_label)
    trainer_min = max(1, math.ceil(TRAIN_BYTES_PER_PARAM * mdl.total_params
                                   / (thw.memory_bytes * DEFAULT_GPU_MEMORY_UTILIZATION)))
    _check_enough(gpus, tp, trainer_label, trainer_min, len(scenario.domains), mdl)
    profiles = profiles or {}
    unknown = sorted(set(profiles) - {d.name for d in scenario.domains})
    if unknown:
        raise PlanError(f"profiles for domains the scenario does not have: {unknown}")
    specs = []
    for d in scenario.domains:
        spec = profiles.get(d.name) or default_profile(
            d.name, d.env, d.max_turns or run.max_turns, run.max_tokens_per_turn,
            run.max_tokens_per_trajectory)
        if spec.name != d.name:
            raise PlanError(f"profiles[{d.name!r}] is named {spec.name!r}")
        specs.append(spec)
    return PlanInputs(scenario=scenario, model=mdl, gpus=gpus, tp=tp, pool_names=names,
                      max_batch=max_batch, trainer_label=trainer_label,
                      trainer_min=trainer_min, profiles=tuple(specs))


def _check_enough(gpus: dict[str, int], tp: dict[str, int], trainer_label: str,
                  trainer_min: int, num_domains: int, model: ModelProfile) -> None:
    """Raise PlanError unless the trainer's fewest GPUs and one engine per domain fit."""
    if gpus[trainer_label] < trainer_min:
        raise PlanError(
            f"trainer: model {model.name!r} needs at least {trainer_min} {trainer_label} GPUs "
            f"to train ({TRAIN_BYTES_PER_PARAM} bytes per parameter), the scenario has "
            f"{gpus[trainer_label]}: short by {trainer_min - gpus[trainer_label]}")
    engines = sum((n - (trainer_min if label == trainer_label else 0)) // tp[label]
                  for label, n in gpus.items())
    if engines < num_domains:
        have = ", ".join(f"{n} x {label}" for label, n in gpus.items())
        raise PlanError(
            f"{have} GPUs hold the trainer ({trainer_min} x {trainer_label}) and {engines} "
            f"engine(s) (tensor parallel {tp}), fewer than one per domain ({num_domains}): "
            f"short by {num_domains - engines} engine(s)")


def check_trainer_limits(inputs: PlanInputs, rows: int) -> None:
    """Raise PlanError when the trainer's fewest GPUs (``inputs.trainer_min``) exceed what
    a trainer may have: one node of ``GPUS_PER_NODE``, or ``rows`` (one rank per row of a
    minibatch: ``run.batch_size // trainer.num_minibatches``)."""
    sc, need = inputs.scenario, inputs.trainer_min
    why = (f"model {inputs.model.name!r} needs at least {need} trainer GPUs "
           f"({inputs.trainer_label}, {TRAIN_BYTES_PER_PARAM} bytes per parameter)")
    if need > GPUS_PER_NODE:
        raise PlanError(f"trainer: {why}, more than one node of {GPUS_PER_NODE}: the "
                        f"trainer's ranks run on one node; use GPUs with more memory or a "
                        f"smaller model")
    if need > rows:
        raise PlanError(
            f"trainer: {why}, but run.batch_size // trainer.num_minibatches = "
            f"{sc.run.batch_size} // {sc.trainer.num_minibatches} = {rows} row(s) per "
            f"minibatch, and every rank needs at least one: raise run.batch_size to "
            f"{need * sc.trainer.num_minibatches} or lower trainer.num_minibatches")


def raw_of(scenario: Scenario) -> dict[str, Any]:
    """``scenario`` as TOML-ready builtins (``None`` fields left out: their defaults)."""
    import msgspec

    def prune(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: prune(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [prune(x) for x in v]
        return v

    return prune(msgspec.to_builtins(scenario))
