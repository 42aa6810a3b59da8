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
from typing import Literal

from rollart.sim.harness import SimDomain, SimPool, SimScenario
from rollart.sim.workload import Dist, DomainSpec, const

#: engine tensor-parallel degree per model profile (weights + KV must fit an H800)
TP = {"qwen3-8b": 1, "qwen3-14b": 2, "qwen3-32b": 4, "qwen3-30b-a3b": 2}


# Where each number of the two domains comes from. A number with no public source says so;
# none is fitted to the RollArt paper's end-to-end results.
#
# reasoning (thinking mode, one turn):
#: prompt: ASSUMED, no public source found for the paper's math / code prompts (a competition
#: problem plus the chat template is a few hundred tokens).
REASONING_PROMPT_TOKENS = 512
#: mean response in thinking mode: Qwen3 chains of thought on GPQA Diamond average ~4,639
#: tokens for Qwen3-14B and 14,566 for Qwen3-0.6B (Khalafyan, "Better Thinking or a Bigger
#: Model? Thinking-Answering Shuffles with Qwen3 on GPQA", MPCS journal,
#: https://mpcs.sci.am/index.php/mpcs/article/view/903, abstract; smaller thinkers run
#: longer). 4,000 sits at the 14B figure, below it for the harder 32B tasks of the paper;
#: the paper's §3 decode-heavy example uses 8k (``rollart.sim.calibration.DECODE_HEAVY``).
REASONING_MEAN_TOKENS = 4000
#: std of the response length: ASSUMED, no public source found for Qwen3's length spread
#: (the lognormal's long right tail stands in for it).
REASONING_STD_TOKENS = 3000
#
# agentic (non-thinking actions, many turns):
#: first prompt (system prompt, tool schemas, task): ASSUMED, no public per-turn token counts
#: found for the paper's agentic tasks. Published SWE-bench trajectory studies report totals
#: only (Bai et al., "How Do AI Agents Spend Your Money?", arXiv 2604.22750: agentic coding is
#: input-token dominated, ~1000x a chat's tokens).
AGENTIC_PROMPT_TOKENS = 6000
#: each later observation (tool output): ASSUMED, no public source found (as above).
AGENTIC_OBS_TOKENS = 1500
#: action (response) length, mean / std: ASSUMED, no public source found (a tool call with a
#: short rationale, thinking off).
AGENTIC_RESPONSE_MEAN, AGENTIC_RESPONSE_STD = 200, 150
#: turns per episode: ASSUMED (a short-horizon task). For scale, SWE-agent trajectories on
#: SWE-Bench Pro have a median of 29-78 steps per task depending on the model (nilenso,
#: "SWE-Bench Pro trajectory analysis", https://nilenso.github.io/
#: swe-bench-pro-cost-token-time-analysis/reference.html, §1 "Trajectory Metadata"); the
#: simulated domain is an eight-turn task, not SWE-bench.
AGENTIC_TURNS = 8
#: env step latency, mean / std seconds: ASSUMED (an action that runs code or tests). For
#: scale, a scripted SWE-agent-style 50-action trajectory took 12.9 s (Daytona sandboxes),
#: 20.1 s (Kubernetes), 30.5 s (EC2) and 161.5 s (ECS/Fargate) end to end, i.e. 0.26-3.2 s per
#: action including provisioning (Daytona, "The hidden infrastructure tax in coding-agent RL",
#: https://www.daytona.io/dotfiles/the-hidden-infrastructure-tax-in-coding-agent-rl, TL;DR);
#: real test runs take longer than those scripted commands.
AGENTIC_STEP_LATENCY_S = 3.0
#: env reset latency seconds: ASSUMED, a warm sandbox (no public measurement found that
#: matches a pooled RL env).
AGENTIC_RESET_LATENCY_S = 0.5


def reasoning(name: str = "reasoning", mean_len: float = REASONING_MEAN_TOKENS,
              std_len: float = REASONING_STD_TOKENS) -> DomainSpec:
    """Decode-heavy: short prompt, lognormal response, single turn (sources above)."""
    return DomainSpec(name, prompt_tokens=const(REASONING_PROMPT_TOKENS),
                      response_tokens=Dist("lognormal", mean_len, std_len, 16, 1e9),
                      num_turns=const(1), step_latency_s=const(0.0))


def agentic(name: str = "agentic", *, latency_mean_s: float = AGENTIC_STEP_LATENCY_S,
            latency_std_s: float = AGENTIC_STEP_LATENCY_S,
            kind: Literal["const", "normal", "lognormal", "uniform"] = "lognormal",
            turns: float = AGENTIC_TURNS, prompt: float = AGENTIC_PROMPT_TOKENS,
            obs: float = AGENTIC_OBS_TOKENS, failure_prob: float = 0.0) -> DomainSpec:
    """Prefill-heavy: long prompt, long observations, short responses, ``turns`` turns
    (uniform, std ``turns / 4``: ASSUMED spread), env latency (sources above)."""
    return DomainSpec(name, prompt_tokens=const(prompt), obs_tokens=const(obs),
                      response_tokens=Dist("lognormal", AGENTIC_RESPONSE_MEAN,
                                           AGENTIC_RESPONSE_STD, 8, 1e9),
                      num_turns=Dist("uniform", turns, turns / 4, 1, 1e9),
                      step_latency_s=Dist(kind, latency_mean_s, latency_std_s, 0.0, 1e9),
                      reset_latency_s=const(AGENTIC_RESET_LATENCY_S),
                      step_failure_prob=failure_prob)


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
