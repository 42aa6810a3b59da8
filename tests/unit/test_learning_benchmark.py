"""benchmarks.learning's shared task: the scenario carries the shared settings, the held-out set
is disjoint from training, the majority baseline is measured, bad options are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks import learning
from benchmarks.learning_task import (
    HELDOUT_SEED_BASE,
    LearningSettings,
    Task,
    heldout_tasks,
    load_rollart_weights,
    majority_baseline,
    make_tasks,
    parse,
    scenario_toml,
    training_seeds,
)


def test_scenario_carries_the_shared_settings() -> None:
    s = LearningSettings(steps=7, prompts_per_step=3, group_size=5, lr=1e-3, clip_eps=0.3,
                         kl_coef=0.05, temperature=0.7, max_new_tokens=12, eval_every=2)
    sc = parse(scenario_toml(s, seed=4, model_path="tiny"))
    assert (sc.run.mode, sc.run.alpha, sc.run.seed, sc.run.steps) == ("sync", 0, 4, 7)
    assert (sc.run.batch_size, sc.run.group_size, sc.run.redundancy) == (15, 5, 1)
    assert sc.run.max_tokens_per_turn == 12 and sc.run.max_turns == 1
    t = sc.trainer
    assert (t.lr, t.clip_eps, t.kl_coef, t.num_minibatches, t.checkpoint_every) == (
        1e-3, 0.3, 0.05, 1, 2)
    (domain,) = sc.domains
    assert domain.env == "rg:letter_counting" and domain.reward == "reasoning_gym"
    assert domain.env_options == {"min_words": 3, "max_words": 6}
    assert domain.sampling.temperature == 0.7


def test_heldout_set_is_disjoint_from_training() -> None:
    from rollart.models.tokenizer import build_char_tokenizer

    s = LearningSettings(eval_size=50)
    tok = build_char_tokenizer()
    held = heldout_tasks(s, tok)
    train_seeds = training_seeds(0, 200) + training_seeds(1, 200)
    assert len(held) == 50 and min(t.seed for t in held) == HELDOUT_SEED_BASE
    assert max(train_seeds) < HELDOUT_SEED_BASE
    assert not {t.seed for t in held} & set(train_seeds)
    train = make_tasks(s, tok, train_seeds[:50])
    assert not {t.prompt for t in held} & {t.prompt for t in train}
    # the prompt is the chat-rendered question with the answer instruction, not the answer
    assert held[0].prompt.startswith("<|im_start|>user\n")
    assert "\\boxed{}" in held[0].prompt


def test_training_seeds_follow_the_controllers_draw() -> None:
    import random

    rng = random.Random(3)
    expected = []
    for _ in range(4):
        rng.random()  # the domain pick
        expected.append(rng.randrange(2**31))
    assert training_seeds(3, 4) == expected


def _task(answer: str) -> Task:
    return Task(0, "", {"question": "q", "answer": answer, "metadata": {}})


def test_majority_baseline_is_the_best_constant_measured_on_the_set() -> None:
    s = LearningSettings()
    tasks = [_task("2"), _task("1"), _task("2"), _task("3")]
    assert majority_baseline(s, tasks) == ("2", 0.5)
    # an answer outside 0..20 that dominates the set is still a candidate
    assert majority_baseline(s, [_task("37"), _task("37"), _task("1")]) == ("37", 2 / 3)


def test_eval_steps_include_start_and_last() -> None:
    assert LearningSettings(steps=12, eval_every=5).eval_steps() == [0, 5, 10, 12]
    assert LearningSettings(steps=10, eval_every=5).eval_steps() == [0, 5, 10]


@pytest.mark.parametrize("argv, message", [
    (["--env", "game:GuessTheNumber-v0"], "rg:NAME"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--eval-size", "0"], "--eval-size must be >= 1"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--env-options", "[1]"], "JSON object"),
])
def test_bad_options_are_refused(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    parser = learning._parser()
    with pytest.raises(SystemExit) as exc:
        learning.settings_from(parser.parse_args(argv), parser)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_other_task_drops_the_default_options() -> None:
    parser = learning._parser()
    s = learning.settings_from(parser.parse_args(["--quick", "--env", "rg:basic_arithmetic"]),
                               parser)
    assert s.env_options == {} and s.dataset == "basic_arithmetic"
    assert s.steps == learning.QUICK.steps


def test_loading_a_checkpoint_without_trainer_state_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        load_rollart_weights(object(), tmp_path)


def _run(curve: dict[int, float], step_s: float) -> dict:
    return {"eval": {k: {"accuracy": a} for k, a in curve.items()},
            "step_wall_s": [step_s * (i + 1) for i in range(max(curve))]}


def test_time_to_score_uses_the_accuracy_every_mode_reaches() -> None:
    runs = {"rollart sync": _run({0: 0.5, 5: 0.55, 10: 0.7}, 4.0),
            "rollart rollart": _run({0: 0.5, 5: 0.6, 10: 0.6}, 3.0),
            "rollart one_off": _run({0: 0.5, 5: 0.5, 10: 0.65}, 3.5)}
    out = learning.time_to_score(runs, metric="accuracy")
    assert out["target"] == 0.6  # the best of the weakest mode
    assert out["step"] == {"rollart sync": 10, "rollart rollart": 5, "rollart one_off": 10}
    assert out["seconds"] == {"rollart sync": 40.0, "rollart rollart": 15.0,
                              "rollart one_off": 35.0}


def test_time_to_score_needs_rollart_in_sides(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        learning.main(["--sides", "trl", "--time-to-score"])
    assert "--time-to-score" in capsys.readouterr().err
