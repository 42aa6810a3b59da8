"""Held-out evaluation in a run: disjoint eval seeds, the measured majority baseline, pass@k,
the collapse warning; scripted fake workers and in-process envs whose answers are known."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections import Counter

import msgspec
import pytest

from helpers.fakes import TOK, FakeTrainer, FakeWorker
from rollart.config import EvalConfig, parse_scenario
from rollart.controller import Backends, Cluster
from rollart.controller.evaluation.runner import EVAL_SEED_END, TRAIN_SEED_END, eval_seeds
from rollart.controller.evaluation.stats import (
    DomainEval,
    collapse_reason,
    eval_line,
    last_boxed,
    pass_at_k,
    wilson_interval,
)
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb

#: the answer of task ``seed`` of FakeAnswerEnv: "0" is the most frequent (3 in 7)
ANSWERS = ["0", "0", "0", "1", "1", "2", "3"]


def answer_of(seed: int) -> str:
    return ANSWERS[seed % 7]


class FakeAnswerEnv:
    """Single-turn question ``question <seed>``; reward 1 when the last \\boxed{} is the
    answer. Records every seed it is reset with."""

    seen: list[int] = []

    def reset(self, seed: int):
        FakeAnswerEnv.seen.append(seed)
        self.answer = answer_of(seed)
        return f"question {seed}", {"reference": self.answer}

    def step(self, action: str):
        ok = last_boxed(action) == self.answer
        return "", 1.0 if ok else 0.0, True, False, {}


class FakeGuessEnv:
    """Guess a target in 1..5 (``seed % 5 + 1``) within 3 turns: reward 1 and the end on a
    right guess, reward 0 otherwise; the observation says "higher" / "lower"."""

    def reset(self, seed: int):
        self.target, self.turn = seed % 5 + 1, 0
        return "guess 1..5", {}

    def step(self, action: str):
        self.turn += 1
        guess = last_boxed(action)
        if guess == str(self.target):
            return "right", 1.0, True, False, {}
        hint = "higher" if guess is None or not guess.isdigit() or int(guess) < self.target \
            else "lower"
        return hint, 0.0, False, self.turn >= 3, {}


def prompt_text(req: m.Generate) -> str:
    return TOK.decode(tb.view_i32(req.new_token_ids).tolist())


def scenario(env: str, *, max_turns: int = 1, **ev):
    text = f"""
[run]
mode = "rollart"
alpha = 1
batch_size = 4
group_size = 2
max_turns = {max_turns}
max_tokens_per_turn = 32
max_tokens_per_trajectory = 512
seed = 1
[[pools]]
name = "p1"
hardware = "cpu"
[[domains]]
name = "qa"
env = "{env}"
pool = "p1"
reward = "env_return"
reward_url = "local"
"""
    sc = parse_scenario(text, "eval.toml")
    cfg = {"enabled": True, "every": 2, "size": 60, "pass_k": 2, "max_concurrency": 16,
           "collapse_distinct_floor": 0.05, **ev}
    return msgspec.structs.replace(sc, eval=msgspec.convert(cfg, EvalConfig))


def cluster(sc, worker: FakeWorker, env: str, factory, *, trainer: FakeTrainer | None = None,
            resume: dict | None = None) -> Cluster:
    """``sc`` on ``worker``; a resumed run passes the first run's ``trainer`` and snapshot."""
    c = Cluster.from_scenario(sc, backends=Backends(
        pools={"p1": [worker]}, trainer=trainer or FakeTrainer(), tokenizer=TOK), resume=resume)
    c.register_env(env, factory)
    return c


async def train(c: Cluster, n: int) -> list:
    out = []

    async def go() -> None:
        async with c:
            async for step in c.train(steps=n):
                out.append(step)

    await asyncio.wait_for(go(), 600)
    return out


def right_answer(req: m.Generate) -> str:
    seed = int(re.search(r"question (\d+)", prompt_text(req)).group(1))
    return f"\\boxed{{{answer_of(seed)}}}"


# ---------------------------------------------------------------------------- pure parts
def test_eval_seeds_are_fixed_distinct_and_outside_the_training_range() -> None:
    seeds = eval_seeds("letters", 400, 0)
    assert seeds == eval_seeds("letters", 400, 0)  # fixed for the run
    assert len(set(seeds)) == 400
    assert all(TRAIN_SEED_END <= s < EVAL_SEED_END for s in seeds)
    assert seeds != eval_seeds("guess", 400, 0) and seeds != eval_seeds("letters", 400, 1)


def test_wilson_interval_and_default_size_width() -> None:
    lo, hi = wilson_interval(200, 400)
    assert hi - lo < 0.1 and lo < 0.5 < hi  # default size 400: narrower than +-0.05
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    # Wilson (1927) at 8 of 10: 0.4902 .. 0.9433
    lo, hi = wilson_interval(8, 10)
    assert abs(lo - 0.4902) < 1e-3 and abs(hi - 0.9433) < 1e-3
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    # 1 - C(n-c, k) / C(n, k): n=5, c=2, k=2 -> 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="k"):
        pass_at_k(2, 1, 3)


def test_last_boxed_balances_braces() -> None:
    assert last_boxed(r"a \boxed{1} b \boxed{ {2} }") == "{2}"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{open") is None


def test_collapse_rule_below_baseline_needs_rising_train_reward() -> None:
    d = DomainEval(tasks=100, correct=40, accuracy=0.4, ci95=[0.3, 0.5],
                   distinct_answer_share=0.2, majority_baseline=0.58)
    assert collapse_reason(d, 0.01, (0.2, 0.5))["reason"] == "at_or_below_baseline"
    assert collapse_reason(d, 0.01, (0.5, 0.2)) is None  # train reward falling
    assert collapse_reason(d, 0.01, None) is None
    d.accuracy = 0.7
    assert collapse_reason(d, 0.01, (0.2, 0.5)) is None



def test_collapse_rule_ignores_noise_and_a_zero_baseline() -> None:
    d = DomainEval(tasks=400, correct=0, accuracy=0.0, ci95=[0.0, 0.01],
                   distinct_answer_share=0.5, majority_baseline=0.0)
    # nothing learned on a hard task is not a collapse onto an answer
    assert collapse_reason(d, 0.01, (0.010, 0.5)) is None
    d.majority_baseline, d.accuracy = 0.58, 0.58
    assert collapse_reason(d, 0.01, (0.30, 0.31)) is None  # a rise within noise
    assert collapse_reason(d, 0.01, (0.30, 0.33))["reason"] == "at_or_below_baseline"


def test_a_healthy_two_answer_domain_is_not_few_distinct() -> None:
    # yes / no at 90%: 2 distinct answers in 400 tasks is a share of 0.005, below the floor
    d = DomainEval(tasks=400, correct=360, accuracy=0.9, ci95=[0.87, 0.92],
                   distinct_answer_share=2 / 400, top_answer="yes", top_answer_share=0.52,
                   majority_baseline=0.52)
    assert collapse_reason(d, 0.01, (0.5, 0.9)) is None
    d.top_answer_share = 0.95  # one answer on nearly every task
    assert collapse_reason(d, 0.01, None)["reason"] == "few_distinct_answers"


# ---------------------------------------------------------------------------- in a run
async def test_eval_set_is_disjoint_from_training_seeds() -> None:
    FakeAnswerEnv.seen = []
    sc = scenario("answer", size=40, pass_k=0)
    steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer", FakeAnswerEnv),
                        3)
    trained = {s.metadata["seed"] for st in steps for s in st.samples}
    evals = set(eval_seeds("qa", 40, sc.eval.seed))
    assert trained and all(0 <= s < TRAIN_SEED_END for s in trained)
    assert not trained & evals
    assert evals <= set(FakeAnswerEnv.seen)  # the eval set was played
    # every training seed reset is outside the eval set, every eval seed is above 2**31
    assert {s for s in FakeAnswerEnv.seen if s < TRAIN_SEED_END} >= trained


async def test_majority_baseline_is_measured_on_the_eval_set(caplog) -> None:
    sc = scenario("answer", size=60, pass_k=2)
    constant = FakeWorker("w1", lambda req: r"\boxed{3}")
    with caplog.at_level(logging.WARNING, logger="rollart.controller.evaluation.runner"):
        steps = await train(cluster(sc, constant, "answer", FakeAnswerEnv), 2)
    records = [r for st in steps for r in st.metrics.eval]
    assert [r.at_step for r in records] == [0, 2]  # before step 1, and after the last
    seeds = eval_seeds("qa", 60, sc.eval.seed)
    counts = Counter(answer_of(s) for s in seeds)
    best, n_best = counts.most_common(1)[0]
    last = records[-1].domains["qa"]
    assert last.majority_baseline == pytest.approx(n_best / 60)
    assert last.baseline_actions == [f"\\boxed{{{best}}}"]
    assert records[0].domains["qa"].majority_baseline is None  # measured after the first
    # The constant policy answers "3": its accuracy is the share of tasks whose answer is 3.
    assert last.accuracy == pytest.approx(counts["3"] / 60)
    assert last.tasks == 60 and last.failed == 0
    assert last.pass_at_1 == pytest.approx(counts["3"] / 60)
    assert last.distinct_answer_share == pytest.approx(1 / 60)
    # ... and its answers collapsed: the warning names the domain and the numbers
    assert last.collapse is not None and "few_distinct_answers" in last.collapse["reasons"]
    warned = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert warned and "domain qa" in warned[-1] and "0.017" in warned[-1]
    # eval trajectories are never trained: every trained sample is a training seed
    assert all(s.metadata["seed"] < TRAIN_SEED_END for st in steps for s in st.samples)


async def test_no_collapse_warning_for_a_diverse_right_policy(caplog) -> None:
    sc = scenario("answer", size=60, pass_k=2)
    with caplog.at_level(logging.WARNING, logger="rollart.controller.evaluation.runner"):
        steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer",
                                    FakeAnswerEnv), 2)
    last = steps[-1].metrics.eval[-1].domains["qa"]
    assert last.accuracy == 1.0 and last.pass_at_k == 1.0
    assert last.ci95[0] > last.majority_baseline
    assert last.distinct_answer_share == pytest.approx(4 / 60)
    assert last.collapse is None
    assert not [r for r in caplog.records if "collapsed" in r.getMessage()]
    first = steps[0].metrics.eval[0]
    assert eval_line(first).startswith("held-out eval before step 1 (policy versions 0-0")
    assert "qa greedy 1.000 (95% " in eval_line(first) and "pass@2 1.000" in eval_line(first)
    # Wilson at 60 of 60 tasks: [60 / (60 + z^2), 1], never the point [1, 1]
    assert "sampled pass@1 1.000 (95% 0.940-1.000)" in eval_line(first)


async def test_failed_eval_tasks_are_left_out_not_scored_wrong() -> None:
    class Env(FakeAnswerEnv):
        def reset(self, seed: int):
            self.seed = seed
            return super().reset(seed)

        def step(self, action: str):
            if self.answer == "3" and self.seed >= TRAIN_SEED_END:
                raise RuntimeError("env broke")
            return super().step(action)

    sc = scenario("answer", size=60, pass_k=0)
    steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer", Env), 1)
    last = steps[-1].metrics.eval[-1].domains["qa"]
    broken = sum(answer_of(s) == "3" for s in eval_seeds("qa", 60, sc.eval.seed))
    assert broken and last.failed == broken and last.tasks == 60 - broken
    assert last.accuracy == 1.0


@pytest.mark.parametrize("pass_k", [4, 0])
async def test_multi_turn_baseline_is_the_best_fixed_action_sequence(pass_k: int) -> None:
    # pass_k 0: greedy answers are all "1"; the candidates come from the trained batch
    rng = random.Random(0)

    def policy(req: m.Generate) -> str:
        if req.sampling.temperature == 0:
            return r"\boxed{1}"
        return f"\\boxed{{{rng.randint(1, 5)}}}"

    sc = scenario("guess", max_turns=3, size=50, pass_k=pass_k)
    steps = await train(cluster(sc, FakeWorker("w1", policy), "guess", FakeGuessEnv), 1)
    last = steps[-1].metrics.eval[-1].domains["qa"]
    targets = Counter(s % 5 + 1 for s in eval_seeds("qa", 50, sc.eval.seed))
    top3 = sum(n for _, n in targets.most_common(3))
    assert last.majority_baseline == pytest.approx(top3 / 50)
    assert len(last.baseline_actions) == 3 and len(set(last.baseline_actions)) == 3
    # greedy plays 1, 1, 1: right only where the target is 1
    assert last.accuracy == pytest.approx(targets[1] / 50)
    # two action sequences: "1" (target 1: right at once) and "1 | 1 | 1"
    assert last.distinct_answer_share == pytest.approx(2 / 50)
    assert last.top_answer == "1 | 1 | 1"


# ---------------------------------------------------------------------------- run folder
async def test_eval_reaches_metrics_summary_tensorboard_and_report(tmp_path) -> None:
    from rollart.launcher.report import main as report_main
    from rollart.launcher.rundir import RunFolder, read_jsonl

    sc = scenario("answer", size=30, pass_k=2, every=1)
    c = cluster(sc, FakeWorker("w1", right_answer), "answer", FakeAnswerEnv)
    folder = RunFolder(tmp_path, sc)
    c.add_step_hook(folder.on_step)
    await train(c, 3)
    folder.close()

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3 and all(r["response_len_mean_by_domain"]["qa"] > 0 for r in rows)
    at = sorted(e["at_step"] for r in rows for e in r["eval"])
    # before step 1, every step (one still running when the next is due is skipped, with a
    # warning), and after the last
    assert at[:2] == [0, 1] and at[-1] == 3 and set(at) <= {0, 1, 2, 3}
    summary = json.loads((tmp_path / "summary.json").read_text())
    ev = summary["eval"]["qa"]
    assert ev["first"] == 1.0 and ev["last"] == 1.0 and ev["first_step"] == 0
    assert ev["last_step"] == 3 and ev["evals"] == len(at) and ev["k"] == 2
    lo, hi = ev["last_ci95"]
    assert 0 < lo < 1.0 and hi == pytest.approx(1.0)
    counts = Counter(answer_of(s) for s in eval_seeds("qa", 30, sc.eval.seed))
    assert ev["majority_baseline"] == pytest.approx(counts.most_common(1)[0][1] / 30)
    assert ev["distinct_answer_share_last"] == pytest.approx(len(counts) / 30)
    assert ev["pass_at_k_last"] == 1.0 and ev["collapse"] is None

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/qa/accuracy")] == at
    assert "eval/qa/majority_baseline" in acc.Tags()["scalars"]
    assert "response_len/qa" in acc.Tags()["scalars"]

    assert report_main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "eval_qa.png").stat().st_size > 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "eval_qa.png" in page and "Held-out evaluation" in page


def test_summary_without_eval_has_an_empty_block(tmp_path) -> None:
    from rollart.launcher.rundir import eval_summary

    assert eval_summary([{"step": 1, "reward_mean": 0.0}]) == {}


async def test_rollout_during_the_first_eval_is_in_the_token_accounting() -> None:
    # Training waits for the first evaluation while rollout goes on: those tokens belong to
    # step 1's counters (every generated token is trained, wasted, or in flight at the end).
    sc = scenario("answer", size=60, pass_k=2)
    steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer", FakeAnswerEnv),
                        2)
    rows = [st.metrics for st in steps]
    generated = sum(r.buffer_generated_tokens for r in rows)
    assert generated > 0
    assert generated == sum(r.trained_tokens for r in rows) \
        + sum(r.wasted_tokens for r in rows) + rows[-1].in_flight_tokens


async def test_step_rows_count_every_generated_token_once_from_step_1() -> None:
    # Rollout goes on while step 1 waits for the first evaluation: its tokens are step 1's.
    # Eval trajectories never enter the buffer: neither count includes their tokens.
    sc = scenario("answer", size=60, pass_k=2)
    steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer", FakeAnswerEnv),
                        3)
    rows = [st.metrics for st in steps]
    assert rows[0].num_generated_tokens > 0
    assert rows[0].num_generated_tokens == rows[0].buffer_generated_tokens
    assert sum(r.num_generated_tokens for r in rows) \
        == sum(r.buffer_generated_tokens for r in rows)


async def test_a_resumed_runs_step_rows_still_sum_to_its_generated_tokens() -> None:
    sc = scenario("answer", size=20, pass_k=1)
    trainer, worker = FakeTrainer(), FakeWorker("w1", right_answer, latency_s=0.001)

    def make(resume=None) -> Cluster:
        return cluster(sc, worker, "answer", FakeAnswerEnv, trainer=trainer, resume=resume)

    rows: list = []
    c1 = make()
    async with c1:
        async for st in c1.train(steps=2):
            rows.append(st.metrics)
        # rollout goes on after step 2: the checkpoint carries those tokens to step 3 (wait
        # for some, by condition with a generous deadline, not a fixed sleep)
        deadline = asyncio.get_running_loop().time() + 60.0
        while (c1.snapshot()["since_last_step"]["generated_tokens"] == 0  # noqa: ASYNC110 -- a counter, no event to await
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.01)
        snap = msgspec.json.decode(msgspec.json.encode(c1.snapshot()))
    assert snap["since_last_step"]["generated_tokens"] > 0
    rows += [st.metrics for st in await train(make(resume=snap), 2)]
    assert [r.step for r in rows] == [1, 2, 3, 4]
    assert sum(r.num_generated_tokens for r in rows) \
        == sum(r.buffer_generated_tokens for r in rows)
    # the first step after the resume names what the checkpoint carried (its throughput per
    # second leaves them out: they were generated before this process); later steps none
    assert [r.carried_generated_tokens for r in rows] == [
        0, 0, snap["since_last_step"]["generated_tokens"], 0]


async def test_collapse_warning_when_train_reward_rises_but_eval_stays_at_the_baseline(
        caplog) -> None:
    worker = FakeWorker("w1")

    def policy(req: m.Generate) -> str:
        if req.sampling.temperature == 0:
            return r"\boxed{0}"  # greedy: the majority answer, whatever the question
        # sampled (training): wrong under the first weights, right under later ones
        return right_answer(req) if worker.version >= 1 else r"\boxed{9}"

    worker.respond = policy
    sc = scenario("answer", size=60, pass_k=0, collapse_distinct_floor=0.0)
    with caplog.at_level(logging.WARNING, logger="rollart.controller.evaluation.runner"):
        steps = await train(cluster(sc, worker, "answer", FakeAnswerEnv), 4)
    rewards = [st.metrics.reward_mean_by_domain["qa"] for st in steps]
    assert rewards[-1] > rewards[0]
    last = steps[-1].metrics.eval[-1].domains["qa"]
    assert last.accuracy == pytest.approx(last.majority_baseline)
    assert last.collapse["reasons"] == ["at_or_below_baseline"]
    assert last.collapse["train_reward_last"] > last.collapse["train_reward_first"]
    first = steps[0].metrics.eval[0].domains["qa"]
    assert first.collapse is None  # no train reward yet, distinct floor 0
    warned = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    # the evaluations after steps 2 and 4 (every = 2) both say so, with the numbers
    assert len(warned) == 2 and "at_or_below_baseline" in warned[-1]
    assert "majority baseline 0.467" in warned[-1] and "0.000 -> 1.000" in warned[-1]


async def test_an_eval_due_while_the_previous_one_runs_is_skipped(caplog) -> None:
    from types import SimpleNamespace

    from rollart.controller.evaluation.runner import Evaluator

    started = []

    async def evaluate(at_step):
        started.append(at_step)
        await gate.wait()

    gate = asyncio.Event()
    ev = SimpleNamespace(_pending=[], evaluate=evaluate)
    assert Evaluator.launch(ev, 1) is True
    await asyncio.sleep(0)  # let it start
    with caplog.at_level(logging.WARNING):
        assert Evaluator.launch(ev, 2) is False
    assert "skipping the evaluation at step 2" in caplog.text
    gate.set()
    await asyncio.gather(*ev._pending)
    assert Evaluator.launch(ev, 3) is True
    await asyncio.gather(*ev._pending)
    assert started == [1, 3]


def test_share_interval_is_wilson_over_tasks_and_never_a_point() -> None:
    from rollart.controller.evaluation.stats import share_interval

    # 0 of 8 tasks: Wilson's upper bound z^2 / (8 + z^2) = 0.324, as the greedy interval
    assert share_interval([0.0] * 8) == pytest.approx((0.0, 0.324408), abs=1e-6)
    assert share_interval([0.0] * 8) == wilson_interval(0, 8)
    assert share_interval([1.0] * 8) == pytest.approx((0.675592, 1.0), abs=1e-6)
    # one sample per task: exactly Wilson's interval of the correct tasks
    assert share_interval([1.0] * 8 + [0.0] * 2) == pytest.approx(wilson_interval(8, 10))
    # every task alike at 0.5 (hand-computed Wilson at p = 0.5, n = 10): not the point 0.5
    assert share_interval([0.5] * 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    for bad in ([], [1.5], [-0.1]):
        with pytest.raises(ValueError, match="share_interval"):
            share_interval(bad)


async def test_an_all_wrong_sampled_eval_has_a_wilson_interval_in_line_and_summary(
        tmp_path) -> None:
    from rollart.launcher.rundir import RunFolder

    sc = scenario("answer", size=8, pass_k=2, headline="sampled")
    c = cluster(sc, FakeWorker("w1", lambda req: r"\boxed{9}"), "answer", FakeAnswerEnv)
    folder = RunFolder(tmp_path, sc)
    c.add_step_hook(folder.on_step)
    steps = await train(c, 1)
    folder.close()
    last = steps[-1].metrics.eval[-1]
    assert last.domains["qa"].pass_at_1 == 0.0
    assert last.domains["qa"].pass_at_1_ci95 == pytest.approx([0.0, 0.324408], abs=1e-6)
    assert "sampled pass@1 0.000 (95% 0.000-0.324)" in eval_line(last)
    ev = json.loads((tmp_path / "summary.json").read_text())["eval"]["qa"]
    assert ev["headline"] == "sampled" and ev["last"] == 0.0
    assert ev["last_ci95"] == pytest.approx([0.0, 0.324408], abs=1e-6)


def test_the_sampled_headline_judges_the_run_by_pass_at_1() -> None:
    from rollart.config import ConfigError, parse_scenario
    from rollart.launcher.rundir import eval_summary

    def rec(step: int, acc: float, p1: float) -> dict:
        return {"at_step": step, "domains": {"qa": {
            "accuracy": acc, "ci95": [acc - 0.05, acc + 0.05], "pass_k": 4, "pass_at_1": p1,
            "pass_at_1_ci95": [p1 - 0.04, p1 + 0.04], "majority_baseline": 0.3}}}

    rows = [{"step": 1, "eval": [rec(0, 0.10, 0.30)]}, {"step": 2, "eval": [rec(2, 0.12, 0.50)]}]
    greedy = eval_summary(rows)["qa"]
    assert (greedy["first"], greedy["last"]) == (0.10, 0.12)
    assert greedy["last_ci95"] == pytest.approx([0.07, 0.17])
    sampled = eval_summary(rows, "sampled")["qa"]
    assert (sampled["first"], sampled["last"]) == (0.30, 0.50)
    assert sampled["last_ci95"] == pytest.approx([0.46, 0.54]) and sampled["headline"] == "sampled"
    assert (sampled["greedy_first"], sampled["greedy_last"]) == (0.10, 0.12)
    text = ('[[pools]]\nname = "p"\n[[domains]]\nname = "qa"\nenv = "rg:leg_counting"\n'
            'pool = "p"\nreward = "reasoning_gym"\n[eval]\nheadline = "sampled"\n')
    with pytest.raises(ConfigError, match=r"eval\.headline: .*pass_k >= 1"):
        parse_scenario(text + "pass_k = 0\n", "s.toml")
    assert parse_scenario(text + "pass_k = 2\n", "s.toml").eval.headline == "sampled"


async def test_a_resumed_run_keeps_its_baseline_and_skips_the_evaluation_it_has() -> None:
    sc = scenario("answer", size=60, pass_k=2)
    trainer, worker = FakeTrainer(), FakeWorker("w1", lambda req: r"\boxed{3}")

    def make(resume=None) -> Cluster:
        return cluster(sc, worker, "answer", FakeAnswerEnv, trainer=trainer, resume=resume)

    first: list = []
    c1 = make()
    async with c1:
        async for st in c1.train(steps=2):
            first.append(st)
        snap = msgspec.json.decode(msgspec.json.encode(c1.snapshot()))  # JSON round trip
    before = [r for st in first for r in st.metrics.eval]
    assert [r.at_step for r in before] == [0, 2]
    assert snap["eval"]["last_at_step"] == 2 and snap["eval"]["count"] == 2
    assert len(snap["eval"]["train_rewards"]["qa"]) == 2
    baseline = before[-1].domains["qa"].majority_baseline
    assert baseline is not None

    evals = set(eval_seeds("qa", 60, sc.eval.seed))
    FakeAnswerEnv.seen = []
    c2 = make(resume=snap)
    after = await train(c2, 2)
    records = [r for st in after for r in st.metrics.eval]
    # step 2's evaluation is in the run already: only step 4's runs, with the same baseline
    assert [r.at_step for r in records] == [4]
    assert records[0].domains["qa"].majority_baseline == baseline
    assert records[0].domains["qa"].baseline_actions == before[-1].domains["qa"].baseline_actions
    # the baseline was not played again: the eval set was played once, greedy + pass_k each
    assert sum(s in evals for s in FakeAnswerEnv.seen) == 60 * (1 + 2)
    assert c2.evaluator is not None and len(c2.evaluator._train_rewards["qa"]) == 4


async def test_a_resume_from_a_step_without_its_evaluation_evaluates_first() -> None:
    from types import SimpleNamespace

    from rollart.controller.evaluation.runner import Evaluator

    ev = SimpleNamespace(_train_rewards={"qa": []}, domains={"qa": None})
    snap = {"format": 1, "count": 1, "last_at_step": 0, "baselines": None,
            "train_rewards": {"qa": [0.5]}}
    Evaluator.restore(ev, snap, step_index=3)  # the eval after step 3 never finished
    assert ev.has_run is False and ev._count == 1 and ev._train_rewards == {"qa": [0.5]}
    assert not getattr(ev, "_baseline_restored", False)  # none measured: measured again
    with pytest.raises(Exception, match="unknown format 2"):
        Evaluator.restore(ev, {**snap, "format": 2}, step_index=3)


@pytest.mark.parametrize("apply", ["at_batch", "eager"])
async def test_the_last_evaluation_measures_the_policy_the_run_trained(apply) -> None:
    sc = scenario("answer", size=20, pass_k=1)
    sc = msgspec.structs.replace(sc, run=msgspec.structs.replace(sc.run, weight_apply=apply))
    steps = await train(cluster(sc, FakeWorker("w1", right_answer), "answer", FakeAnswerEnv), 2)
    last = steps[-1].metrics.eval[-1]
    assert last.at_step == 2
    # every eval turn was generated by version 2, the trainer's after step 2
    assert (last.version_min, last.version_max) == (2, 2) == (
        steps[-1].metrics.policy_version,) * 2
