"""Multi-turn games for ``benchmarks.learning``: in-process play of GEM's GuessTheNumber with a
transformers model, the held-out evaluator, the best fixed action sequence, and the rollout
function TRL's ``GRPOTrainer`` trains through.

A played episode is tokenised as rollart's controller tokenises a trajectory
(``rollart.controller.rollout.tokens.ChatTokens``): the opening prompt rendered once; each
assistant turn appends the ids the model generated (loss mask 1); each observation appends only
the text the chat template adds after that turn (loss mask 0). Its reward is the
``env_success`` outcome of the env's summed step rewards
(``rollart.reward.builtins.env_outcome``: 1 for a won game, the return when negative, else 0),
the reward function the benchmark's rollart scenario names, so both sides train on the same
sequences and the same reward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

#: the episode outcome that counts as solved (``env_success`` pays 1.0 for a won game)
SOLVED = 1.0


@dataclass
class Episode:
    """One played episode: ``prompt_ids`` (the opening prompt), ``completion_ids`` (every turn's
    generated ids and the observations between them), ``env_mask`` (1 for a generated id, 0 for
    an observation id; same length as ``completion_ids``), the decoded ``actions`` per turn,
    ``env_return`` (sum of the env's step rewards) and ``reward`` (its ``env_success`` score)."""

    seed: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    env_return: float = 0.0
    reward: float = 0.0


def is_game(env: str) -> bool:
    """Whether ``env`` (a domain's env name) is a multi-turn game this module plays."""
    return env.startswith("game:GuessTheNumber-")


def opening_messages(domain: Any, observation: str) -> list[dict[str, str]]:
    """The chat messages before the first assistant turn, as the controller opens a trajectory
    of ``domain`` (a ``rollart.config.DomainConfig``) on reset ``observation``."""
    messages = [{"role": "system", "content": domain.system_prompt}] if domain.system_prompt \
        else []
    messages.append({"role": "user", "content": domain.prompt_template.format(
        observation=observation)})
    return messages


def _generate(model: Any, contexts: Sequence[list[int]], *, sample: bool, temperature: float,
              max_new_tokens: int, eos_id: int, pad_id: int) -> list[list[int]]:
    """One assistant turn per context (left padded, one batch): the generated ids up to and
    including the first eos id (all ``max_new_tokens`` when no eos came)."""
    import torch

    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c):] = 1
    extra = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=sample, **extra,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                         pad_token_id=pad_id)
    replies = []
    for row in out[:, width:].tolist():
        replies.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
    return replies


def play(model: Any, tokenizer: Any, domain: Any, seeds: Sequence[int], *, max_turns: int,
         max_new_tokens: int, sample: bool, temperature: float = 1.0,
         batch: int = 256) -> list[Episode]:
    """Play one episode of ``domain`` per env seed in ``seeds`` (repeats allowed) with
    ``model`` (a transformers causal LM on CPU), at most ``max_turns`` assistant turns of at
    most ``max_new_tokens`` tokens each, greedy or sampled at ``temperature`` (top-k / top-p
    off, torch's global generator). Episodes are stepped turn by turn, ``batch`` at a time.

    Raises ``rollart.envhost.families.EnvSpecError`` for an unknown env or bad options."""
    import torch

    from rollart.controller.rollout.tokens import ChatTokens
    from rollart.envhost.families import make_env
    from rollart.reward.builtins import env_outcome

    chat = ChatTokens(tokenizer, domain.chat_template_kwargs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.eos_token_id
    episodes, envs, contexts = [], [], []
    try:
        for seed in seeds:
            env = make_env(domain.env, domain.env_options)
            envs.append(env)
            obs, _ = env.reset(seed)
            ep = Episode(seed, chat.prompt_ids(opening_messages(domain, obs)))
            episodes.append(ep)
            contexts.append(list(ep.prompt_ids))
        live = list(range(len(episodes)))
        was_training = model.training
        model.eval()
        try:
            for turn in range(max_turns):
                still = []
                for start in range(0, len(live), batch):
                    chunk = live[start:start + batch]
                    with torch.no_grad():
                        replies = _generate(model, [contexts[i] for i in chunk], sample=sample,
                                            temperature=temperature,
                                            max_new_tokens=max_new_tokens,
                                            eos_id=chat.eos_token_id, pad_id=pad_id)
                    for i, reply in zip(chunk, replies, strict=True):
                        ep = episodes[i]
                        ep.completion_ids += reply
                        ep.env_mask += [1] * len(reply)
                        contexts[i] += reply
                        action = chat.decode(reply)
                        ep.actions.append(action)
                        obs, reward, terminated, truncated, _ = envs[i].step(action)
                        ep.env_return += float(reward)
                        if terminated or truncated or turn == max_turns - 1:
                            continue
                        more = chat.observation_ids(
                            domain.turn_template.format(observation=obs), reply)
                        ep.completion_ids += more
                        ep.env_mask += [0] * len(more)
                        contexts[i] += more
                        still.append(i)
                live = still
                if not live:
                    break
        finally:
            model.train(was_training)
    finally:
        for env in envs:
            env.close()
    for ep in episodes:
        ep.reward = env_outcome(ep.env_return)
    return episodes


def evaluate_game(model: Any, tokenizer: Any, domain: Any, seeds: Sequence[int], *,
                  max_turns: int, max_new_tokens: int, temperature: float,
                  sample_seed: int = 0) -> dict[str, float]:
    """Held-out scores of ``model`` on one episode per env seed: the same keys as
    ``learning_task.evaluate`` (``accuracy``: greedy win rate; ``sampled_accuracy``: win rate
    of one sampled episode per seed, seeded by ``sample_seed`` with the caller's torch RNG state
    left as it was; ``distinct_answer_share``: distinct greedy action sequences / seeds;
    ``boxed_share``: greedy turns with a ``\\boxed{}`` answer / turns)."""
    import torch

    from rollart.reward.builtins import last_boxed

    greedy = play(model, tokenizer, domain, seeds, max_turns=max_turns,
                  max_new_tokens=max_new_tokens, sample=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_seed)
        sampled = play(model, tokenizer, domain, seeds, max_turns=max_turns,
                       max_new_tokens=max_new_tokens, sample=True, temperature=temperature)
    turns = [a for ep in greedy for a in ep.actions]
    return {"accuracy": sum(ep.reward >= SOLVED for ep in greedy) / len(greedy),
            "sampled_accuracy": sum(ep.reward >= SOLVED for ep in sampled) / len(sampled),
            "distinct_answer_share": len({tuple(ep.actions) for ep in greedy}) / len(greedy),
            "boxed_share": sum(last_boxed(a) is not None for a in turns) / max(len(turns), 1)}


def _fixed_win_rate(domain: Any, seeds: Sequence[int], actions: Sequence[str]) -> float:
    from rollart.envhost.families import make_env
    from rollart.reward.builtins import env_outcome

    wins = 0
    for seed in seeds:
        env = make_env(domain.env, domain.env_options)
        try:
            env.reset(seed)
            total = 0.0
            for a in actions:
                _, reward, terminated, truncated, _ = env.step(a)
                total += float(reward)
                if terminated or truncated:
                    break
            wins += env_outcome(total) >= SOLVED
        finally:
            env.close()
    return wins / len(seeds)


def fixed_sequence_baseline(domain: Any, seeds: Sequence[int], max_turns: int
                            ) -> tuple[str, float]:
    """The best fixed action sequence on ``seeds`` (one that ignores every observation) and its
    win rate, measured by playing it: every guess in the game's range (stated in the reset
    observation) repeated on every turn, then one pass of coordinate ascent replacing each
    turn's guess by every other guess, keeping a change that wins more. Returns the sequence
    as ``"a | b | ..."`` and its win rate in [0, 1]."""
    from rollart.envhost.families import make_env
    from rollart.envhost.solvers import consistent_range

    env = make_env(domain.env, domain.env_options)
    try:
        obs, _ = env.reset(seeds[0])
    finally:
        env.close()
    lo, hi = consistent_range([obs])
    cands = [f"\\boxed{{{k}}}" for k in range(lo, hi + 1)]
    best_seq: list[str] = []
    best = -1.0
    for c in cands:
        acc = _fixed_win_rate(domain, seeds, [c] * max_turns)
        if acc > best:
            best, best_seq = acc, [c] * max_turns
    for t in range(1, max_turns):
        for c in cands:
            if c == best_seq[t]:
                continue
            trial = [*best_seq[:t], c, *best_seq[t + 1:]]
            acc = _fixed_win_rate(domain, seeds, trial)
            if acc > best:
                best, best_seq = acc, trial
    return " | ".join(best_seq), best


def trl_rollout(domain: Any, tokenizer: Any, group_seeds: Iterator[int], *, group_size: int,
                max_turns: int, max_new_tokens: int, temperature: float) -> Any:
    """A ``rollout_func`` for TRL's ``GRPOTrainer``: each call plays ``group_size`` sampled
    episodes for each of the next groups' env seeds drawn from ``group_seeds`` (in order: the
    trainer's dataset is not shuffled, so step k plays the groups rollart's step k plays) with
    the trainer's current model. Returns TRL's fields plus ``env_mask`` (observation ids are
    not trained) and ``game_reward`` (forwarded to the reward function). ``logprobs`` are
    zeros: TRL reads them only for its vLLM importance-sampling correction, off here."""

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        # TRL passes each prompt once per generation (its sampler repeats a prompt
        # num_generations times in a row); one env seed per run of repeats.
        if len(prompts) % group_size:
            raise ValueError(f"rollout got {len(prompts)} prompts, not a multiple of "
                             f"group_size {group_size}")
        seeds = [next(group_seeds) for _ in range(len(prompts) // group_size)]
        episodes = play(trainer.model, tokenizer, domain,
                        [sd for sd in seeds for _ in range(group_size)], max_turns=max_turns,
                        max_new_tokens=max_new_tokens, sample=True, temperature=temperature)
        return {"prompt_ids": [ep.prompt_ids for ep in episodes],
                "completion_ids": [ep.completion_ids for ep in episodes],
                "logprobs": [[0.0] * len(ep.completion_ids) for ep in episodes],
                "env_mask": [ep.env_mask for ep in episodes],
                "game_reward": [ep.reward for ep in episodes]}

    return rollout
