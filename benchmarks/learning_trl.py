"""The reference side of ``benchmarks.learning``: TRL's ``GRPOTrainer`` (transformers
generation on CPU, no vLLM) on the same checkpoint, prompts, scorer and settings as rollart.

``TRL_SETTINGS`` are the TRL options that bring its GRPO closest to rollart's (see
``docs/performance/learning.md``); the JSON records them. Needs the ``learning`` extra
(``pip install -e .[cpu,dev,learning]``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.learning_game import trl_rollout
from benchmarks.learning_task import (
    LearningSettings,
    Task,
    domain_of,
    evaluate,
    make_tasks,
    score,
    training_seeds,
)

#: TRL options chosen to match rollart's GRPO (value, why)
TRL_SETTINGS: dict[str, tuple[Any, str]] = {
    "loss_type": ("dapo", "token sum over the whole batch / its loss-token count, as rollart"),
    "scale_rewards": ("group", "(r - mean_g) / std_g per group, as rollart"),
    "importance_sampling_level": ("token", "per-token PPO ratio, as rollart"),
    "num_iterations": (1, "one pass over each batch (rollart: num_minibatches 1)"),
    "steps_per_generation": (1, "one optimizer step per generated batch, as sync mode"),
    "lr_scheduler_type": ("constant", "rollart keeps lr constant"),
    "warmup_steps": (0, "no lr warm-up in rollart"),
    "weight_decay": (0.0, "rollart's AdamW default"),
    "optim": ("adamw_torch", "torch AdamW, betas (0.9, 0.999), eps 1e-8, as rollart"),
    "shuffle_dataset": (False, "step k trains the prompts of rollart's step k (sync mode "
                        "starts groups in seed order)"),
    "mask_truncated_completions": (False, "rollart trains on truncated replies too"),
    "top_p": (1.0, "rollart's default sampling"),
    "top_k": (0, "no top-k (rollart: -1)"),
    "use_vllm": (False, "transformers generation: no vLLM / trainer logprob mismatch"),
    "disable_dropout": (True, "the tiny model has no dropout; harmless"),
}


def trl_available() -> bool:
    """Whether TRL imports (the ``learning`` extra is installed)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def train_trl(s: LearningSettings, model_dir: Path, heldout: list[Task], seed: int,
              out_dir: Path) -> dict[str, Any]:
    """Train ``s.steps`` GRPO steps with TRL from ``model_dir``; evaluate ``heldout`` after
    every step in ``s.eval_steps()`` (step 0 is left to the caller: both sides share it).

    Returns ``{"eval": {step: evaluate(...)}, "train_reward": [per step], "wall_s": float,
    "step_wall_s": [per step seconds since training started]}``.
    Raises ImportError without TRL."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seeds = training_seeds(seed, s.steps * s.prompts_per_step)
    tasks = make_tasks(s, tokenizer, seeds)
    data = Dataset.from_list([{"prompt": t.prompt, "entry": json.dumps(t.entry)} for t in tasks])
    game: dict[str, Any] = {}
    if s.is_game:
        # TRL has no multi-turn env loop of its own for untooled text games: its rollout
        # function hook plays the game; GRPO (advantages, masking, loss) stays TRL's.
        game["rollout_func"] = trl_rollout(
            domain_of(s), tokenizer, iter(seeds), group_size=s.group_size,
            max_turns=s.max_turns, max_new_tokens=s.max_new_tokens,
            temperature=s.temperature)

    def reward(prompts: list[str], completions: list[str], entry: list[str],
               **kw: Any) -> list[float]:
        if s.is_game:
            return list(kw["game_reward"])
        return [score(s, c, json.loads(e)) for c, e in zip(completions, entry, strict=True)]

    options = {k: v for k, (v, _) in TRL_SETTINGS.items()}
    config = GRPOConfig(
        output_dir=str(out_dir), seed=seed, max_steps=s.steps, use_cpu=True,
        per_device_train_batch_size=s.batch_size, gradient_accumulation_steps=1,
        num_generations=s.group_size, learning_rate=s.lr, max_grad_norm=s.max_grad_norm,
        epsilon=s.clip_eps, epsilon_high=s.clip_eps, beta=s.kl_coef,
        temperature=s.temperature, max_completion_length=s.max_new_tokens,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        bf16=False, fp16=False, **options)
    evals: dict[int, dict[str, float]] = {}
    step_wall: list[float] = []
    paused = [0.0]
    t0 = time.perf_counter()

    class Eval(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step_wall.append(time.perf_counter() - t0 - paused[0])
            if state.global_step in s.eval_steps():
                t = time.perf_counter()
                evals[state.global_step] = evaluate(s, kw["model"], tokenizer, heldout)
                paused[0] += time.perf_counter() - t  # eval time is not training time

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Eval()], **game)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"eval": evals, "train_reward": rewards, "step_wall_s": step_wall,
            "wall_s": time.perf_counter() - t0}
