"""A user's own admission policy (examples/admission_policy.py, shown in docs/policies.md): its
hypothesis test passes, the page shows the file as it is, and a run over fake backends uses
the policy (``Cluster(buffer_class=...)``)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path

import pytest

from helpers.fakes import FakeEnvHost, FakeReward, FakeTrainer, FakeWorker, make_scenario
from rollart.controller import Backends, Cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "admission_policy.py"


def _example():
    spec = importlib.util.spec_from_file_location("admission_policy", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_show_the_example_file() -> None:
    page = (ROOT / "docs" / "policies.md").read_text()
    section = page.split("## Your own admission policy", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert code == EXAMPLE.read_text()


def test_the_examples_property_test_passes() -> None:
    _example().test_cap_and_staleness_bound_hold()


@pytest.mark.looptime
async def test_a_run_admits_through_the_users_policy() -> None:
    from helpers.fakes import TOK

    base = _example().DomainCapBuffer
    seen: list[dict[str, int]] = []

    class Recording(base):
        def try_start_group(self, group_key, domain="default", alpha=None):
            ids = super().try_start_group(group_key, domain, alpha)
            seen.append(self.groups_in_flight_by_domain())
            return ids

    b = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                 trainer=FakeTrainer(), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=2, latency=lambda i, s: 1.0 + i % 3)],
                 reward_service=FakeReward())
    cluster = Cluster.from_scenario(make_scenario(alpha=2), backends=b, buffer_class=Recording)
    async with cluster:
        async def go():
            return [s async for s in cluster.train(steps=3)]

        steps = await asyncio.wait_for(go(), 10_000)
    assert isinstance(cluster.controller.buffer, Recording)
    assert len(steps) == 3 and seen
    # alpha = 2 would allow 6 groups in flight; the policy holds each domain to one
    assert max(max(d.values(), default=0) for d in seen) == 1


def test_batch_order_is_a_policy_a_subclass_can_change() -> None:
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.buffer.sample import Sample

    class PreferMath(SampleBuffer):
        def batch_order(self, domain, min_version, seq):
            return (domain != "math", *super().batch_order(domain, min_version, seq))

    def fill(buf):
        for key, domain in (("g0", "game"), ("g1", "math")):
            for tid in buf.try_start_group(key, domain):
                buf.begin_turn(tid, 0)
                buf.complete(tid, Sample(sample_id=tid, group_key=key, token_ids=[1, 2],
                                         loss_mask=[0, 1], behaviour_logprobs=[0.0, -1.0],
                                         versions=[-1, 0], reward=1.0, domain=domain))
        return {s.group_key for s in buf.take_batch()}

    assert fill(SampleBuffer(alpha=1, batch_size=2, group_size=2)) == {"g0"}  # oldest first
    assert fill(PreferMath(alpha=1, batch_size=2, group_size=2)) == {"g1"}


async def test_admission_yields_to_the_loop_between_bursts_of_groups() -> None:
    # Issue 11: a training step frees room for a whole batch of groups at once; admitting
    # them all in one pass (with each member's first step) held every reply waiting behind it
    # for tens of ms at 10k trajectories. At most ADMIT_PER_PASS trajectories (plus the rest
    # of the group that reached it) may be admitted in one pass of the event loop.
    from collections import Counter

    from helpers.fakes import TOK
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.rollout.admission import ADMIT_PER_PASS

    ticks = 0
    admitted_at: Counter[int] = Counter()

    class Recording(SampleBuffer):
        def try_start_group(self, group_key, domain="default", alpha=None):
            ids = super().try_start_group(group_key, domain, alpha)
            if ids is not None:
                admitted_at[ticks] += len(ids)
            return ids

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)  # once per pass of the event loop

    b = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                 trainer=FakeTrainer(), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=2, latency=lambda i, s: 0.01)],
                 reward_service=FakeReward())
    # room for (3 + 1) x 32 / 8 = 16 groups, 128 trajectories, at the start
    sc = make_scenario(alpha=3, batch_size=32, group_size=8)
    cluster = Cluster.from_scenario(sc, backends=b, buffer_class=Recording)
    ticking = asyncio.create_task(ticker())
    try:
        async with cluster:
            async with asyncio.timeout(120):
                steps = [s async for s in cluster.train(steps=2)]
    finally:
        ticking.cancel()
    assert len(steps) == 2 and sum(admitted_at.values()) >= 128
    assert max(admitted_at.values()) <= ADMIT_PER_PASS + 8 - 1, admitted_at
    assert len(admitted_at) >= 4  # the first 128 alone took four passes
