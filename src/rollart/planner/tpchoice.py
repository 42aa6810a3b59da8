"""The engines' tensor-parallel degree per pool, predicted from the cost model instead of
searched, and the order the search runs its first candidates in.

Doubling an engine's tensor parallelism halves the engines a pool's GPUs make and doubles each
one's FLOP/s and bandwidth (``rollart.sim.costs``), less the all-reduce. Which wins depends on
the load: each engine then holds twice the sequences, so a decode step reads the weights once
for twice the batch at twice the bandwidth (per-token latency falls) unless the doubled batch
no longer fits the engine's batch slots or KV cache (it queues in waves) or the all-reduce
outweighs the saved weight reads. Simulating both degrees for every layout triples the
planner's search space, more than a small budget can cover, so the planner predicts the
choice per layout with the same roofline the simulator charges (``predicted_pool_s``) and
searches only the predicted degree. The plan benchmark's exhaustive sweep runs both degrees,
so it checks this prediction.

The prediction is a bound on one step's rollout for the pool (the slowest of its domains'
trajectories, every turn's decode at the pool's concurrent batch plus its prefill, in as many
waves as the engine's batch slots and KV room need), not a simulation: no queueing between
turns, env latency (the same at either degree) or prefix-cache effects.

The same bound orders the search's first rung (``predicted_step_s``: the slowest pool's
rollout or the trainer's step over the batch's tokens, whichever is longer), so that a budget
that covers only part of the rung spends it on the layouts the cost model ranks first rather
than on a random part of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rollart.sim.costs import decode_step_s, kv_capacity_tokens, step_s, train_step_s
from rollart.sim.hardware import HardwareProfile
from rollart.sim.models import ModelProfile
from rollart.sim.workload import DomainSpec

#: KV room an engine's memory leaves: the simulated engines' (``sim.worker.SimInferenceWorker``'s
#: ``memory_utilization`` default, vLLM's ``gpu_memory_utilization`` default)
MEMORY_UTILIZATION = 0.9


def predicted_pool_s(model: ModelProfile, hw: HardwareProfile, *, gpus: int, tp: int,
                     max_batch: int, domains: Sequence[tuple[DomainSpec, float]],
                     max_tokens_per_turn: int) -> float:
    """Predicted seconds of one step's rollout on a pool of ``gpus`` GPUs of ``hw`` cut into
    engines of ``tp`` ranks (module docstring); ``math.inf`` when no engine fits (``gpus <
    tp``) or the weights leave no KV room.

    Args:
        domains: (workload, trajectories per step) of each domain the pool serves.
        max_batch: sequences an engine runs at once (``max_num_seqs``).
        max_tokens_per_turn: the cap on a turn's response (num_tokens).
    """
    engines = gpus // tp
    total = sum(n for _, n in domains)
    if engines < 1:
        return math.inf
    if total <= 0:
        return 0.0
    try:
        kv_room = kv_capacity_tokens(model, hw, tp=tp, memory_utilization=MEMORY_UTILIZATION)
    except ValueError:
        return math.inf
    shapes = []
    for spec, n in domains:
        turns = max(1.0, spec.num_turns.mean)
        resp = min(spec.response_tokens.mean, max_tokens_per_turn)
        new = (spec.prompt_tokens.mean + (turns - 1) * spec.obs_tokens.mean) / turns
        # mean context a decoded token attends: the prompt, half the later turns, half a response
        ctx = spec.prompt_tokens.mean + (turns - 1) / 2 * (resp + spec.obs_tokens.mean) + resp / 2
        shapes.append((n, turns, resp, new, ctx))
    mean_ctx = sum(n * ctx for n, *_, ctx in shapes) / total
    per_engine = math.ceil(total / engines)
    batch = max(1, min(per_engine, max_batch, int(kv_room // max(mean_ctx, 1.0))))
    waves = math.ceil(per_engine / batch)
    step = decode_step_s(model, hw, batch, batch * mean_ctx, tp=tp)
    # a turn's new tokens of the whole batch prefilled in one pass, each request attending
    # its own new tokens causally
    slowest = max(turns * (resp * step + step_s(
        model, hw, decode_seqs=0, decode_kv_tokens=0, prefill_tokens=int(batch * new),
        prefill_keys=batch * new * (new + 1) / 2, tp=tp)) for _, turns, resp, new, _ in shapes)
    return waves * slowest


def trajectory_tokens(spec: DomainSpec, max_tokens_per_turn: int) -> float:
    """Mean tokens of one trajectory of ``spec`` as the trainer sees it (num_tokens): the
    prompt, every turn's response (capped at ``max_tokens_per_turn``) and every later turn's
    observation."""
    turns = max(1.0, spec.num_turns.mean)
    return (spec.prompt_tokens.mean + turns * min(spec.response_tokens.mean, max_tokens_per_turn)
            + (turns - 1) * spec.obs_tokens.mean)


def predicted_step_s(model: ModelProfile, *, pool_s: Sequence[float],
                     trainer: HardwareProfile, trainer_gpus: int,
                     batch: Sequence[tuple[DomainSpec, float]],
                     max_tokens_per_turn: int) -> float:
    """Predicted seconds of one step of a layout whose rollout and training overlap: the
    longer of its slowest pool's rollout (``pool_s``: each pool's ``predicted_pool_s``) and
    the trainer's step (``rollart.sim.costs.train_step_s`` on ``trainer_gpus`` of
    ``trainer``) over the tokens of ``batch`` ((workload, trajectories per step) per domain).
    A ranking, not a simulation (module docstring)."""
    tokens = sum(n * trajectory_tokens(spec, max_tokens_per_turn) for spec, n in batch)
    return max(train_step_s(model, trainer, int(tokens), num_gpus=trainer_gpus), *pool_s)
