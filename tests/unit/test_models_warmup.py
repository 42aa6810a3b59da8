"""Warm-up demonstrations: well formed, rendered as the controller renders them, deterministic;
the recipe's warm-up changes the model; the scenario's recipe fields are bounded and key the
model cache."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from rollart.config import ConfigError, DomainConfig, parse_scenario
from rollart.controller.rollout.tokens import ChatTokens
from rollart.models import warmup
from rollart.models.sft import SFTConfig
from rollart.models.tiny import TinyModelSpec, _cache_key, build_tiny_model, validate_spec
from rollart.models.tokenizer import build_char_tokenizer
from rollart.models.tooldemos import CALCULATOR, play_tool_episode, tool_call_text
from rollart.models.warmup import (
    DEFAULT_RECIPE,
    TOOL_CALL_RECIPE,
    WarmupRecipe,
    build_demonstrations,
    ensure_quickstart_model,
    ensure_warm_tiny_model,
    render_prompt,
    scenario_recipe,
    warmup_spec,
)

GUESS = DomainConfig(name="guess", env="game:GuessTheNumber-v0-easy", pool="p", reward="env_return")
ARITH = DomainConfig(
    name="arith",
    env="rg:basic_arithmetic",
    pool="p",
    reward="reasoning_gym",
    env_options={
        "min_terms": 2,
        "max_terms": 2,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
)
BOXED = re.compile(r"^\\boxed\{-?\d+\}$")


def test_pairs_are_chat_prompts_with_boxed_completions():
    pairs = build_demonstrations([GUESS, ARITH], 3, seed=0, max_turns=4)
    assert pairs
    for prompt, completion in pairs:
        assert prompt.startswith("<|im_start|>user\n")
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert BOXED.match(completion), completion
    arith = [p for p, _ in pairs if "Calculate" in p]
    assert len(arith) == 3  # single turn: one pair per episode
    assert len(pairs) > 6  # the game is multi-turn: more than one pair per episode


def test_multi_turn_prompts_are_token_exact_with_the_controllers_sequence():
    """Turn k+1's prompt must be the very token sequence the controller builds: prompt ids, the
    generated ids (completion + eos, where the engine stops), then the observation delta."""
    tok = build_char_tokenizer()
    chat = ChatTokens(tok)
    pairs = build_demonstrations([GUESS], 1, seed=3, max_turns=4, tokenizer=tok)
    assert len(pairs) >= 2
    ids = chat.encode(pairs[0][0])
    for (_, completion), (next_prompt, _) in zip(pairs[:-1], pairs[1:], strict=True):
        generated = chat.encode(completion) + [tok.eos_token_id]
        user_text = next_prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        ids = ids + generated + chat.observation_ids(user_text, generated)
        assert ids == chat.encode(next_prompt)


def test_system_prompt_and_templates_are_applied():
    dom = msgspec.structs.replace(
        GUESS,
        system_prompt="Be brief.",
        prompt_template="Game:\n{observation}",
        turn_template="Hint: {observation}",
    )
    pairs = build_demonstrations([dom], 1, seed=1, max_turns=4)
    assert pairs[0][0].startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGame:\n"
    )
    assert "<|im_start|>user\nHint: At turn 1, you guessed" in pairs[1][0]


def test_same_seed_same_pairs_other_seed_other_pairs():
    a = build_demonstrations([GUESS, ARITH], 4, seed=5)
    assert a == build_demonstrations([GUESS, ARITH], 4, seed=5)
    assert a != build_demonstrations([GUESS, ARITH], 4, seed=6)


def test_domains_without_a_solver_are_skipped_and_none_is_an_error():
    sudoku = DomainConfig(name="s", env="game:Sudoku-v0-easy", pool="p", reward="env_return")
    assert build_demonstrations([sudoku, ARITH], 2, seed=0) == build_demonstrations(
        [ARITH], 2, seed=0
    )
    with pytest.raises(ValueError, match="no domain has a scripted solver"):
        build_demonstrations([sudoku], 2, seed=0)
    with pytest.raises(ValueError, match="num_examples"):
        build_demonstrations([ARITH], 0, seed=0)


def test_domain_max_turns_caps_the_episode():
    dom = msgspec.structs.replace(GUESS, max_turns=1)
    pairs = build_demonstrations([dom], 5, seed=0, max_turns=4)
    assert len(pairs) == 5


def test_render_prompt_checks_lengths():
    with pytest.raises(ValueError, match="len\\(observations\\)"):
        render_prompt(build_char_tokenizer(), GUESS, ["a"], ["b"])


def test_warmup_spec_sets_the_model_seed_and_validates():
    assert warmup_spec(7).spec.seed == 7
    assert warmup_spec(7).sft == DEFAULT_RECIPE.sft
    with pytest.raises(msgspec.ValidationError):
        warmup_spec(-1)


def test_warm_up_changes_the_model_and_is_cached(tmp_path):
    small = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
    recipe = WarmupRecipe(spec=small, episodes_per_domain=2, sft=SFTConfig(epochs=1))
    path = ensure_warm_tiny_model(
        tmp_path / "cache", [GUESS, ARITH], model_seed=3, max_turns=4, recipe=recipe
    )
    cold = build_tiny_model(
        tmp_path / "cold", seed=3, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128
    )
    warm_w = load_file(str(path / "model.safetensors"))
    cold_w = load_file(str(cold / "model.safetensors"))
    assert warm_w.keys() == cold_w.keys()
    assert any(not torch.equal(warm_w[k], cold_w[k]) for k in warm_w)
    assert (path / "rollart_sft_history.json").is_file()
    again = ensure_warm_tiny_model(
        tmp_path / "cache", [GUESS, ARITH], model_seed=3, max_turns=4, recipe=recipe
    )
    assert again == path


def test_tool_call_demonstrations_are_the_calculator_conversation_token_exact():
    """The first completion is the hermes call of the task's expression; the second prompt is
    the first prompt + that completion + the engine's end-of-turn token + the tool turn, i.e.
    what the controller's agent capture holds when the agent sends the tool result back."""
    tok = build_char_tokenizer()
    (p1, c1), (p2, c2) = play_tool_episode(ARITH, 7, tok)
    assert p1.startswith("<|im_start|>system\n") and '"name": "calculator"' in p1
    assert c1 == tool_call_text(re.search(r"Calculate (.*)\.", p1).group(1))
    assert p2.startswith(p1 + c1 + "<|im_end|>\n<|im_start|>tool\n")
    assert p2.endswith("<|im_end|>\n<|im_start|>assistant\n") and BOXED.match(c2)
    answer = c2[len("\\boxed{"):-1]
    assert p2[len(p1 + c1):].count(answer) == 1  # the tool's result is the reference answer
    assert CALCULATOR["function"]["name"] == "calculator"
    with pytest.raises(ValueError, match="rg:basic_arithmetic"):
        play_tool_episode(GUESS, 0, tok)


def test_tool_calls_replace_the_arithmetic_demonstrations_only():
    plain = build_demonstrations([GUESS, ARITH], 2, seed=0, max_turns=4)
    tools = build_demonstrations([GUESS, ARITH], 2, seed=0, max_turns=4, tool_calls=True)
    assert [p for p in tools if "<tool_call>" not in p[0] + p[1]] == [
        p for p in plain if "Calculate" not in p[0]]
    calls = [c for _, c in tools if c.startswith("<tool_call>")]
    assert len(calls) == 2 and len(tools) - len(plain) == 2  # two pairs per arith episode


GUESS_SCENARIO = """
[run]
batch_size = 8
group_size = 4
max_turns = 4
[[pools]]
name = "cpu"
[[domains]]
name = "guess"
env = "game:GuessTheNumber-v0-easy"
pool = "cpu"
reward = "env_return"
[model]
path = "tiny"
"""


@pytest.mark.parametrize(("field", "bad"), [
    ("tiny_warmup_episodes", "0"), ("tiny_warmup_episodes", "100001"),
    ("tiny_warmup_epochs", "0"), ("tiny_warmup_epochs", "1001"),
    ("tiny_warmup_lr", "0.0"), ("tiny_warmup_lr", "1.5"), ("tiny_warmup_lr", '"fast"'),
    ("tiny_warmup_explore", "-0.1"), ("tiny_warmup_explore", "1.5"),
    ("tiny_warmup_explore_turns", "0"), ("tiny_warmup_explore_turns", "65"),
    ("tiny_hidden_size", "16"), ("tiny_num_layers", "0"), ("tiny_num_layers", "17"),
    ("tiny_num_heads", "0"),
])
def test_warmup_recipe_fields_are_bounded_and_named_in_the_error(field, bad):
    with pytest.raises(ConfigError, match=rf"model\.{field}"):
        parse_scenario(GUESS_SCENARIO + f"{field} = {bad}\n")


def test_scenario_recipe_defaults_to_the_embedded_recipes_and_takes_the_fields():
    plain = parse_scenario(GUESS_SCENARIO)
    assert plain.model.tiny_warmup_episodes is None
    assert scenario_recipe(plain) == DEFAULT_RECIPE
    set_ = parse_scenario(GUESS_SCENARIO + "tiny_warmup_episodes = 400\ntiny_warmup_epochs = 3\n"
                          "tiny_warmup_lr = 1e-3\n")
    recipe = scenario_recipe(set_)
    assert (recipe.episodes_per_domain, recipe.sft.epochs, recipe.sft.lr) == (400, 3, 1e-3)
    assert recipe.spec == DEFAULT_RECIPE.spec
    assert msgspec.structs.replace(recipe.sft, epochs=1, lr=3e-3) == DEFAULT_RECIPE.sft
    tools = parse_scenario(GUESS_SCENARIO + "tiny_warmup_tool_calls = true\ntiny_warmup_epochs = 4\n")
    assert scenario_recipe(tools) == msgspec.structs.replace(
        TOOL_CALL_RECIPE, sft=msgspec.structs.replace(TOOL_CALL_RECIPE.sft, epochs=4))


def test_a_changed_recipe_never_reuses_a_model_cached_with_another(tmp_path, monkeypatch):
    """The fields reach the tiny model's cache key (spec, SFT settings, demonstrations): the same
    scenario finds the same entry, each changed field another; no model is built here."""
    built: list[Path] = []

    def entry(cache_dir, spec, *, demonstrations, sft):
        demos = [(str(p), str(c)) for p, c in demonstrations]
        built.append(Path(cache_dir) / f"tiny-{_cache_key(validate_spec(spec), sft, demos)}")
        return built[-1]

    monkeypatch.setattr(warmup, "ensure_tiny_model", entry)
    extra = ["", "", "tiny_warmup_episodes = 101\n", "tiny_warmup_epochs = 2\n",
             "tiny_warmup_lr = 1e-3\n", "tiny_warmup_explore = 0.5\n",
             "tiny_warmup_explore = 0.5\ntiny_warmup_explore_turns = 1\n",
             "tiny_num_layers = 4\n", "tiny_num_heads = 4\n", "tiny_hidden_size = 256\n"]
    paths = [ensure_quickstart_model(tmp_path, parse_scenario(GUESS_SCENARIO + e))
             for e in extra]
    assert paths[0] == paths[1]
    assert len(set(paths)) == 9, paths
    # The default recipe's entry is the one the embedded default always had.
    assert paths[0] == entry(tmp_path, warmup_spec(0).spec, demonstrations=build_demonstrations(
        parse_scenario(GUESS_SCENARIO).domains, 100, DEFAULT_RECIPE.demo_seed, max_turns=4),
        sft=DEFAULT_RECIPE.sft)


def _consistent(prompt: str) -> tuple[int, int]:
    lo, hi = 1, 10
    for guess, hint in re.findall(r"you guessed (\d+), and the target number is (higher|lower)",
                                  prompt):
        lo, hi = (max(lo, int(guess) + 1), hi) if hint == "higher" else (lo, min(hi, int(guess) - 1))
    return lo, hi


def test_exploring_demonstrations_guess_at_random_and_leave_the_rest_alone():
    plain = build_demonstrations([GUESS, ARITH], 40, seed=0, max_turns=4)
    assert build_demonstrations([GUESS, ARITH], 40, seed=0, max_turns=4, explore=0.0) == plain
    explored = build_demonstrations([GUESS, ARITH], 40, seed=0, max_turns=4, explore=1.0)
    assert explored == build_demonstrations([GUESS, ARITH], 40, seed=0, max_turns=4, explore=1.0)
    games = [(p, c) for p, c in explored if "Guess The Number" in p]
    bisect = [(lo + hi) // 2 for lo, hi in (_consistent(p) for p, _ in games)]
    guesses = [int(c[len("\\boxed{"):-1]) for _, c in games]
    assert all(1 <= g <= 10 for g in guesses)
    assert sum(g != b for g, b in zip(guesses, bisect, strict=True)) > len(games) // 3
    # the exploring guess ignores the hints: some fall outside the range they leave
    assert any(not lo <= g <= hi for g, (lo, hi) in zip(
        guesses, (_consistent(p) for p, _ in games), strict=True))
    # Arithmetic has no exploring move: its demonstrations stay the reference answers.
    assert [c for p, c in explored if "Calculate" in p] == [c for p, c in plain if "Calculate" in p]
    recipe = scenario_recipe(parse_scenario(GUESS_SCENARIO + "tiny_warmup_explore = 0.25\n"))
    assert recipe.explore == 0.25 and scenario_recipe(parse_scenario(GUESS_SCENARIO)).explore == 0.0


def test_exploring_only_the_opening_randomises_the_first_guess_and_bisects_after_it():
    """explore_turns = 1: each game opens with a uniformly random guess, every later move is
    the bisection midpoint of the range the hints leave."""
    opened = build_demonstrations([GUESS], 200, seed=0, max_turns=4, explore=1.0,
                                  explore_turns=1)
    first = [int(c[len("\\boxed{"):-1]) for p, c in opened if "you guessed" not in p]
    later = [(p, int(c[len("\\boxed{"):-1])) for p, c in opened if "you guessed" in p]
    assert len(first) == 200 and set(first) == set(range(1, 11))
    assert later and all(g == sum(_consistent(p)) // 2 for p, g in later)
    recipe = scenario_recipe(parse_scenario(
        GUESS_SCENARIO + "tiny_warmup_explore = 1.0\ntiny_warmup_explore_turns = 1\n"))
    assert (recipe.explore, recipe.explore_turns) == (1.0, 1)
    assert scenario_recipe(parse_scenario(GUESS_SCENARIO)).explore_turns is None


def test_the_architecture_fields_shape_the_tiny_model_and_default_to_the_spec():
    recipe = scenario_recipe(parse_scenario(
        GUESS_SCENARIO + "tiny_num_layers = 4\ntiny_num_heads = 4\ntiny_hidden_size = 256\n"))
    assert (recipe.spec.num_layers, recipe.spec.num_heads, recipe.spec.hidden_size) == (4, 4, 256)
    assert msgspec.structs.replace(recipe.spec, num_layers=2, num_heads=2, hidden_size=128) == \
        DEFAULT_RECIPE.spec
    assert scenario_recipe(parse_scenario(GUESS_SCENARIO)).spec == DEFAULT_RECIPE.spec


@pytest.mark.parametrize(("fields", "named"), [
    ("tiny_num_heads = 3\n", "tiny_num_heads"),
    ("tiny_hidden_size = 64\ntiny_num_heads = 4\n", "tiny_num_heads"),
    # 50 lies in [32, 512] but vLLM's CPU attention has no kernel for it
    ("tiny_hidden_size = 100\n", "tiny_hidden_size"),
    ("tiny_hidden_size = 48\n", "tiny_hidden_size"),
])
def test_a_head_size_vllm_cpu_cannot_run_is_refused_naming_the_field_set(fields, named):
    with pytest.raises(ConfigError, match=rf"model\.{named}.*head size"):
        parse_scenario(GUESS_SCENARIO + fields)
    parse_scenario(GUESS_SCENARIO + "tiny_hidden_size = 192\ntiny_num_heads = 2\n")  # 96: runs
