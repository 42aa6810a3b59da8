"""GRPO advantages of a batch (numpy: the controller process never imports torch).

The one implementation in rollart: the trainer receives each sample's advantage on the wire
(``TrainSample.advantage``, filled by ``rollart.controller.training.remote.to_train_samples``)
and never recomputes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollart.controller.buffer.sample import Sample


def grpo_advantages(samples: Sequence[Sample], eps: float = 1e-6) -> list[float]:
    """GRPO advantages of a batch of whole groups, one per sample, in ``samples`` order.

    ``(r - mean_g) / (std_g + eps)`` per group (Shao et al. 2024, DeepSeekMath §4.1), with the
    population std (divide by n) in float64; a group whose rewards are all equal (or of one
    member) gets exactly 0. Every sample is valid: the batch holds only kept samples, so failed
    or cancelled members never enter a group's baseline. Groups are keyed by
    ``sample.group_key``.

    Returns:
        float64 values as Python floats, one per sample; ``[]`` for an empty batch.

    Raises:
        ValueError: a reward is NaN or infinite.
    """
    keys: dict[str, int] = {}
    n = len(samples)
    inverse = np.fromiter((keys.setdefault(s.group_key, len(keys)) for s in samples),
                          dtype=np.intp, count=n)
    r = np.fromiter((s.reward for s in samples), dtype=np.float64, count=n)
    if not np.isfinite(r).all():
        raise ValueError("rewards of valid members must be finite")
    num_groups = len(keys)
    count = np.bincount(inverse, minlength=num_groups).astype(np.float64)
    mean = np.bincount(inverse, weights=r, minlength=num_groups) / np.maximum(count, 1.0)
    centered = r - mean[inverse]
    var = np.bincount(inverse, weights=centered * centered, minlength=num_groups) \
        / np.maximum(count, 1.0)
    std = np.sqrt(var)
    # "All equal" is decided exactly (max == min), as the trainer's version does: rounding of
    # the mean could otherwise leave a tiny r - mean divided by a tiny std.
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, inverse, r)
    np.minimum.at(gmin, inverse, r)
    informative = (count >= 2) & (gmax > gmin)
    adv = np.where(informative[inverse], centered / (std[inverse] + eps), 0.0)
    return [float(a) for a in adv]
