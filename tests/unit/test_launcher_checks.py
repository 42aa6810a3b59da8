"""Launcher checks: workers started for another weight transfer are refused before the first
step; a failed process's error lines are shown even far above its log tail."""

from __future__ import annotations

import msgspec
import pytest
from test_controller_fakes import FakeWorker, make_scenario

from rollart.launcher.local import _check_weight_transfer
from rollart.transport import messages as m
from rollart.transport.errors import RollartError


class FakeTransferWorker(FakeWorker):
    def __init__(self, name: str, kind: str) -> None:
        super().__init__(name)
        self.address, self.kind = f"tcp://{name}:1", kind

    async def stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=0, num_waiting=0, version=0,
                             weight_transfer=self.kind)  # type: ignore[arg-type]


def _scenario(kind: str):
    sc = make_scenario()
    return msgspec.structs.replace(
        sc, trainer=msgspec.structs.replace(sc.trainer, weight_transfer=kind))


async def test_a_worker_without_the_collective_transfer_is_named() -> None:
    workers = [FakeTransferWorker("a", "gloo"), FakeTransferWorker("b", "zmq")]
    with pytest.raises(RollartError, match=r"\{'tcp://b:1': 'zmq'\}.*--weight-transfer gloo"):
        await _check_weight_transfer(_scenario("gloo"), workers)
    await _check_weight_transfer(_scenario("gloo"), workers[:1])
    await _check_weight_transfer(_scenario("zmq"), workers)  # staged buckets: any worker


def test_a_failure_far_above_the_log_tail_is_still_shown(tmp_path) -> None:
    from rollart.launcher.procs import log_tail

    log = tmp_path / "trainer.log"
    log.write_text("start\nValueError: LOCAL_RANK 1 but only 0 CUDA device(s) visible\n"
                   + "".join(f"torchrun summary line {i}\n" for i in range(40)))
    text = log_tail(log, num_lines=30)
    assert "LOCAL_RANK 1 but only 0 CUDA device(s)" in text
    assert text.endswith("torchrun summary line 39")
    short = tmp_path / "ok.log"
    short.write_text("a\nb\n")
    assert log_tail(short) == "a\nb"
