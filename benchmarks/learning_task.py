"""The task, held-out set and evaluator that ``benchmarks.learning`` shares between rollart and
TRL.

Both sides train the same checkpoint (the tiny model warmed up on the task's own solver
demonstrations, ``rollart.models.warmup.ensure_quickstart_model``) on prompts rendered by
``rollart.models.warmup.render_prompt`` (the chat template the controller renders), scored by
reasoning-gym's own ``score_answer`` through ``rollart.reward.builtins.reasoning_gym_reward``
(the function the reward service runs).

The held-out set is entry 0 of the task's dataset at env seeds ``HELDOUT_SEED_BASE + i``:
the controller draws training env seeds from ``[0, 2**31)`` (``random.randrange(2**31)``) and
the warm-up's demonstrations from ``[0, 2**31 - 1)``, so held-out seeds never meet either.
`evaluate` decodes it greedily with transformers (one batch, left padded) and scores every
reply with the same scorer: the ONE evaluator both sides' weights go through.

A game task (``game:GuessTheNumber-*``, ``max_turns`` > 1) is played instead of answered:
``learning_game`` plays it turn by turn with the same tokenisation as rollart's controller and
scores it with the ``env_success`` reward; its majority baseline is the best fixed action
sequence.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: held-out env seeds start here: above every training / warm-up env seed (module docstring)
HELDOUT_SEED_BASE = 2**31


@dataclass(frozen=True)
class LearningSettings:
    """What both sides share. ``steps`` optimizer steps of ``prompts_per_step`` groups of
    ``group_size`` samples each; ``eval_every`` steps between held-out evaluations (and at the
    last step); ``eval_size`` held-out tasks."""

    env: str = "rg:letter_counting"
    env_options: dict[str, Any] = field(
        default_factory=lambda: {"min_words": 3, "max_words": 6})
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    lr: float = 3e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    max_new_tokens: int = 16
    max_grad_norm: float = 1.0
    eval_every: int = 5
    eval_size: int = 200
    model_seed: int = 0
    #: assistant turns per episode: 1 for a reasoning-gym task, the game's turns for a game
    max_turns: int = 1

    @property
    def is_game(self) -> bool:
        """Whether the task is a multi-turn game (``learning_game``), not a reasoning-gym
        task."""
        from benchmarks.learning_game import is_game

        return is_game(self.env)

    @property
    def dataset(self) -> str:
        """The reasoning-gym dataset name (``rg:NAME`` -> ``NAME``)."""
        return self.env.removeprefix("rg:")

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.prompts_per_step * self.group_size

    def eval_steps(self) -> list[int]:
        """Steps after which the held-out set is evaluated (0 is the starting checkpoint)."""
        return sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps})


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def scenario_toml(s: LearningSettings, *, seed: int, model_path: str,
                  checkpoint_every: int | None = None, mode: str = "sync") -> str:
    """A single-domain scenario that trains ``s`` with rollart (``rollart run``). ``model_path``
    "tiny" builds the warmed-up tiny model; a directory uses that checkpoint. Settings TRL has
    no counterpart for are at their neutral values (one minibatch: the PPO ratio is 1 at the
    update; no redundancy; no staleness)."""
    model = ('path = "tiny"\ntiny_seed = ' + str(s.model_seed) + "\ntiny_warmup = true"
             if model_path == "tiny" else f"path = {_toml_value(model_path)}")
    alpha = 0 if mode == "sync" else 1
    every = s.eval_every if checkpoint_every is None else checkpoint_every
    return f"""\
[run]
seed = {seed}
steps = {s.steps}
mode = "{mode}"
alpha = {alpha}
batch_size = {s.batch_size}
group_size = {s.group_size}
redundancy = 1
max_turns = {s.max_turns}
max_tokens_per_turn = {s.max_new_tokens}
max_tokens_per_trajectory = 1100
generate_timeout_s = 300.0
env_timeout_s = 60.0

[model]
{model}
dtype = "float32"

[[pools]]
name = "reasoning"
hardware = "cpu"
num_workers = 1
[pools.engine]
kv_cache_bytes = 268435456
max_model_len = 1152
max_num_seqs = {max(s.batch_size, 8)}

[[domains]]
name = "task"
env = {_toml_value(s.env)}
pool = "reasoning"
reward = "{'env_success' if s.is_game else 'reasoning_gym'}"
reward_url = "service"
env_options = {_toml_value(s.env_options)}
[domains.sampling]
temperature = {s.temperature}

[[env_hosts]]
name = "envhost"
step_timeout_s = 30.0
threads = 4

[trainer]
lr = {s.lr}
clip_eps = {s.clip_eps}
kl_coef = {s.kl_coef}
max_grad_norm = {s.max_grad_norm}
num_minibatches = 1
checkpoint_every = {every}
device = "cpu"

[output]
transcripts_per_step = 0
tensorboard = false
"""


def parse(toml_text: str) -> Any:
    """The validated ``rollart.config.Scenario`` of ``toml_text`` (raises ConfigError)."""
    from rollart.config import parse_scenario

    return parse_scenario(toml_text, "<benchmarks.learning scenario>")


def ensure_model(s: LearningSettings, cache_dir: Path) -> Path:
    """The warmed-up tiny checkpoint both sides start from (built and cached on first use)."""
    from rollart.models.warmup import ensure_quickstart_model

    return ensure_quickstart_model(cache_dir, parse(scenario_toml(s, seed=0, model_path="tiny")))


@dataclass(frozen=True)
class Task:
    """One task instance: the rendered prompt text and the dataset entry that scores it."""

    seed: int
    prompt: str
    entry: dict[str, Any]


def domain_of(s: LearningSettings) -> Any:
    """The benchmark scenario's one ``rollart.config.DomainConfig``."""
    return parse(scenario_toml(s, seed=0, model_path="tiny")).domains[0]


def make_tasks(s: LearningSettings, tokenizer: Any, seeds: list[int]) -> list[Task]:
    """The tasks at env ``seeds``: the observation the env host would send (question plus the
    answer instruction; a game's reset observation, with an empty ``entry``) rendered with the
    domain's chat template."""
    from rollart.envhost.families import RG_ANSWER_INSTRUCTION, rg_entry
    from rollart.models.warmup import render_prompt

    domain = domain_of(s)
    out = []
    if s.is_game:
        from rollart.envhost.families import make_env

        for seed in seeds:
            env = make_env(s.env, s.env_options)
            try:
                obs, _ = env.reset(seed)
            finally:
                env.close()
            out.append(Task(seed, render_prompt(tokenizer, domain, [obs], []), {}))
        return out
    for seed in seeds:
        entry = rg_entry(s.dataset, seed, s.env_options)
        text = render_prompt(tokenizer, domain, [entry["question"] + RG_ANSWER_INSTRUCTION], [])
        out.append(Task(seed, text, entry))
    return out


def heldout_tasks(s: LearningSettings, tokenizer: Any) -> list[Task]:
    """The fixed held-out set (seeds ``HELDOUT_SEED_BASE + i``, ``i < eval_size``)."""
    return make_tasks(s, tokenizer, [HELDOUT_SEED_BASE + i for i in range(s.eval_size)])


def training_seeds(seed: int, num_groups: int) -> list[int]:
    """Env seeds of the first ``num_groups`` groups a single-domain run with ``run.seed =
    seed`` starts, in start order: the controller's ``random.Random(run.seed)`` picks the
    group's domain (``choices``: one draw even with one domain), then its env seed
    (``randrange(2**31)``). Checked against a run's transcripts: group ``gN`` has entry N."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        rng.choices((0,), weights=(1.0,))
        out.append(rng.randrange(2**31))
    return out


def score(s: LearningSettings, response: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's score of ``response`` (reward service's ``reasoning_gym`` function)."""
    from rollart.reward.builtins import reasoning_gym_reward

    reward, _ = reasoning_gym_reward("", response, None, {"dataset": s.dataset, "entry": entry})
    return reward


def evaluate(s: LearningSettings, model: Any, tokenizer: Any, tasks: list[Task],
             batch: int = 256, sample_seed: int = 0) -> dict[str, float]:
    """Greedy held-out accuracy of ``model`` (a transformers causal LM, on CPU).

    Returns ``{"accuracy": mean greedy score in [0, 1], "distinct_answer_share": distinct
    extracted greedy answers / tasks, "boxed_share": share of greedy replies with a \\boxed{}
    answer, "sampled_accuracy": mean score of one reply per task sampled at ``s.temperature``
    (seeded by ``sample_seed``; the caller's torch RNG state is left as it was)}``. A game's
    tasks are played turn by turn (``learning_game.evaluate_game``: win rates)."""
    if s.is_game:
        from benchmarks.learning_game import evaluate_game

        return evaluate_game(model, tokenizer, domain_of(s), [t.seed for t in tasks],
                             max_turns=s.max_turns, max_new_tokens=s.max_new_tokens,
                             temperature=s.temperature, sample_seed=sample_seed)
    import torch

    from rollart.reward.builtins import last_boxed

    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    greedy: list[str] = []
    sampled: list[str] = []
    try:
        # fork_rng: TRL's own sampling draws from the global generator; evaluating must not
        # shift its random stream.
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            for i in range(0, len(tasks), batch):
                enc = tokenizer([t.prompt for t in tasks[i:i + batch]], return_tensors="pt",
                                padding=True, add_special_tokens=False)
                n = enc["input_ids"].shape[1]
                for do_sample, replies in ((False, greedy), (True, sampled)):
                    extra = {"temperature": s.temperature, "top_k": 0, "top_p": 1.0} \
                        if do_sample else {}
                    out = model.generate(**enc, do_sample=do_sample, **extra,
                                         max_new_tokens=s.max_new_tokens, eos_token_id=eos,
                                         pad_token_id=tokenizer.pad_token_id)
                    replies += tokenizer.batch_decode(out[:, n:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    scores = [score(s, r, t.entry) for r, t in zip(greedy, tasks, strict=True)]
    sampled_scores = [score(s, r, t.entry) for r, t in zip(sampled, tasks, strict=True)]
    answers = [last_boxed(r) for r in greedy]
    return {"accuracy": sum(scores) / len(scores),
            "distinct_answer_share": len(set(answers)) / len(answers),
            "boxed_share": sum(a is not None for a in answers) / len(answers),
            "sampled_accuracy": sum(sampled_scores) / len(sampled_scores)}


def majority_baseline(s: LearningSettings, tasks: list[Task]) -> tuple[str, float]:
    """The best constant answer on ``tasks`` and its accuracy, measured: every reference answer
    of the set (and 0..20) is scored as ``\\boxed{c}`` against every task. For a game: the best
    fixed action sequence (``learning_game.fixed_sequence_baseline``)."""
    if s.is_game:
        from benchmarks.learning_game import fixed_sequence_baseline

        return fixed_sequence_baseline(domain_of(s), [t.seed for t in tasks], s.max_turns)
    candidates = Counter(str(t.entry["answer"]) for t in tasks)
    for c in range(21):
        candidates.setdefault(str(c), 0)
    best = ("", -1.0)
    for c in candidates:
        acc = sum(score(s, f"\\boxed{{{c}}}", t.entry) for t in tasks) / len(tasks)
        if acc > best[1]:
            best = (c, acc)
    return best


def load_rollart_weights(model: Any, checkpoint: Path) -> None:
    """Load the trainer's weights of a rollart checkpoint (``DIR/step_N``, DCP format) into
    ``model`` in place. Raises FileNotFoundError when ``checkpoint`` has no trainer state and
    KeyError when the checkpoint lacks one of the model's parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = checkpoint / "trainer"
    if not path.is_dir():
        raise FileNotFoundError(f"no trainer checkpoint in {checkpoint}")
    sd = get_model_state_dict(model)
    state = {"model": sd}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
