"""WeightSync's timings: a sync that is all exposed reports total == exposed exactly."""

from __future__ import annotations

import itertools

from rollart.controller.training.weightsync import WeightSync


class FakeTrainer:
    version = 1
    push_needs_pause = True  # a collective push (gloo / NCCL): at the pause point, all exposed

    async def push_weights(self, version, workers) -> None:
        self.pushed = version


class FakeProxy:
    version = 0

    def workers(self) -> list:
        return []

    async def pause(self, mode: str) -> None:
        pass

    async def apply_weights(self, version: int, *, reprefill: bool) -> None:
        self.version = version

    async def resume(self) -> None:
        pass


async def test_a_sync_at_the_pause_point_is_all_exposed_to_the_last_digit() -> None:
    # Each reading of the clock advances it by 100 ns, as perf_counter does between two calls;
    # two readings made total and exposed differ by that, past pytest.approx's 1e-6 on a
    # gloo sync of a few ms (run_e2e's check, failing on a fast CI machine).
    ticks = itertools.count()
    sync = WeightSync(FakeProxy(), FakeTrainer(), lambda: next(ticks) * 1e-7, reprefill=False,
                      on_applied=lambda: None, on_push_done=lambda task: None)
    total_s, exposed_s = await sync.apply_newest()
    assert total_s > 0 and total_s == exposed_s
