"""SIMULATED delta weight transfer (``SimTrainer(delta_bytes_fraction=...)``) on virtual time."""

from __future__ import annotations

import asyncio

import pytest

from rollart.sim.clock import run_virtual
from rollart.sim.hardware import H800
from rollart.sim.models import QWEN3_8B
from rollart.sim.trainer import SimTrainer
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import DomainSpec, DomainTable, const

TABLE = DomainTable([DomainSpec("fixed", response_tokens=const(100))])


class _Fake:
    num_tokens = 1000


def _push_seconds(**kw) -> tuple[list[float], list[int], dict]:
    async def main():
        workers = [SimInferenceWorker(f"w{i}", hardware=H800, model=QWEN3_8B, domains=TABLE)
                   for i in range(2)]
        trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, **kw)
        out = []
        for v in range(1, 5):
            await trainer.train([_Fake()])
            t0 = asyncio.get_running_loop().time()
            await trainer.push_weights(v, workers)
            out.append(asyncio.get_running_loop().time() - t0)
        return out, trainer.delta_versions, dict(workers[0]._staged)

    return run_virtual(main)


def test_delta_versions_move_their_fraction_and_are_rebuilt_in_full() -> None:
    full, none, staged_full = _push_seconds()
    assert none == [] and full == pytest.approx([0.656] * 4)  # 16.4e9 B / 25e9 B/s
    secs, deltas, staged = _push_seconds(delta_bytes_fraction=0.05, full_every=4,
                                         delta_encode_bytes_per_s=16.4e9,
                                         delta_rebuild_bytes_per_s=8.2e9)
    assert deltas == [2, 3]  # version 1 (no base) and 4 (full_every) go in full
    # 1 s encode, then 0.05 x 0.656 s on the link overlapped with a 2 s rebuild.
    assert secs == pytest.approx([0.656, 3.0, 3.0, 0.656])
    assert staged == staged_full  # the apply still loads every byte of each version


def test_delta_options_are_checked() -> None:
    with pytest.raises(ValueError, match="delta_bytes_fraction"):
        SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, delta_bytes_fraction=0.0)
    with pytest.raises(ValueError, match="full_every"):
        SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, full_every=0)


def test_a_free_codec_leaves_only_the_fraction_on_the_link() -> None:
    secs, deltas, _ = _push_seconds(delta_bytes_fraction=0.05)
    assert deltas == [2, 3, 4] and secs == pytest.approx([0.656] + [0.0328] * 3)
