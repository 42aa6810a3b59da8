"""Probe a warmed-up tiny policy on one single-turn reasoning-gym domain, before any RL.

Samples ``K`` answers (temperature 1, as the quickstart samples) and one greedy answer for
each of ``N`` env seeds, scores them with the reward service's own ``reasoning_gym`` function,
and prints the mean sampled and greedy reward and how many groups of ``K`` are flat (every
reward equal: zero GRPO advantage, no gradient). README "What the quickstart learns" quotes it.

    PYTHONPATH=src python docs/quickstart/probe_domain.py MODEL_DIR scenarios/quickstart.toml \\
        letters 40 4

``MODEL_DIR``: the warmed-up checkpoint the scenario's run used (``~/.cache/rollart/tiny-*``,
printed nowhere else: the newest one after a run). Env seeds come from ``random.Random(7)``, sampling from ``torch.manual_seed(0)``.
"""

from __future__ import annotations

import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollart.config import load_scenario
from rollart.envhost.families import make_env
from rollart.models.warmup import render_prompt
from rollart.reward.builtins import reasoning_gym_reward


def main(model_dir: str, scenario: str, domain_name: str, n: int, k: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sc = load_scenario(scenario)
    dom = next(d for d in sc.domains if d.name == domain_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    gen = {"max_new_tokens": sc.run.max_tokens_per_turn, "eos_token_id": eos,
           "pad_token_id": eos}
    rng = random.Random(7)
    sampled: list[float] = []
    greedy: list[float] = []
    flat = 0
    for _ in range(n):
        env = make_env(dom.env, dom.env_options)
        obs, info = env.reset(rng.randrange(2**31 - 1))
        prompt = render_prompt(tok, dom, [obs], [])
        ids = tok(prompt, return_tensors="pt").input_ids
        metadata = {key: v for key, v in info.items() if key != "reference"}
        with torch.no_grad():
            many = model.generate(ids.repeat(k, 1), do_sample=True, temperature=1.0, top_k=0,
                                  **gen)
            best = model.generate(ids, do_sample=False, **gen)
        rewards = [reasoning_gym_reward(prompt, tok.decode(row[ids.shape[1]:],
                                                           skip_special_tokens=True),
                                        None, metadata)[0] for row in many]
        flat += len(set(rewards)) == 1
        sampled += rewards
        text = tok.decode(best[0][ids.shape[1]:], skip_special_tokens=True)
        greedy.append(reasoning_gym_reward(prompt, text, None, metadata)[0])
    print(f"{dom.name} ({dom.env} {dom.env_options}): sampled mean {sum(sampled) / len(sampled):.3f}"
          f", greedy mean {sum(greedy) / len(greedy):.3f}, flat groups {flat}/{n} (K = {k})")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]))
