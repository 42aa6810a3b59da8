"""One `train_step` per case on the tiny model, in one process or as a torchrun rank.

Run by ``test_trainer_fsdp.py``: ``python fsdp_step_worker.py OUT_DIR`` (one process) or
``torchrun --nproc-per-node 2 fsdp_step_worker.py OUT_DIR`` (FSDP2 over gloo). For each case it
builds the model from a fixed spec, makes deterministic samples (behaviour logprobs from the
unsharded model), trains one step and writes, from rank 0 only, ``OUT_DIR/CASE.safetensors``
(full updated parameters) and ``OUT_DIR/CASE.json`` (the metrics).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollart.models.tiny import TinyModelSpec, init_tiny_model
from rollart.trainer.distributed import RankGroup, gather_parameters, place_model
from rollart.trainer.step import TrainSample, TrainStepConfig, token_logprobs, train_step

#: the version the model's weights stand for (``train_step``'s ``weights_version``)
WEIGHTS_VERSION = 1
SPEC = TinyModelSpec(seed=0, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)

#: name -> (number of samples, behaviour-logprob noise in nats, step config, optimizer).
#: "odd": 5 samples (not divisible by 2), a 16-token budget (one sample per micro-batch: rank 0
#: runs 3 micro-batches to rank 1's 2) and plain SGD without clipping, so the update is the
#: gradient itself and any error of scale shows in the weights (AdamW and clipping would hide
#: it). "clipped": SGD with the gradient norm clipped (3.3 -> 1), so the weights show that
#: every shard was scaled by the global norm's coefficient. "minibatches": the trainer's AdamW,
#: two optimizer steps, off-policy samples, clipping.
CASES = {
    "odd": (5, 0.0, TrainStepConfig(max_tokens_per_microbatch=16, max_grad_norm=1e6), "sgd"),
    "clipped": (5, 0.2, TrainStepConfig(max_tokens_per_microbatch=32, max_grad_norm=1.0), "sgd"),
    "minibatches": (7, 0.3, TrainStepConfig(max_tokens_per_microbatch=40, num_minibatches=2),
                    "adamw"),
}


def make_samples(model: torch.nn.Module, n: int, noise: float) -> list[TrainSample]:
    """Lengths 6..16 (6 + 5i mod 11), the second half generated, alternating advantages."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(n):
        length = 6 + (i * 5) % 11
        ids = torch.randint(5, 102, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = token_logprobs(model, x, torch.ones_like(x))[0]
        # Generated tokens alternate versions 0 and 1: the agreement compares the version-1
        # ones (WEIGHTS_VERSION), on every rank alike.
        samples.append(TrainSample.from_lists(
            token_ids=ids, loss_mask=mask,
            behaviour_logprobs=[float(v) - noise if m else 0.0 for v, m in zip(lp, mask, strict=True)],
            advantage=(1.0, -0.5, 2.0)[i % 3], sample_id=f"s{i}",
            behaviour_versions=[k % 2 for k in range(sum(mask))]))
    return samples


def main(out_dir: Path) -> int:
    ranks = RankGroup.from_env("cpu", collective_timeout_s=120.0)
    rank = 0 if ranks is None else ranks.rank
    for name, (n, noise, cfg, optimizer) in CASES.items():
        model = init_tiny_model(SPEC)
        samples = make_samples(model, n, noise)
        model = place_model(model, "cpu", ranks)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-3))
        agreement: list = []
        metrics = train_step(model, opt, samples, cfg, dp=ranks, agreement=agreement,
                             weights_version=WEIGHTS_VERSION)
        params = gather_parameters(model, keep=rank == 0)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in params}, str(out_dir / f"{name}.safetensors"))
            (out_dir / f"{name}.json").write_text(json.dumps({**metrics,
                                                              "agreement": agreement}))
    if ranks is not None:
        ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
