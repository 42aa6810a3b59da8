"""Built-in reward functions, called directly (the service runs them in its process pool)."""

from __future__ import annotations

import json

import math_verify
import pytest
import reasoning_gym
from math_verify.errors import TimeoutException

from rollart.reward import builtins
from rollart.reward.builtins import (
    boxed_format_reward,
    exact_match_reward,
    last_boxed,
    math_reward,
    reasoning_gym_reward,
)
from rollart.reward.registry import RewardInputError, marked_spec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed {x^{2}}", "x^{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{}", ""),
        (r"\boxed{3} and an unclosed \boxed{4", "3"),
        (r"\boxed{5", None),
        ("no box here", None),
        (r"\boxedx{5}", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        (r"The answer is \boxed{42}.", "42"),
        (r"\boxed{42}", 42),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{2\pi}", r"2\pi"),
        (r"\boxed{x^2+2x+1}", "(x+1)^2"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{3}", r"$3$"),
        ("I computed it: 42", "42"),
    ],
)
def test_math_correct_answers_score_one(response: str, reference: object) -> None:
    reward, details = math_reward("q", response, reference, {})
    assert reward == 1.0, details


def test_math_wrong_answer_scores_zero() -> None:
    reward, details = math_reward("q", r"so \boxed{41}", "42", {})
    assert reward == 0.0
    assert details["answer"] == "41"
    assert details["answer_source"] == "boxed"


def test_math_prefers_the_last_boxed_answer() -> None:
    assert math_reward("q", r"first \boxed{3}, corrected: \boxed{4}", "4", {})[0] == 1.0
    assert math_reward("q", r"first \boxed{4}, corrected: \boxed{3}", "4", {})[0] == 0.0


def test_math_bare_latex_reference_is_not_truncated() -> None:
    # Without wrapping the reference in $...$, "2\pi" would parse as 2 and this would score 1.
    assert math_reward("q", r"\boxed{2}", r"2\pi", {})[0] == 0.0


@pytest.mark.parametrize("response", ["I have no idea.", r"\boxed{}", ""])
def test_math_unparseable_answer_scores_zero_with_reason(response: str) -> None:
    reward, details = math_reward("q", response, "42", {})
    assert reward == 0.0
    assert "no parseable final answer" in details["reason"]


@pytest.mark.parametrize("reference", [None, [1], "", "   ", float("nan"), True, "\\frac{"])
def test_math_bad_reference_is_an_input_error(reference: object) -> None:
    with pytest.raises(RewardInputError, match="reference"):
        math_reward("q", r"\boxed{1}", reference, {})


def test_math_parse_timeout_is_raised_not_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_parse(*args: object, **kwargs: object) -> list:
        raise TimeoutException("Timeout during parsing")

    monkeypatch.setattr(math_verify, "parse", fake_parse)
    with pytest.raises(TimeoutError, match="parsing"):
        math_reward("q", r"\boxed{1}", "1", {})


def test_math_verify_timeout_is_raised_not_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_verify(*args: object, **kwargs: object) -> bool:
        raise TimeoutException("Timeout during comparison")

    monkeypatch.setattr(math_verify, "verify", fake_verify)
    with pytest.raises(TimeoutError, match="comparing"):
        math_reward("q", r"\boxed{1}", "1", {})


def test_boxed_format() -> None:
    assert boxed_format_reward("q", r"so \boxed{x}", None, {}) == (1.0, {"boxed": "x"})
    assert boxed_format_reward("q", "so x", None, {})[0] == 0.0
    assert boxed_format_reward("q", r"\boxed{  }", None, {})[0] == 0.0
    assert boxed_format_reward("q", r"\boxed{x", None, {})[0] == 0.0


def test_exact_match_normalises_whitespace_only() -> None:
    assert exact_match_reward("q", "  hello \n\t world ", "hello world", {})[0] == 1.0
    assert exact_match_reward("q", "Hello world", "hello world", {})[0] == 0.0
    assert exact_match_reward("q", "42", 42, {})[0] == 1.0
    assert exact_match_reward("q", "hello", "hello world", {})[0] == 0.0


@pytest.mark.parametrize("reference", [None, {"a": 1}, False])
def test_exact_match_rejects_non_text_reference(reference: object) -> None:
    with pytest.raises(RewardInputError, match="exact_match"):
        exact_match_reward("q", "x", reference, {})


@pytest.fixture(scope="module")
def arithmetic_entry() -> dict:
    # A real generated item, round-tripped through JSON as it would arrive over HTTP.
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=7)[3]
    return json.loads(json.dumps(entry))


def test_reasoning_gym_scores_with_the_dataset_scorer(arithmetic_entry: dict) -> None:
    meta = {"dataset": "basic_arithmetic", "entry": arithmetic_entry}
    answer = arithmetic_entry["answer"]
    reward, details = reasoning_gym_reward("q", f"<answer>{answer}</answer>", None, meta)
    assert reward == 1.0
    assert details == {
        "dataset": "basic_arithmetic",
        "answer": answer,
        "answer_source": "answer_tag",
    }
    wrong = str(int(answer) + 1)
    assert reasoning_gym_reward("q", f"<answer>{wrong}</answer>", None, meta)[0] == 0.0


def test_reasoning_gym_answer_extraction_modes(arithmetic_entry: dict) -> None:
    answer = arithmetic_entry["answer"]
    meta = {"dataset": "basic_arithmetic", "entry": arithmetic_entry}
    assert (
        reasoning_gym_reward("q", rf"so \boxed{{{answer}}}", None, meta)[1]["answer_source"]
        == "boxed"
    )
    assert reasoning_gym_reward("q", rf"so \boxed{{{answer}}}", None, meta)[0] == 1.0
    assert reasoning_gym_reward("q", f"  {answer} ", None, meta)[0] == 1.0
    raw = {**meta, "extract": "raw"}
    reward, details = reasoning_gym_reward("q", f"<answer>{answer}</answer>", None, raw)
    # The scorer sees the tags too; basic_arithmetic gives partial credit, not a match.
    assert details["answer"] == f"<answer>{answer}</answer>"
    assert reward < 1.0
    tag_only = {**meta, "extract": "answer_tag"}
    reward, details = reasoning_gym_reward("q", rf"\boxed{{{answer}}}", None, tag_only)
    assert (reward, details["answer"]) == (0.0, None)


def test_reasoning_gym_other_dataset() -> None:
    entry = json.loads(json.dumps(reasoning_gym.create_dataset("chain_sum", size=2, seed=3)[1]))
    meta = {"dataset": "chain_sum", "entry": entry}
    assert reasoning_gym_reward("q", f"<answer>{entry['answer']}</answer>", None, meta)[0] == 1.0


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({}, "metadata.dataset"),
        ({"dataset": "basic_arithmetic"}, "metadata.entry"),
        ({"dataset": "basic_arithmetic", "entry": {"question": "?"}}, "metadata.entry"),
        ({"dataset": "no_such_dataset", "entry": {"answer": "1"}}, "unknown dataset"),
        ({"dataset": "basic_arithmetic", "entry": {"answer": "1"}, "extract": "xml"}, "extract"),
    ],
)
def test_reasoning_gym_bad_metadata_is_an_input_error(metadata: dict, match: str) -> None:
    with pytest.raises(RewardInputError, match=match):
        reasoning_gym_reward("q", "1", None, metadata)


def test_builtins_are_marked_with_their_executors() -> None:
    specs = {marked_spec(f).name: marked_spec(f) for f in vars(builtins).values() if marked_spec(f)}
    assert set(specs) == {"math", "reasoning_gym", "exact_match", "boxed_format", "env_return",
                          "env_success"}
    # sympy-backed scoring must never run on the event loop.
    assert specs["math"].executor == "process"
    assert specs["reasoning_gym"].executor == "process"


def test_env_return_is_the_envs_own_return_and_rejects_garbage():
    from rollart.reward.builtins import env_return_reward
    from rollart.reward.registry import RewardInputError

    assert env_return_reward("p", "r", None, {"env_return": 1, "num_turns": 3}) == (
        1.0, {"num_turns": 3})
    assert env_return_reward("p", "r", None, {"env_return": -0.5})[0] == -0.5
    for bad in ({}, {"env_return": None}, {"env_return": "1"}, {"env_return": float("nan")},
                {"env_return": True}):
        with pytest.raises(RewardInputError, match="env_return"):
            env_return_reward("p", "r", None, bad)


def _play_guess10(seed: int, guesses: list[int]) -> float:
    """GEM's GuessTheNumber (1..10, 4 turns) played with fixed guesses: the summed step rewards."""
    from rollart.envhost.families import make_env

    env = make_env("game:GuessTheNumber-v0-easy", {})
    env.reset(seed)
    total = 0.0
    for g in guesses:
        _obs, reward, term, trunc, _info = env.step(f"\\boxed{{{g}}}")
        total += reward
        if term or trunc:
            break
    env.close()
    return total


def test_env_success_scores_the_outcome_not_gems_shaping():
    from rollart.controller.routing.routers import env_success_reward as local_success
    from rollart.reward.builtins import env_success_reward

    # Guessing 5, 6, 4, 7 without reading a hint: GEM pays 1 - |guess - target| / 9 for the last
    # guess of a lost game, so env_return rewards the ignorant player; env_success does not.
    lost = [s for s in range(40) if 0 < _play_guess10(s, [5, 6, 4, 7]) < 1]
    won = [s for s in range(40) if _play_guess10(s, [5, 6, 4, 7]) >= 1]
    assert lost and won
    for seed, want in ((lost[0], 0.0), (won[0], 1.0)):
        ret = _play_guess10(seed, [5, 6, 4, 7])
        meta = {"env_return": ret, "num_turns": 4}
        assert env_success_reward("p", "r", None, meta) == (want, {"env_return": ret,
                                                                   "num_turns": 4})
        assert local_success("p", "r", None, meta) == want
    assert 0.5 < _play_guess10(lost[0], [5, 6, 4, 7]) < 1.0  # the shaping env_return pays
    # GEM's format error (-0.1) stays worse than a lost game: the format is never traded away
    assert env_success_reward("p", "r", None, {"env_return": -0.1})[0] == -0.1
    assert local_success("p", "r", None, {"env_return": -0.1}) == -0.1
    for bad in ({}, {"env_return": None}, {"env_return": float("inf")}, {"env_return": False}):
        with pytest.raises(RewardInputError, match="env_success"):
            env_success_reward("p", "r", None, bad)
