"""The simulated workloads and clusters the benchmarks share (SIMULATED; see rollart.sim).

Two task families, after the paper's mix (§2, §7): a *decode-heavy* reasoning domain (short
prompt, long lognormal responses, one turn, reward only) and a *prefill-heavy* agentic domain
(long prompt and observations, short responses, many turns, env latency).

GRPO batch 512, group 8 (paper §7.1) counts **samples** (trajectories): 512 trajectories per
step = 64 groups (prompts / env seeds) of 8. Why: RollArt is built on ROLL (paper §1, §5) and
its agentic workloads run ROLL's agentic pipeline, where ``rollout_batch_size`` "is the number
of trajectories" and equals ``num_env_groups x group_size`` (ROLL's agentic example configs:
1024 = 128 groups x 8); only ROLL's single-turn RLVR pipeline counts prompts
(``rollout_batch_size: 512  # prompt``). The paper's O(alpha x E) bound on pending
trajectories is likewise stated in trajectories. Hence ``batch_size=512`` here, which is what
``rollart.config.RunConfig.batch_size`` counts (samples per ``take_batch``, a multiple of
``group_size``). Read as prompts, every step would train 4096 trajectories: 8x the rollout
and training work per step, so step times (not the side-by-side ratios' direction) would
scale accordingly.
"""

from __future__ import annotations

import dataclasses

from rollart.sim.harness import SimDomain, SimPool, SimScenario
from rollart.sim.workload import Dist, DomainSpec, const

#: engine tensor-parallel degree per model profile (weights + KV must fit an H800)
TP = {"qwen3-8b": 1, "qwen3-14b": 2, "qwen3-32b": 4, "qwen3-30b-a3b": 2}


def reasoning(name: str = "reasoning", mean_len: float = 4000, std_len: float = 3000
              ) -> DomainSpec:
    """Decode-heavy: 512-token prompt, lognormal response, single turn."""
    return DomainSpec(name, prompt_tokens=const(512),
                      response_tokens=Dist("lognormal", mean_len, std_len, 16, 1e9),
                      num_turns=const(1), step_latency_s=const(0.0))


def agentic(name: str = "agentic", *, latency_mean_s: float = 3.0, latency_std_s: float = 3.0,
            kind: str = "lognormal", turns: float = 8, prompt: float = 6000,
            obs: float = 1500, failure_prob: float = 0.0) -> DomainSpec:
    """Prefill-heavy: long prompt, long observations, short responses, ``turns`` turns."""
    return DomainSpec(name, prompt_tokens=const(prompt), obs_tokens=const(obs),
                      response_tokens=Dist("lognormal", 200, 150, 8, 1e9),
                      num_turns=Dist("uniform", turns, turns / 4, 1, 1e9),
                      step_latency_s=Dist(kind, latency_mean_s, latency_std_s, 0.0, 1e9),
                      reset_latency_s=const(0.5), step_failure_prob=failure_prob)


def paper_cluster(model: str, *, quick: bool, mode: str = "rollart", alpha: int = 1,
                  steps: int | None = None, affinity: bool = True,
                  reprefill: bool = False) -> SimScenario:
    """The paper's default 96 x H800 + 32 x H20 (§7): 32 H800 train, 64 H800 + 32 H20 roll
    out; prefill-heavy domain -> H800, decode-heavy -> H20. GRPO batch 512, group 8.
    ``quick``: an eighth of it (12 H800 + 4 H20, batch 64).

    ``affinity=False``: one homogeneous pool as a system without hardware affinity sees it
    (AReaL): every domain goes to every engine, in proportion to each pool's engine count
    (each domain is split into one copy per pool, weighted so). ``reprefill``: running
    requests recompute their KV after each weight update (AReaL's interrupt + re-prefill)."""
    tp = TP[model]
    scale = 8 if quick else 1
    h800, h20, train = 64 // scale, 32 // scale, 32 // scale
    pools = (SimPool("h800", "h800", max(1, h800 // tp), tp=tp, max_batch=128),
             SimPool("h20", "h20", max(1, h20 // tp), tp=tp, max_batch=128))
    if affinity:
        domains = (SimDomain(agentic(), "h800"), SimDomain(reasoning(), "h20"))
    else:
        domains = tuple(SimDomain(dataclasses.replace(spec, name=f"{spec.name}-{p.name}"),
                                  p.name, weight=p.num_workers)
                        for spec in (agentic(), reasoning()) for p in pools)
    return SimScenario(pools=pools, domains=domains, model=model, mode=mode, alpha=alpha,
                       steps=steps or (4 if quick else 6), batch_size=512 // scale,
                       group_size=8, trainer_gpus=train, max_tokens_per_turn=16384,
                       max_tokens_per_trajectory=32768, reprefill=reprefill)
