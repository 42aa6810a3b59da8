"""benchmarks.learning's game task: episodes are tokenised as the controller tokenises a
trajectory, scored with env_success, the fixed-sequence baseline is measured, and TRL's rollout
function plays each group's seed once per generation."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from benchmarks import learning
from benchmarks.learning_game import (
    evaluate_game,
    fixed_sequence_baseline,
    play,
    trl_rollout,
)
from benchmarks.learning_task import domain_of, heldout_tasks, parse, scenario_toml

from rollart.envhost.families import make_env
from rollart.models.tokenizer import build_char_tokenizer
from rollart.models.warmup import render_prompt

GAME = replace(learning.QUICK, **learning.GAME)


class ScriptedGuessModelFake:
    """A stand-in for a transformers LM in unit tests: every turn replies ``\\boxed{g}`` with
    the next guess of ``guesses`` (then eos), whatever the context; pads after eos."""

    def __init__(self, tokenizer: Any, guesses: list[int]) -> None:
        self.tok, self.guesses, self.training = tokenizer, guesses, True
        self.calls = 0

    def eval(self) -> None:
        self.training = False

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def generate(self, *, input_ids: torch.Tensor, eos_token_id: int, pad_token_id: int,
                 max_new_tokens: int, **_: Any) -> torch.Tensor:
        assert not self.training
        guess = self.guesses[min(self.calls, len(self.guesses) - 1)]
        self.calls += 1
        reply = self.tok.encode(f"\\boxed{{{guess}}}", add_special_tokens=False) + [eos_token_id]
        reply = (reply + [pad_token_id] * max_new_tokens)[:max_new_tokens]
        new = torch.tensor([reply] * input_ids.shape[0], dtype=torch.long)
        return torch.cat([input_ids, new], dim=1)


def _target(seed: int) -> int:
    env = make_env(GAME.env, GAME.env_options)
    try:
        env.reset(seed)
        return int(env._env.game_number)  # type: ignore[attr-defined]
    finally:
        env.close()


def test_game_scenario_trains_on_the_env_outcome() -> None:
    sc = parse(scenario_toml(GAME, seed=1, model_path="tiny"))
    (domain,) = sc.domains
    assert domain.env == "game:GuessTheNumber-v0-easy" and domain.reward == "env_success"
    assert sc.run.max_turns == 4 and sc.run.mode == "sync"


def test_episode_tokens_are_the_conversation_the_controller_renders() -> None:
    tok = build_char_tokenizer()
    domain = domain_of(GAME)
    seed = next(s for s in range(100) if _target(s) not in (5, 7, 6))
    (ep,) = play(ScriptedGuessModelFake(tok, [5, 7, 6]), tok, domain, [seed], max_turns=4,
                 max_new_tokens=16, sample=False)
    # replay the same moves to get the observations the env returned
    env = make_env(GAME.env, GAME.env_options)
    obs, _ = env.reset(seed)
    observations = [obs]
    for a in ep.actions[:-1]:
        observations.append(env.step(a)[0])
    env.close()
    assert ep.actions == ["\\boxed{5}", "\\boxed{7}", "\\boxed{6}", "\\boxed{6}"]
    rendered = render_prompt(tok, domain, observations, ep.actions[:-1])
    text = tok.decode(ep.prompt_ids + ep.completion_ids)
    # everything but the last reply is the controller's rendering of the conversation
    assert text == rendered + "\\boxed{6}<|im_end|>"
    assert tok.decode(ep.prompt_ids) == render_prompt(tok, domain, observations[:1], [])
    # only generated ids are trained: each turn's reply and its eos
    trained = [t for t, m in zip(ep.completion_ids, ep.env_mask, strict=True) if m]
    assert tok.decode(trained) == "".join(a + "<|im_end|>" for a in ep.actions)
    assert len(ep.env_mask) == len(ep.completion_ids)
    assert ep.reward == 0.0  # lost: env_success pays nothing for the shaped return


def test_a_won_game_scores_one_and_ends() -> None:
    tok = build_char_tokenizer()
    seed = next(s for s in range(100) if _target(s) == 5)
    (ep,) = play(ScriptedGuessModelFake(tok, [5]), tok, domain_of(GAME), [seed], max_turns=4,
                 max_new_tokens=16, sample=False)
    assert ep.reward == 1.0 and ep.actions == ["\\boxed{5}"] and all(ep.env_mask)


def test_fixed_sequence_baseline_is_measured_on_the_set() -> None:
    domain = domain_of(GAME)
    seeds = list(range(60))
    targets = [_target(s) for s in seeds]
    seq, acc = fixed_sequence_baseline(domain, seeds, 4)
    # at least the best constant guess, computed here from the targets alone
    assert acc >= max(targets.count(k) for k in range(1, 11)) / len(seeds)
    # and exactly what its own guesses win (a fixed sequence wins iff one guess is the target)
    guesses = {int(g.strip().removeprefix("\\boxed{").removesuffix("}"))
               for g in seq.split("|")}
    assert acc == sum(t in guesses for t in targets) / len(seeds)
    assert len(guesses) <= 4 and acc < 1.0


def test_evaluate_game_scores_win_rates() -> None:
    tok = build_char_tokenizer()
    tasks = heldout_tasks(replace(GAME, eval_size=20), tok)
    wins = sum(_target(t.seed) == 5 for t in tasks) / len(tasks)
    out = evaluate_game(ScriptedGuessModelFake(tok, [5]), tok, domain_of(GAME),
                        [t.seed for t in tasks], max_turns=4, max_new_tokens=16,
                        temperature=1.0)
    assert out["accuracy"] == wins and out["sampled_accuracy"] == wins
    assert out["boxed_share"] == 1.0
    # the won games played one move, the lost ones four: two distinct sequences at most
    kinds = {_target(t.seed) == 5 for t in tasks}
    assert out["distinct_answer_share"] == len(kinds) / len(tasks)


def test_trl_rollout_plays_each_groups_seed_group_size_times() -> None:
    tok = build_char_tokenizer()
    seeds = [s for s in range(200) if _target(s) != 5][:2] + [
        next(s for s in range(200) if _target(s) == 5)]
    rollout = trl_rollout(domain_of(GAME), tok, iter(seeds), group_size=4, max_turns=4,
                          max_new_tokens=16, temperature=1.0)
    trainer = SimpleNamespace(model=ScriptedGuessModelFake(tok, [5]))
    out = rollout(["p"] * 8, trainer)  # TRL's sampler repeats each prompt group_size times
    assert out["game_reward"] == [0.0] * 8
    assert [len(x) for x in out["completion_ids"]] == [len(x) for x in out["env_mask"]]
    assert len(out["logprobs"][0]) == len(out["completion_ids"][0])
    out = rollout(["p"] * 4, trainer)  # the next call plays the next group's seed
    assert out["game_reward"] == [1.0] * 4
    with pytest.raises(ValueError, match="group_size 4"):
        rollout(["p"] * 6, trainer)


def test_game_task_refuses_a_reasoning_gym_env(capsys: pytest.CaptureFixture[str]) -> None:
    parser = learning._parser()
    with pytest.raises(SystemExit):
        learning.settings_from(parser.parse_args(["--task", "game", "--env", "rg:x"]), parser)
    assert "--task game" in capsys.readouterr().err
    s = learning.settings_from(parser.parse_args(["--quick", "--task", "game"]), parser)
    assert s.is_game and s.max_turns == 4 and s.steps == learning.QUICK.steps
