"""Env family adapters on real GEM / reasoning-gym envs, user envs by import path, and the
scripted solvers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rollart.envhost.families import (
    FAMILIES,
    RG_ANSWER_INSTRUCTION,
    EnvContractError,
    EnvSpecError,
    make_env,
    rg_entry,
)
from rollart.envhost.solvers import NoSolverError, has_solver, next_action

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def user_envs(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    import envhost_user_envs

    return envhost_user_envs


def play(env_name: str, seed: int, options=None, max_steps: int = 50):
    """Play one episode with the scripted solver; returns (observations, actions, rewards, last)."""
    env = make_env(env_name, options)
    obs, info = env.reset(seed)
    observations, actions, rewards = [obs], [], []
    for _ in range(max_steps):
        action = next_action(env_name, observations, actions, info)
        obs, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs)
        actions.append(action)
        rewards.append(reward)
        if terminated or truncated:
            env.close()
            return observations, actions, rewards, (terminated, truncated)
    raise AssertionError(f"{env_name} seed {seed}: no end within {max_steps} steps")


# ---- GEM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_guess_the_number_bisection_wins(seed):
    observations, actions, rewards, (terminated, truncated) = play(
        "game:GuessTheNumber-v0-easy", seed
    )
    assert terminated and not truncated
    assert rewards[-1] == 1.0
    assert "Congratulations" in observations[-1]
    assert len(actions) <= 4  # easy: 1..10 in 4 turns


def test_guess_the_number_hard_bisection_wins():
    *_, rewards, (terminated, _) = play("game:GuessTheNumber-v0-hard", 3)
    assert terminated and rewards[-1] == 1.0


def test_gem_reset_is_deterministic_per_seed():
    a = make_env("game:Sokoban-v0-easy").reset(11)
    b = make_env("game:Sokoban-v0-easy").reset(11)
    c = make_env("game:Sokoban-v0-easy").reset(12)
    assert a == b
    assert a[0] != c[0]


def test_gem_observation_carries_suffix_state():
    env = make_env("game:Sokoban-v0-easy")
    obs, info = env.reset(3)
    assert "current board layout" in obs and "suffix" not in info
    obs2, reward, terminated, truncated, info2 = env.step("I push \\boxed{up}")
    assert obs2.startswith("At turn 1") and "current board layout" in obs2
    assert isinstance(reward, float) and not terminated and "suffix" not in info2


def test_gem_rng_isolated_between_interleaved_sessions():
    # Game2048 draws a new tile from the global RNG on every move; another session resetting in
    # between must not change this session's trajectory.
    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 2

    def run(interleave: bool) -> list[str]:
        env = make_env("game:Game2048-v0-easy")
        out = [env.reset(5)[0]]
        for move in moves:
            if interleave:
                make_env("game:Game2048-v0-easy").reset(99)
            out.append(env.step(move)[0])
        return out

    assert run(False) == run(True)


def test_mastermind_format_error_is_the_envs_own_reward():
    env = make_env("game:Mastermind-v0-easy")
    obs, _ = env.reset(0)
    assert "Mastermind" in obs
    _, reward, terminated, _, _ = env.step("no box here")
    assert reward == pytest.approx(-0.1) and terminated


def test_gem_options_override_and_unknown_rejected():
    env = make_env("game:GuessTheNumber-v0-easy", {"max_number": 100, "max_turns": 8})
    assert "between 1 and 100" in env.reset(0)[0]
    with pytest.raises(EnvSpecError, match=r"unknown option\(s\) \['colour'\]") as err:
        make_env("game:GuessTheNumber-v0-easy", {"colour": "red"})
    assert err.value.code == "bad_request"


def test_gem_negative_seed_rejected():
    with pytest.raises(EnvSpecError, match=">= 0"):
        make_env("game:GuessTheNumber-v0-easy").reset(-1)


# ---- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("nope", "expected FAMILY:NAME"),
        ("atari:Pong", "expected FAMILY:NAME"),
        ("game:", "expected FAMILY:NAME"),
        ("game:NoSuchGame-v0", "registered games: game:"),
        ("rg:no_such_dataset", "unknown reasoning-gym dataset"),
        ("py:no_such_module_xyz:Env", "cannot import module"),
        ("py:json:NoSuchAttr", "NoSuchAttr"),
        ("py:json", "expected py:package.module:ClassOrFactory"),
    ],
)
def test_unknown_names_are_not_found(name, fragment):
    with pytest.raises(EnvSpecError, match=fragment) as err:
        make_env(name)
    assert err.value.code == "not_found"
    if "FAMILY" in fragment:
        for family in FAMILIES:
            assert f"{family}:" in err.value.message


# ---- reasoning-gym -----------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "countdown", "chain_sum"])
@pytest.mark.parametrize("seed", [0, 17])
def test_rg_correct_answer_scores_one(dataset, seed):
    name = f"rg:{dataset}"
    env = make_env(name)
    obs, info = env.reset(seed)
    entry = rg_entry(dataset, seed)
    assert obs == entry["question"] + RG_ANSWER_INSTRUCTION  # the answer is not added
    assert {k: info[k] for k in ("dataset", "seed", "index", "config")} == {
        "dataset": dataset, "seed": seed, "index": 0, "config": {}}
    # The answer reaches the reward service through info, never through the observation.
    assert info["entry"]["question"] == entry["question"]
    assert info["reference"] == entry["answer"]
    assert "answer" not in info
    action = next_action(name, [obs], [], info)
    assert action == f"\\boxed{{{entry['answer']}}}"
    _, reward, terminated, truncated, step_info = env.step(f"Working... so {action}")
    assert reward == 1.0 and terminated and not truncated
    assert step_info["extracted_answer"] == entry["answer"]


def test_rg_wrong_or_missing_answer_scores_by_dataset():
    env = make_env("rg:chain_sum")
    env.reset(3)
    answer = rg_entry("chain_sum", 3)["answer"]
    assert env.step(f"\\boxed{{{int(answer) + 1}}}")[1] == 0.0
    env.reset(3)
    assert env.step(answer)[1] == 0.0  # not boxed: no answer extracted


def test_rg_seed_maps_to_distinct_entries():
    questions = {make_env("rg:basic_arithmetic").reset(s)[0] for s in range(20)}
    assert len(questions) >= 18


def test_rg_step_after_end_is_an_error():
    env = make_env("rg:chain_sum")
    env.reset(0)
    env.step("\\boxed{0}")
    with pytest.raises(EnvContractError, match="single turn"):
        env.step("\\boxed{0}")


def test_rg_options_are_dataset_config():
    env = make_env(
        "rg:chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    obs, info = env.reset(4)
    expression = obs.split(":")[1].split("=")[0]
    assert len(expression.split()) == 3  # two one-digit terms and one operator
    assert info["config"]["max_terms"] == 2
    action = next_action("rg:chain_sum", [obs], [], info)
    assert env.step(action)[1] == 1.0


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"difficulty_knob": 3}, r"unknown option\(s\) \['difficulty_knob'\]"),
        ({"seed": 3}, "the seed comes from EnvOpen.seed"),
        ({"min_terms": 0}, "invalid options"),
    ],
)
def test_rg_bad_options(options, fragment):
    env = make_env("rg:chain_sum", options)  # validated at reset, when the dataset is built
    with pytest.raises(EnvSpecError, match=fragment) as err:
        env.reset(0)
    assert err.value.code == "bad_request"


# ---- user envs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("attr", ["EchoEnv", "make_echo"])
def test_user_env_by_import_path(user_envs, attr):
    env = make_env(f"py:envhost_user_envs:{attr}", {"max_turns": 2})
    assert env.reset(7) == ("echo env, seed 7", {"seed": 7, "max_turns": 2})
    obs, reward, terminated, _, info = env.step("hi")
    assert (obs, reward, terminated) == ("you said hi", 2.0, False)
    assert info == {"turn": 1, "arr": [0, 1]}  # numpy values made plain
    assert env.step("x")[2] is True
    env.close()
    assert 7 in user_envs.CLOSED_SEEDS


def test_user_env_bad_options_and_objects(user_envs):
    with pytest.raises(EnvSpecError, match="unexpected keyword") as err:
        make_env("py:envhost_user_envs:EchoEnv", {"nope": 1})
    assert err.value.code == "bad_request"
    with pytest.raises(EnvSpecError, match="no callable reset / step"):
        make_env("py:envhost_user_envs:NotAnEnv")
    with pytest.raises(EnvSpecError, match="not callable"):
        make_env("py:envhost_user_envs:CLOSED_SEEDS.__len__.__doc__")


@pytest.mark.parametrize(
    ("attr", "fragment"),
    [("NanRewardEnv", "reward must be finite"), ("BadShapeEnv", "must return \\(observation")],
)
def test_user_env_contract_violations(user_envs, attr, fragment):
    env = make_env(f"py:envhost_user_envs:{attr}")
    env.reset(0)
    with pytest.raises(EnvContractError, match=fragment):
        env.step("a")


# ---- solvers -----------------------------------------------------------------------------------


def test_solver_api_errors():
    assert has_solver("game:GuessTheNumber-v0-easy") and has_solver("rg:countdown")
    assert not has_solver("game:Sokoban-v0-easy")
    with pytest.raises(NoSolverError, match="no scripted solver"):
        next_action("game:Sokoban-v0-easy", ["obs"], [])
    with pytest.raises(ValueError, match="len\\(observations\\) == len\\(actions\\) \\+ 1"):
        next_action("game:GuessTheNumber-v0-easy", ["a", "b"], [])
    with pytest.raises(NoSolverError, match="reset info"):
        next_action("rg:chain_sum", ["q"], [], {})
    with pytest.raises(NoSolverError, match="empty range"):
        next_action(
            "game:GuessTheNumber-v0-easy",
            [
                "guess the number between 1 and 10",
                "At turn 1, you guessed 5, and the target number is higher than 5.",
                "At turn 2, you guessed 6, and the target number is lower than 6.",
            ],
            ["\\boxed{5}", "\\boxed{6}"],
        )


def test_bisection_uses_hints():
    obs = [
        "You have to guess the number between 1 and 50 (inclusive)",
        "At turn 1, you guessed 25, and the target number is higher than 25.",
        "At turn 2, you guessed 38, and the target number is lower than 38.",
    ]
    assert next_action("game:GuessTheNumber-v0-hard", obs, ["\\boxed{25}", "\\boxed{38}"]) == (
        f"\\boxed{{{math.floor((26 + 37) / 2)}}}"
    )


@pytest.mark.parametrize("value", ["/etc/passwd", "../../../etc/passwd", "sub/words.txt", ".x"])
def test_rg_options_naming_files_may_not_name_paths(value):
    with pytest.raises(EnvSpecError, match="data_file.*refused") as err:
        make_env("rg:spell_backward", {"data_file": value}).reset(1)
    assert err.value.code == "bad_request"


def test_rg_option_naming_a_packaged_file_still_works():
    env = make_env("rg:spell_backward", {"data_file": "words3to10.txt"})
    obs, _ = env.reset(1)
    assert obs
