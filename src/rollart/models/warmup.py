"""Demonstrations and the supervised warm-up recipe of the tiny policy.

`build_demonstrations` plays episodes of each task domain with the environments' own scripted
solvers (`rollart.envhost.solvers`) and turns every assistant turn into one (prompt, completion)
text pair. The prompt is the conversation so far rendered exactly as the controller renders it
(`rollart.controller.rollout.trajectory` / `tokens`): the chat template of
``[system_prompt?] + user(prompt_template.format(observation=reset_obs)) + assistant(a_1) +
user(turn_template.format(observation=obs_1)) + ...`` with the generation prompt; the completion
is the solver's action text. `sft_warmup` appends the eos token (``<|im_end|>``), which is where
the engine stops an assistant turn, so training and rollout see the same token sequence.

`WarmupRecipe` / `DEFAULT_RECIPE` fix how much warm-up the embedded default gets. It is kept
deliberately short: the starting policy should emit the ``\\boxed{}`` answer format but still be
weak at the tasks, so that RL has room and a reward signal (group rewards that differ). The numbers
were chosen by measurement; see the `DEFAULT_RECIPE` comment.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec

from rollart.config import DomainConfig, Scenario
from rollart.envhost.families import make_env
from rollart.envhost.solvers import exploring_action, has_solver, next_action
from rollart.models.sft import SFTConfig
from rollart.models.tiny import TinyModelSpec, ensure_tiny_model, validate_spec
from rollart.models.tokenizer import build_char_tokenizer
from rollart.models.tooldemos import CALCULATOR_ENV, play_tool_episode

#: env seeds of demonstration episodes are drawn from [0, MAX_ENV_SEED).
MAX_ENV_SEED = 2**31 - 1


class WarmupRecipe(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How the embedded default policy is built: architecture (the model seed comes from the
    scenario), number of demonstration episodes per domain, their seed, and the SFT settings."""

    spec: TinyModelSpec = msgspec.field(default_factory=TinyModelSpec)
    #: solver-played episodes per domain (a multi-turn episode yields one pair per turn).
    episodes_per_domain: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100
    #: seed of the demonstration env seeds (independent of the model seed).
    demo_seed: Annotated[int, msgspec.Meta(ge=0)] = 1234
    sft: SFTConfig = msgspec.field(default_factory=lambda: SFTConfig(epochs=1, lr=3e-3))
    #: share of demonstrated moves replaced by an exploring move (`exploring_action`: a guess
    #: drawn uniformly from GuessTheNumber's whole range, hints ignored), so that the warmed-up
    #: policy keeps sampling alternatives where it would otherwise always repeat one move.
    explore: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    #: exploring moves replace only an episode's first `explore_turns` moves; ``None``: any.
    explore_turns: Annotated[int, msgspec.Meta(ge=1)] | None = None


# Chosen by measurement on the 2-core machine with the quickstart's two domains
# (GuessTheNumber-v0-easy, 1-digit basic_arithmetic): 100 episodes per domain (~416 pairs) and
# ONE epoch at lr 3e-3 leave a policy that emits \boxed{} on ~85-90% of turns but fails the
# game's format on some turn of about half the episodes (GEM then ends it with reward -0.1)
# and is near 0 on arithmetic: sampled game return ~0.35 vs ~0.7 greedy, i.e. room for RL.
# Three epochs already reach ~0.6 sampled on the game, leaving little room.
DEFAULT_RECIPE = WarmupRecipe()

# The recipe with tool-call demonstrations (``model.tiny_warmup_tool_calls``). The calculator
# conversation's prompts are ~550-650 tokens (the tools block) and its call a ~75-token string.
# Measured (sampled at temperature 1 from the first prompt of held-out tasks): 13-60 steps of
# 4-16 at lr 3e-3..2e-2 left the call's loss at ~2.4-2.9 nats/token and 0 parseable calls; 300
# steps of 8 at 1e-2 (5% warm-up, cosine) on 100 episodes: call loss 0.11 on held-out tasks and
# 3/8 parseable calls (the rest mangle the closing tag), ~0.7 s/step on one busy core. This
# recipe, 400 such steps: call loss ~0.1 (last 25 steps' mean 0.12); 10 of 16 sampled and 10
# of 16 greedy first replies of held-out tasks parse with vLLM's hermes parser; 391 s on the
# busy 2-core machine (one thread: with two, steps took ~6 s, threads waiting on each other).
#
# Packed (`SFTConfig.pack_turns`: an episode's two pairs as one ~700-token sequence, 4 episodes
# per step = the same 8 demonstrations and 400 updates) costs ~0.55x the time per step
# (measured side by side, one thread: 1.87 vs 3.39 s/step at load 7) but is NOT used: its
# model's agent e2e run held 1, 3 and 0 tool calls in 8 conversations at run seeds 5, 6, 7
# (the test fails on 0); a probe of first replies (transformers' sampler, temperature 1, 16
# other held-out tasks) gave 4 of 16 packed vs 5 of 16 (9 greedy) for this recipe, whose e2e
# runs held 4, 3, 4 tool calls in 8 at run seeds 5 (compiled engine), 6, 7 (enforce_eager).
#
# The tokens ``<tool_call>`` / ``</tool_call>`` (`TinyModelSpec.tool_call_tokens`, as Qwen2.5's
# tokenizer has them). Spelled byte by byte, the same recipe's model was at the edge: on an AMD
# EPYC machine (seeded, one thread, last-25-step loss 0.130) 5 of 16 sampled and 7 of 16 greedy
# first replies parsed, and vLLM's e2e runs held 0 calls in 12 and in 32 conversations; 400
# episodes for 4 epochs gave 6 and 4 of 16. Almost every failure broke the closing tag after
# the argument (``"}}</tol_cal>``, ``}</tool_cal_cal>``) or its braces. With the two tokens,
# same machine and recipe: 13 of 16 sampled and 16 of 16 greedy, in 158 s instead of 264 s
# (the tags are 2 tokens, not 23).
TOOL_CALL_RECIPE = WarmupRecipe(
    spec=TinyModelSpec(tool_call_tokens=True), episodes_per_domain=100,
    sft=SFTConfig(epochs=16, lr=1e-2, batch_size=8, lr_schedule="cosine", num_threads=1))


def warmup_spec(model_seed: int = 0, recipe: WarmupRecipe = DEFAULT_RECIPE) -> WarmupRecipe:
    """The recipe with the model architecture's seed set to `model_seed` (the scenario's
    ``model.tiny_seed``); everything else as in `recipe`.

    Raises:
        msgspec.ValidationError: `model_seed` outside [0, 2**32 - 1].
    """
    spec = msgspec.structs.replace(recipe.spec, seed=model_seed)
    out = msgspec.structs.replace(recipe, spec=spec)
    return msgspec.convert(msgspec.to_builtins(out), WarmupRecipe)


def render_prompt(
    tokenizer: Any, domain: DomainConfig, observations: Sequence[str], actions: Sequence[str]
) -> str:
    """The text the controller feeds the engine before assistant turn ``len(actions) + 1``.

    ``observations[0]`` is the reset observation, ``observations[i]`` the one returned after
    ``actions[i - 1]``; ``len(observations) == len(actions) + 1``.

    Raises:
        ValueError: the lengths do not match.
    """
    if len(observations) != len(actions) + 1:
        raise ValueError(
            f"expected len(observations) == len(actions) + 1, got {len(observations)} and "
            f"{len(actions)}"
        )
    messages: list[dict[str, str]] = []
    if domain.system_prompt:
        messages.append({"role": "system", "content": domain.system_prompt})
    messages.append(
        {"role": "user", "content": domain.prompt_template.format(observation=observations[0])}
    )
    for action, obs in zip(actions, observations[1:], strict=True):
        messages.append({"role": "assistant", "content": action})
        messages.append({"role": "user", "content": domain.turn_template.format(observation=obs)})
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **domain.chat_template_kwargs
    )


def play_episode(
    domain: DomainConfig, seed: int, tokenizer: Any, *, max_turns: int, explore: float = 0.0,
    explore_turns: int | None = None,
) -> list[tuple[str, str]]:
    """Play one episode of `domain` with its scripted solver from env `seed`; each of the first
    `explore_turns` moves (``None``: every move) is replaced with probability `explore` by
    `exploring_action` (where the env has one), drawn from a generator seeded by `seed`.

    Returns:
        One (prompt, completion) pair per assistant turn, at most `max_turns`, in turn order.

    Raises:
        NoSolverError: the domain's env has no solver.
        rollart.envhost.families.EnvSpecError: unknown env or bad ``env_options``.
    """
    env = make_env(domain.env, domain.env_options)
    try:
        obs, info = env.reset(seed)
        observations, actions, pairs = [obs], [], []
        rng = random.Random(seed)
        for turn in range(max_turns):
            action = next_action(domain.env, observations, actions, info)
            may_explore = explore_turns is None or turn < explore_turns
            if explore and may_explore and rng.random() < explore:
                action = exploring_action(domain.env, observations, rng) or action
            pairs.append((render_prompt(tokenizer, domain, observations, actions), action))
            obs, _, terminated, truncated, _ = env.step(action)
            actions.append(action)
            observations.append(obs)
            if terminated or truncated:
                break
        return pairs
    finally:
        env.close()


def build_demonstrations(
    domains: Sequence[DomainConfig],
    num_examples: int,
    seed: int,
    *,
    max_turns: int = 8,
    tokenizer: Any = None,
    tool_calls: bool = False,
    explore: float = 0.0,
    explore_turns: int | None = None,
) -> list[tuple[str, str]]:
    """Solver demonstrations for every domain that has a scripted solver.

    Args:
        domains: task domains (env name, options, prompt/turn templates, system prompt).
        num_examples: episodes per domain (>= 1); multi-turn episodes give one pair per turn.
        seed: draws the env seeds (distinct per episode within a domain) with `random.Random`.
        max_turns: cap on turns per episode when a domain sets none (the run's ``max_turns``).
        tokenizer: renders the chat template; default: the tiny model's character tokenizer.
        tool_calls: ``rg:basic_arithmetic`` domains play the calculator agent's conversation
            (`rollart.models.tooldemos.play_tool_episode`: two pairs per episode) instead of
            the gym loop.
        explore: share of moves replaced by an exploring move (`play_episode`).
        explore_turns: only an episode's first `explore_turns` moves may be replaced
            (`play_episode`); ``None``: any move.

    Returns:
        (prompt_text, completion_text) pairs, domains in the given order, episodes in seed
        order; the same arguments always give the same list. Domains without a solver
        (`has_solver` false) contribute nothing.

    Raises:
        ValueError: `num_examples < 1`, or no domain has a solver.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    solvable = [d for d in domains if has_solver(d.env)]
    if not solvable:
        names = ", ".join(f"{d.name} ({d.env})" for d in domains) or "none"
        raise ValueError(f"no domain has a scripted solver for demonstrations; domains: {names}")
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    for domain in solvable:
        turns = domain.max_turns or max_turns
        for env_seed in rng.sample(range(MAX_ENV_SEED), num_examples):
            if tool_calls and domain.env == CALCULATOR_ENV:
                pairs.extend(play_tool_episode(domain, env_seed, tokenizer))
            else:
                pairs.extend(play_episode(domain, env_seed, tokenizer, max_turns=turns,
                                          explore=explore, explore_turns=explore_turns))
    return pairs


def ensure_warm_tiny_model(
    cache_dir: str | Path,
    domains: Sequence[DomainConfig],
    *,
    model_seed: int = 0,
    max_turns: int = 8,
    recipe: WarmupRecipe = DEFAULT_RECIPE,
    tool_calls: bool = False,
) -> Path:
    """The cached embedded-default checkpoint: tiny model from `model_seed`, warmed up on solver
    demonstrations of `domains` with `recipe` (built on first use; see `ensure_tiny_model`;
    `tool_calls`: see `build_demonstrations`; the demonstrations key the cache entry).

    Raises:
        ValueError: no domain has a solver. msgspec.ValidationError: a bad recipe / seed.
    """
    recipe = warmup_spec(model_seed, recipe)
    demos = build_demonstrations(
        domains, recipe.episodes_per_domain, recipe.demo_seed, max_turns=max_turns,
        tool_calls=tool_calls, explore=recipe.explore, explore_turns=recipe.explore_turns)
    return ensure_tiny_model(cache_dir, recipe.spec, demonstrations=demos, sft=recipe.sft)


def ensure_quickstart_model(cache_dir: str | Path, scenario: Scenario) -> Path:
    """The checkpoint for a scenario whose ``model.path`` is ``"tiny"``: the tiny model from
    ``model.tiny_seed``, warmed up on the scenario's domains when ``model.tiny_warmup`` (cached
    under ``cache_dir``; rebuilt when missing); with ``model.tiny_warmup_tool_calls`` on
    calculator conversations (`TOOL_CALL_RECIPE`); the recipe is `scenario_recipe`'s (its
    episodes, epochs and learning rate key the cache entry, so a changed recipe never reuses a
    model built with another).

    Raises:
        ValueError: warm-up requested but no domain has a solver.
    """
    model = scenario.model
    if not model.tiny_warmup:
        spec = msgspec.structs.replace(scenario_recipe(scenario).spec, seed=model.tiny_seed)
        return ensure_tiny_model(cache_dir, validate_spec(spec))
    return ensure_warm_tiny_model(
        cache_dir, scenario.domains, model_seed=model.tiny_seed,
        max_turns=scenario.run.max_turns, tool_calls=model.tiny_warmup_tool_calls,
        recipe=scenario_recipe(scenario))


def scenario_recipe(scenario: Scenario) -> WarmupRecipe:
    """The warm-up recipe of a scenario: `TOOL_CALL_RECIPE` with ``model.tiny_warmup_tool_calls``,
    else `DEFAULT_RECIPE`, with ``model.tiny_warmup_episodes`` / ``_epochs`` / ``_lr`` replacing
    its episodes per domain, SFT epochs and SFT learning rate where set (not ``None``), and
    ``model.tiny_warmup_explore`` / ``_explore_turns`` its share of exploring moves and the
    turns they may replace. The
    model seed is not set here (`warmup_spec` does)."""
    model = scenario.model
    base = TOOL_CALL_RECIPE if model.tiny_warmup_tool_calls else DEFAULT_RECIPE
    sft = base.sft
    if model.tiny_warmup_epochs is not None:
        sft = msgspec.structs.replace(sft, epochs=model.tiny_warmup_epochs)
    if model.tiny_warmup_lr is not None:
        sft = msgspec.structs.replace(sft, lr=model.tiny_warmup_lr)
    episodes = model.tiny_warmup_episodes
    arch = {name: value for name, value in (
        ("hidden_size", model.tiny_hidden_size), ("num_layers", model.tiny_num_layers),
        ("num_heads", model.tiny_num_heads)) if value is not None}
    spec = msgspec.structs.replace(base.spec, **arch) if arch else base.spec
    return msgspec.structs.replace(
        base, spec=spec, sft=sft, explore=model.tiny_warmup_explore,
        explore_turns=model.tiny_warmup_explore_turns,
        episodes_per_domain=base.episodes_per_domain if episodes is None else episodes)
