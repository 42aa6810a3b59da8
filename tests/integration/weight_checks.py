"""Helpers shared by the weight-sync integration tests: score a fixed token sequence on a worker
and under a trainer checkpoint, and the minimal scenario of a two-rank trainer."""

from __future__ import annotations

from pathlib import Path

import torch

from rollart.inference.client import InferenceClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb

FIXED = [2, 40, 41, 42, 5, 60, 61, 62, 63, 3, 7, 8, 9, 10, 11, 12]

#: A scenario whose trainer runs as two FSDP2 ranks (``extra`` lines join its [trainer] table).
TWO_RANK_SCENARIO = (Path(__file__).parents[1] / "minimal_scenario.toml").read_text() + """\
[trainer]
num_processes = 2
lr = 0.01
"""


async def prompt_logprobs(worker: InferenceClient) -> list[float]:
    """The worker's prompt logprobs of ``FIXED`` (first token excluded), float per token."""
    r = await worker.generate(m.Generate(
        request_id=f"score-{torch.randint(1 << 30, ()).item()}", new_token_ids=tb.pack_i32(FIXED),
        sampling=m.SamplingParams(max_tokens=1, prompt_logprobs=True)))
    assert r.prompt_logprobs is not None
    return [float(x) for x in r.prompt_logprobs[1:]]


def trainer_logprobs(model_dir, ckpt_dir) -> list[float]:
    """Logprobs of ``FIXED`` under the trainer checkpoint ``ckpt_dir`` (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    from rollart.trainer.checkpoint import load_trainer
    from rollart.trainer.step import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_trainer(ckpt_dir, model, torch.optim.AdamW(model.parameters()))
    ids = torch.tensor([FIXED])
    with torch.no_grad():
        lp = token_logprobs(model.eval(), ids, torch.ones_like(ids))
    return lp[0, 1:].tolist()
