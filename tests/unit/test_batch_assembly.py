"""Batch assembly is a policy (``SampleBuffer.assemble_batch``): the dynamic-sampling class of
docs/policies.md filters flat groups out of batches, the buffer checks the plan it gets back, discarded
tokens are accounted under the policy's reason, and a run over fake backends trains through it
(``Cluster(buffer_class=...)``)."""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path

import pytest

from helpers.fakes import (
    TOK,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.controller import Backends, Cluster
from rollart.controller.buffer.core import BatchPlan, SampleBuffer, SampleBufferError
from rollart.controller.buffer.sample import Sample

ROOT = Path(__file__).resolve().parents[2]


def _docs_policy() -> type[SampleBuffer]:
    page = (ROOT / "docs" / "policies.md").read_text()
    section = page.split("## Your own batch assembly", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    scope: dict = {}
    exec(compile(code, "docs/policies.md", "exec"), scope)  # the page's own code, as shown
    return scope["DynamicSampling"]


def _fill(buf: SampleBuffer, groups: dict[str, list[float]], domain: str = "math") -> None:
    for key, rewards in groups.items():
        for tid, r in zip(buf.try_start_group(key, domain), rewards, strict=True):
            assert buf.begin_turn(tid, buf.version) == "continue"
            buf.record_tokens(tid, [buf.version] * 3)
            buf.complete(tid, Sample(sample_id=tid, group_key=key, token_ids=[1, 2, 3, 4],
                                     loss_mask=[0, 1, 1, 1], behaviour_logprobs=[0.0, -1, -1, -1],
                                     versions=[-1, buf.version, buf.version, buf.version],
                                     reward=r, domain=domain))


def test_the_docs_policy_discards_flat_groups_and_trains_the_rest() -> None:
    groups = {"g0": [0.0, 0.0], "g1": [1.0, 0.0], "g2": [1.0, 1.0], "g3": [0.5, 0.0]}
    default = SampleBuffer(alpha=1, batch_size=4, group_size=2)
    _fill(default, groups)
    assert [s.group_key for s in default.take_batch()] == ["g0", "g0", "g1", "g1"]

    buf = _docs_policy()(alpha=1, batch_size=4, group_size=2)
    _fill(buf, groups)
    assert [s.group_key for s in buf.take_batch()] == ["g1", "g1", "g3", "g3"]
    st = buf.stats()
    assert st.groups_dropped == {"flat": 2}
    assert st.wasted_tokens == {"flat": 12}  # 2 groups x 2 samples x 3 tokens
    assert st.generated_tokens == st.trained_tokens + 12 + st.in_flight_tokens
    assert buf.groups_in_flight == 0  # discarded groups left the in-flight bound


def test_too_few_informative_groups_means_no_batch_yet() -> None:
    buf = _docs_policy()(alpha=1, batch_size=4, group_size=2)
    _fill(buf, {"g0": [1.0, 0.0], "g1": [1.0, 1.0]})
    assert buf.take_batch() is None
    assert buf.stats().groups_dropped == {"flat": 1}
    _fill(buf, {"g2": [0.0, 1.0]})
    assert {s.group_key for s in buf.take_batch()} == {"g0", "g2"}


@pytest.mark.parametrize(("plan", "error"), [
    (lambda ready: BatchPlan(take=[ready[0].key]), r"take must be \(\) or 2 distinct"),
    (lambda ready: BatchPlan(take=[ready[0].key] * 2), r"take must be \(\) or 2 distinct"),
    (lambda ready: BatchPlan(take=["nope", ready[0].key]), r"take must be"),
    (lambda ready: BatchPlan(discard={"nope": "x"}), r"discard 'nope'"),
    (lambda ready: BatchPlan(discard={ready[0].key: ""}), r"non-empty reason"),
    (lambda ready: BatchPlan(take=[g.key for g in ready[:2]], discard={ready[0].key: "x"}),
     r"not taken"),
])
def test_a_plan_breaking_the_protocol_is_named(plan, error) -> None:
    class Broken(SampleBuffer):
        def assemble_batch(self, ready, need):
            return plan(ready)

    buf = Broken(alpha=1, batch_size=4, group_size=2)
    _fill(buf, {"g0": [1.0, 0.0], "g1": [0.0, 1.0]})
    with pytest.raises(SampleBufferError, match=r"assemble_batch: .*" + error):
        buf.take_batch()


@pytest.mark.looptime
async def test_a_run_trains_only_the_groups_the_policy_takes() -> None:
    policy = _docs_policy()
    answers = itertools.cycle(["ok", "ok", "no"])  # some groups flat, some not
    b = Backends(pools={"p1": [FakeWorker("w1", lambda req: next(answers))],
                        "p2": [FakeWorker("w2", lambda req: next(answers))]},
                 trainer=FakeTrainer(), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=1, latency=lambda i, s: 1.0 + i % 3)],
                 reward_service=FakeReward())
    cluster = Cluster.from_scenario(make_scenario(alpha=1), backends=b, buffer_class=policy)
    async with cluster:
        async def go():
            return [s async for s in cluster.train(steps=3)]

        steps = await asyncio.wait_for(go(), 10_000)
        stats = cluster.controller.buffer.stats()
    assert len(steps) == 3
    for step in steps:
        rewards: dict[str, list[float]] = {}
        for s in step.samples:
            rewards.setdefault(s.group_key, []).append(s.reward)
        assert all(len(set(r)) > 1 for r in rewards.values()), rewards
    assert stats.groups_dropped.get("flat", 0) >= 1
    assert stats.wasted_tokens.get("flat", 0) > 0
