"""Transcripts: decoded per-turn text of sampled trajectories, kept or wasted and why."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.fakes import FakeEnvHost, FakeReward, FakeTrainer, FakeWorker, make_scenario
from rollart.controller import Backends, Cluster
from rollart.controller.buffer.sample import Sample
from rollart.controller.observe.transcripts import TranscriptRecorder
from rollart.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()


def two_turn_sample(sid: str = "g0/0#0", reward: float = 1.0) -> Sample:
    enc = TOKENIZER.encode
    parts = [(enc("Q: 2+2?"), 0, -1), (enc("4"), 1, 2), (enc("wrong, again"), 0, -1),
             (enc("four"), 1, 3)]
    ids, mask, versions = [], [], []
    for toks, m, v in parts:
        ids += toks
        mask += [m] * len(toks)
        versions += [v] * len(toks)
    return Sample(sample_id=sid, group_key=sid.split("/")[0], token_ids=ids, loss_mask=mask,
                  behaviour_logprobs=[0.0] * len(ids), versions=versions, reward=reward,
                  domain="arith", num_turns=2, finish_reason="terminated",
                  metadata={"reward_details": {"parsed": "four"}})


def test_record_splits_turns_into_prompt_delta_response_and_versions(tmp_path) -> None:
    rec = TranscriptRecorder(tmp_path / "t.jsonl", TOKENIZER)
    r = rec.record(7, two_turn_sample(), "wasted", "stale")
    # context_tokens: the planner's measured prompt / observation lengths
    q, obs = len(TOKENIZER.encode("Q: 2+2?")), len(TOKENIZER.encode("wrong, again"))
    assert r["turns"] == [
        {"prompt": "Q: 2+2?", "response": "4", "versions": [2, 2], "num_tokens": 1,
         "context_tokens": q},
        {"prompt": "wrong, again", "response": "four", "versions": [3, 3], "num_tokens": 4,
         "context_tokens": obs},
    ]
    assert (r["step"], r["status"], r["reason"], r["domain"], r["group"]) == (
        7, "wasted", "stale", "arith", "g0")
    assert r["versions"] == [2, 3] and r["reward_details"] == {"parsed": "four"}
    assert r["num_generated"] == 5 and r["finish_reason"] == "terminated"
    assert r["reference"] is None  # the task gave none
    rec.close()


def test_long_texts_are_cut_to_max_chars(tmp_path) -> None:
    rec = TranscriptRecorder(tmp_path / "t.jsonl", TOKENIZER, max_chars=16)
    s = Sample(sample_id="g0/0#0", group_key="g0", token_ids=TOKENIZER.encode("x" * 40 + "y"),
               loss_mask=[0] * 40 + [1], behaviour_logprobs=[0.0] * 41,
               versions=[-1] * 40 + [0], reward=0.0)
    r = rec.record(1, s, "kept", None)
    assert r["turns"][0]["prompt"] == "x" * 16 + "...[cut 24 chars]"
    rec.close()


def test_follows_chosen_samples_to_kept_or_wasted_and_bounds_each_step(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TranscriptRecorder(path, TOKENIZER, per_step=2, rate=1.0)
    a, b, c = (two_turn_sample(f"g{i}/0#0") for i in range(3))
    for s in (a, b, c):
        rec.finished(s)
    rec.dropped(b.sample_id, "unselected")
    assert rec.step(1, [a]).result(timeout=60) == 2
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["sample_id"], r["status"], r["reason"]) for r in rows] == [
        ("g1/0#0", "wasted", "unselected"), ("g0/0#0", "kept", None)]
    # c is still held (fate unknown): nothing to write yet; later it is trained.
    assert rec.step(2, []) is None
    assert rec.step(3, [c]).result(timeout=60) == 1
    rec.close()
    assert json.loads(path.read_text().splitlines()[-1])["step"] == 3


def test_rate_zero_and_max_pending_bound_what_is_followed(tmp_path) -> None:
    rec = TranscriptRecorder(tmp_path / "t.jsonl", TOKENIZER, rate=0.0)
    rec.finished(two_turn_sample())
    assert rec.step(1, [two_turn_sample()]) is None
    rec.close()
    rec = TranscriptRecorder(tmp_path / "u.jsonl", TOKENIZER, rate=1.0, max_pending=2)
    for i in range(5):
        rec.finished(two_turn_sample(f"g{i}/0#0"))
    assert len(rec._pending) == 2
    rec.close()
    with pytest.raises(ValueError):
        TranscriptRecorder(tmp_path / "v.jsonl", TOKENIZER, rate=1.5)


@pytest.mark.looptime
async def test_controller_reports_trained_samples_to_the_recorder(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    from helpers.fakes import TOK

    rec = TranscriptRecorder(path, TOK, per_step=100, rate=1.0)
    env = FakeEnvHost(turns=2)
    b = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                 trainer=FakeTrainer(), tokenizer=TOK, env_hosts=[env],
                 reward_service=FakeReward())
    trained = []
    async with Cluster.from_scenario(make_scenario(redundancy=1), backends=b,
                                     transcripts=rec) as c:
        async def go():
            async for step in c.train(steps=3):
                trained.extend((step.step, s.sample_id) for s in step.samples)

        await asyncio.wait_for(go(), 1000)
    rec.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    kept = {(r["step"], r["sample_id"]) for r in rows if r["status"] == "kept"}
    assert kept == set(trained)  # rate 1: every trained sample, in its step
    assert all(r["turns"] and r["turns"][0]["response"] for r in rows)
    assert {r["reference"] for r in rows} == {"ok"}  # the env's reference answer


def test_every_step_writes_per_step_records_the_first_included(tmp_path) -> None:
    # Seed 0's first 32 draws choose one trajectory at rate 0.25: step 1 wrote 1 record of a
    # 32-sample batch, later steps 8. Every step is topped up from its batch to per_step.
    path = tmp_path / "t.jsonl"
    rec = TranscriptRecorder(path, TOKENIZER, per_step=8, rate=0.25, seed=0)
    for step in (1, 2, 3):
        batch = [two_turn_sample(f"g{step}{i // 4}/{i}#0") for i in range(32)]
        for s in batch:
            rec.finished(s)
        assert rec.step(step, batch).result(timeout=60) == 8
    # a batch smaller than per_step: all of it; a sample is never written twice in a step
    small = [two_turn_sample(f"h0/{i}#0") for i in range(3)]
    rec.finished(small[0])
    assert rec.step(4, small).result(timeout=60) == 3
    rec.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [sum(r["step"] == k for r in rows) for k in (1, 2, 3, 4)] == [8, 8, 8, 3]
    assert all(r["status"] == "kept" for r in rows)
    assert len({(r["step"], r["sample_id"]) for r in rows}) == len(rows)
