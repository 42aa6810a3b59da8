"""Held-out evaluation during a run, through the run's own inference workers.

Eval set: per domain, ``eval.size`` env seeds drawn once (:func:`eval_seeds`, seeded by
``eval.seed`` and the domain's name) from ``[2**31, 2**32)``. Admission draws every training
group's seed below :data:`TRAIN_SEED_END` (``random.randrange(2**31)``), so no eval task has a
training seed; ``2**32`` is numpy's seed limit, which GEM games seed with. Tasks whose env
has a small task space (GuessTheNumber-easy has 10 targets) still repeat training *content*
under other seeds: the guarantee is on seeds, the env's generator decides the rest.

An evaluation plays every task once greedily (temperature 0) and ``eval.pass_k`` times with the
domain's own sampling, as ordinary trajectories of the domain's env and reward
(:func:`~rollart.controller.rollout.trajectory.run_trajectory` with a context of its own: an eval
trajectory never enters the sample buffer, is never trained, and its tokens are not counted
in the step metrics). At most ``eval.max_concurrency`` run at once, beside rollout; a failed
one is retried up to ``run.retry.max_attempts`` times, then left out (never scored as wrong).
A trajectory is *correct* when its reward is at least ``eval.success_threshold``.

Majority baseline (``rollart.controller.evaluation.baseline``, once per run, from the first step
after the first evaluation, in the background): the accuracy on the same eval set of the best fixed action sequence, one that
ignores every observation, measured by playing it in the env and scoring it with the domain's
reward (for a single-turn domain: the best constant answer); later records carry it.

Collapse (``rollart.controller.evaluation.stats.collapse_reason``): distinct greedy answers per task
below ``eval.collapse_distinct_floor``, or accuracy at or below the majority baseline while the
domain's train reward rises; each evaluation logs a WARNING naming the domain and numbers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from rollart.config import DomainConfig, EvalConfig, SamplingConfig
from rollart.controller.buffer.sample import Sample
from rollart.controller.evaluation.baseline import Baseline, BaselineSearch
from rollart.controller.evaluation.stats import (
    DomainEval,
    EvalRecord,
    answer_key,
    collapse_reason,
    pass_at_k,
    reward_trend,
    share_interval,
    wilson_interval,
)
from rollart.controller.rollout.trajectory import (
    TrajectoryContext,
    TrajectoryFailed,
    run_trajectory,
)
from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.controller import Controller
    from rollart.controller.observe.metrics import StepMetrics

log = logging.getLogger(__name__)

#: training group seeds are drawn below this (``rollart.controller.rollout.admission``)
TRAIN_SEED_END = 2**31
#: eval seeds are below this (numpy's, and so GEM's, seed limit)
EVAL_SEED_END = 2**32


def eval_seeds(domain: str, size: int, seed: int) -> list[int]:
    """``size`` distinct env seeds of ``domain``'s eval set, in ``[2**31, 2**32)`` (disjoint from
    every training seed), the same for the same ``(domain, size, seed)`` on every machine."""
    rng = random.Random(f"rollart-eval:{seed}:{domain}")
    return rng.sample(range(TRAIN_SEED_END, EVAL_SEED_END), size)


class _EvalTurns:
    """Stands in for the sample buffer in an eval trajectory: every turn goes on, nothing is
    recorded (an eval trajectory is not a group member and is never trained)."""

    def begin_turn(self, traj_id: str, serving_version: int) -> str:
        return "continue"

    def record_tokens(self, traj_id: str, versions: Any) -> None:
        return None


async def _never_waits(version: int) -> None:
    raise AssertionError("an eval trajectory never waits for weights")


def sample_actions(sample: Sample, decode: Any) -> list[str]:
    """The action text of each turn of ``sample``: its generated tokens (loss mask 1) in runs,
    each decoded with ``decode`` (``ChatTokens.decode``, as the trajectory decoded them)."""
    mask = np.frombuffer(sample.loss_mask, dtype=np.int8) != 0
    ids = np.frombuffer(sample.token_ids, dtype=np.int32)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class _Task(msgspec.Struct):
    reward: float
    correct: bool
    actions: list[str]
    num_generated: int
    num_turns: int
    versions: tuple[int, int] | None
    #: the env's reference answer of the task (``None``: it gives none)
    reference: Any = None


class Evaluator:
    """Evaluates a started controller's policy on held-out eval sets (module docstring).

    Args:
        controller: a started :class:`~rollart.controller.controller.Controller` (its proxy,
            env and reward routers, tokenizer chats, run config and clock are used).
        cfg: the scenario's ``[eval]`` (default: ``controller.scenario.eval``).
    """

    def __init__(self, controller: Controller, cfg: EvalConfig | None = None) -> None:
        self.c = controller
        self.cfg = cfg or controller.scenario.eval
        self.domains: dict[str, DomainConfig] = dict(controller.domains)
        #: domain -> its eval seeds (fixed for the run)
        self.seeds = {d: eval_seeds(d, self.cfg.size, self.cfg.seed) for d in self.domains}
        self.ctx = TrajectoryContext(
            run=controller.run, proxy=controller.proxy, envs=controller.envs,
            rewards=controller.rewards, chat=controller.chats, buffer=_EvalTurns(),
            clock=controller.clock, wait_for_weights=_never_waits, barrier=None)
        self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        self._count = 0
        self._train_rewards: dict[str, list[float]] = {d: [] for d in self.domains}
        #: domain -> majority baseline, once measured
        self.baselines: dict[str, Baseline | None] = {}
        self._first_actions: dict[str, list[list[str]]] | None = None
        #: domain -> the eval tasks' reference answers (from the first evaluation)
        self._references: dict[str, list[Any]] = {}
        self._baseline_task: asyncio.Task[None] | None = None
        self._pending: list[asyncio.Task[EvalRecord]] = []
        self.has_run = False
        #: the baselines came from a checkpoint (:meth:`restore`): never measured again
        self._baseline_restored = False
        #: ``at_step`` of the newest evaluation whose record was handed out
        self._last_at_step: int | None = None

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for checkpoint/resume: the number of evaluations started, the
        ``at_step`` of the newest one whose record was handed out (``take_finished`` /
        ``finish``), the majority baselines (``None`` until every domain's is measured) and
        the train rewards the collapse rule's trend reads."""
        task = self._baseline_task
        measured = self._baseline_restored or (
            task is not None and task.done() and not task.cancelled()
            and task.exception() is None)
        return {
            "format": 1,
            "count": self._count,
            "last_at_step": self._last_at_step,
            "baselines": ({name: None if b is None else msgspec.to_builtins(b)
                           for name, b in self.baselines.items()} if measured else None),
            "train_rewards": {d: list(r) for d, r in self._train_rewards.items()},
        }

    def restore(self, snap: dict[str, Any], step_index: int) -> None:
        """Continue from ``snap`` (a :meth:`snapshot`) with the controller at ``step_index``:
        the baselines are kept (the eval set is the same: its seeds depend only on
        ``[eval]`` and the domain's name), and the evaluation before the first step is
        skipped when the checkpoint's newest evaluation was at this step (its record is in
        the run folder already).

        Raises:
            RollartError: an unknown format.
        """
        if snap.get("format") != 1:
            raise RollartError(f"evaluation snapshot: unknown format {snap.get('format')!r}")
        self._count = int(snap.get("count", 0))
        self._last_at_step = snap.get("last_at_step")
        self.has_run = self._last_at_step == step_index
        for d, rewards in (snap.get("train_rewards") or {}).items():
            if d in self._train_rewards:
                self._train_rewards[d] = [float(r) for r in rewards]
        baselines = snap.get("baselines")
        if baselines is not None and set(baselines) >= set(self.domains):
            self.baselines = {d: None if baselines[d] is None
                              else msgspec.convert(baselines[d], Baseline)
                              for d in self.domains}
            self._baseline_restored = True

    # ------------------------------------------------------------------ schedule
    def observe_step(self, metrics: StepMetrics, samples: Sequence[Sample] = ()) -> None:
        """Record a finished step's train reward per domain (the collapse rule's trend). The
        first step after the first evaluation also starts measuring the majority baseline,
        with the actions of its trained ``samples`` among the candidates (sampled at the
        domain's temperature: varied even where the greedy answers are not)."""
        for d, r in metrics.reward_mean_by_domain.items():
            self._train_rewards.setdefault(d, []).append(r)
        if (self._baseline_task is None and self._first_actions is not None
                and not self._baseline_restored):
            for s in samples:
                if s.domain in self._first_actions:
                    self._first_actions[s.domain].append(
                        sample_actions(s, self.c.chats[s.domain].decode))
            self._start_baseline()

    def _start_baseline(self) -> None:
        if (self._baseline_task is None and self._first_actions is not None
                and not self._baseline_restored):
            self._baseline_task = asyncio.create_task(self.measure_baseline(), name="baseline")
            self._baseline_task.add_done_callback(_log_failure)

    def launch(self, at_step: int) -> bool:
        """Start an evaluation in the background (:meth:`take_finished` collects it), unless
        one still runs: evaluations slower than ``eval.every`` steps would otherwise pile up
        and compete with rollout for the workers. Returns whether one was started."""
        if any(not t.done() for t in self._pending):
            log.warning("eval: skipping the evaluation at step %d: the previous one still "
                        "runs (raise eval.every, or lower eval.size / eval.pass_k)", at_step)
            return False
        self._pending.append(asyncio.create_task(self.evaluate(at_step), name=f"eval@{at_step}"))
        return True

    def take_finished(self) -> list[EvalRecord]:
        """Records of background evaluations that ended, in launch order.

        Raises:
            the error of one that failed (a fatal error: a pool or the env hosts gone, a bug).
        """
        done = [t for t in self._pending if t.done()]
        self._pending = [t for t in self._pending if not t.done()]
        records = [t.result() for t in done]
        self._handed_out(records)
        return records

    def _handed_out(self, records: list[EvalRecord]) -> None:
        if records:
            self._last_at_step = max(r.at_step for r in records)

    async def finish_pending(self) -> None:
        """Wait for the background evaluations (their records stay for :meth:`take_finished`).

        Raises:
            the first error of one that failed.
        """
        if self._pending:
            await asyncio.gather(*self._pending)

    async def finish(self, at_step: int) -> list[EvalRecord]:
        """The end of a run: wait for background evaluations, then evaluate at ``at_step``
        (after the majority baseline); returns every record not yet taken."""
        await self.finish_pending()
        records = self.take_finished()
        records.append(await self.evaluate(at_step))
        self._handed_out(records)
        return records

    async def close(self) -> None:
        """Cancel running evaluations and wait for their env sessions to close."""
        tasks = [*self._pending, *([self._baseline_task] if self._baseline_task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending = []
        if self.ctx.closing:
            await asyncio.wait(list(self.ctx.closing))

    # ------------------------------------------------------------------ one evaluation
    async def evaluate(self, at_step: int) -> EvalRecord:
        """Evaluate every domain now (greedy and ``pass_k`` sampled per task); a call after
        the first waits for the majority baseline (started by :meth:`observe_step`, or here).

        Raises:
            PoolExhaustedError, EnvHostsExhaustedError: fatal for the run.
        """
        n = self._count
        self._count += 1
        self.has_run = True
        t0 = time.monotonic()
        jobs = []
        for name, dom in self.domains.items():
            greedy = msgspec.structs.replace(
                dom, sampling=SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1))
            for i, seed in enumerate(self.seeds[name]):
                jobs.append((name, i, -1, self._run_task(greedy, seed, f"eval{n}/{name}/{i}/g")))
                for j in range(self.cfg.pass_k):
                    jobs.append((name, i, j,
                                 self._run_task(dom, seed, f"eval{n}/{name}/{i}/s{j}")))
        results = await asyncio.gather(*(job[3] for job in jobs))
        per: dict[str, dict[int, dict[int, _Task | None]]] = {d: {} for d in self.domains}
        for (name, i, j, _), res in zip(jobs, results, strict=True):
            per[name].setdefault(i, {})[j] = res
        if self._baseline_restored:
            pass
        elif self._first_actions is None:
            self._first_actions = {
                name: [r.actions for task in tasks.values() for r in task.values() if r]
                for name, tasks in per.items()}
            # one reference per task, from whichever of its trajectories finished
            self._references = {
                name: [next((r.reference for r in task.values() if r), None)
                       for task in tasks.values()]
                for name, tasks in per.items()}
        else:
            self._start_baseline()
            assert self._baseline_task is not None
            await self._baseline_task
        versions = [r.versions for tasks in per.values() for task in tasks.values()
                    for r in task.values() if r is not None and r.versions is not None]
        record = EvalRecord(
            at_step=at_step,
            version_min=min((v[0] for v in versions), default=None),
            version_max=max((v[1] for v in versions), default=None),
            wall_s=round(time.monotonic() - t0, 3),
            domains={name: self._domain_result(name, tasks) for name, tasks in per.items()})
        return record

    def _domain_result(self, name: str, tasks: dict[int, dict[int, _Task | None]]) -> DomainEval:
        greedy = [t[-1] for t in tasks.values() if t.get(-1) is not None]
        n, k = len(greedy), self.cfg.pass_k
        correct = sum(r.correct for r in greedy if r)
        keys = Counter(answer_key(r.actions) for r in greedy if r)
        top = keys.most_common(1)[0] if keys else None
        p1 = pk = p1_ci = None
        if k:
            full = [[t[j] for j in range(k)] for t in tasks.values()
                    if all(t.get(j) is not None for j in range(k))]
            if full:
                cs = [sum(r.correct for r in s if r) for s in full]
                p1 = sum(pass_at_k(k, c, 1) for c in cs) / len(cs)
                pk = sum(pass_at_k(k, c, k) for c in cs) / len(cs)
                lo, hi = share_interval([c / k for c in cs])
                p1_ci = [round(lo, 6), round(hi, 6)]
        base = self.baselines.get(name)
        ci = wilson_interval(correct, n) if n else None
        d = DomainEval(
            tasks=n, correct=correct, accuracy=correct / n if n else None,
            ci95=[round(ci[0], 6), round(ci[1], 6)] if ci else None,
            failed=len(tasks) - n,
            reward_mean=sum(r.reward for r in greedy if r) / n if n else None,
            response_len_mean=sum(r.num_generated for r in greedy if r) / n if n else None,
            pass_k=k, pass_at_1=p1, pass_at_k=pk, pass_at_1_ci95=p1_ci,
            distinct_answer_share=len(keys) / n if n else None,
            top_answer=top[0][:200] if top else None,
            top_answer_share=top[1] / n if top else None,
            majority_baseline=base.accuracy if base else None,
            baseline_actions=base.actions if base else None)
        trend = reward_trend(self._train_rewards.get(name, []))
        d.collapse = collapse_reason(d, self.cfg.collapse_distinct_floor, trend,
                                     self.cfg.headline)
        if d.collapse is not None:
            log.warning("eval: domain %s looks collapsed (%s): accuracy %s, distinct answer "
                        "share %s (floor %s), top answer %r on %s of tasks, majority baseline "
                        "%s, train reward %s", name, ", ".join(d.collapse["reasons"]),
                        _fmt(d.accuracy), _fmt(d.distinct_answer_share),
                        self.cfg.collapse_distinct_floor, d.top_answer,
                        _fmt(d.top_answer_share), _fmt(d.majority_baseline),
                        "n/a" if trend is None else f"{trend[0]:.3f} -> {trend[1]:.3f}")
        return d

    async def _run_task(self, domain: DomainConfig, seed: int, tid: str) -> _Task | None:
        """One eval trajectory (retried after a failure), or ``None`` if every attempt failed."""
        agents = self.c.agents
        body = agents.body_for(domain.name) if agents is not None else None
        for attempt in range(self.c.run.retry.max_attempts):
            async with self._sem:
                try:
                    sample = await run_trajectory(self.ctx, f"{tid}/a{attempt}", "eval", domain,
                                                  seed, body)
                except TrajectoryFailed as exc:
                    log.info("eval trajectory %s/a%d failed: %s", tid, attempt, exc)
                    continue
            v = sample.versions
            return _Task(
                reward=sample.reward, correct=sample.reward >= self.cfg.success_threshold,
                actions=sample_actions(sample, self.c.chats[domain.name].decode),
                num_generated=sample.num_generated, num_turns=sample.num_turns,
                versions=(min(v), max(v)) if len(v) else None,
                reference=sample.metadata.get("reference"))
        return None

    # ------------------------------------------------------------------ majority baseline
    async def measure_baseline(self) -> None:
        """Measure every domain's majority baseline (module docstring) into ``baselines``."""
        assert self._first_actions is not None
        search = BaselineSearch(self.ctx, self.cfg, self._sem)
        for name, dom in self.domains.items():
            self.baselines[name] = await search.measure(
                dom, self.seeds[name], self._first_actions[name], self._references.get(name, []))
            b = self.baselines[name]
            if b is not None:
                log.info("eval: domain %s majority baseline %.3f (fixed actions %s, %d tasks)",
                         name, b.accuracy, b.actions, b.tasks)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _log_failure(task: asyncio.Task[Any]) -> None:
    # A run that stops before a later evaluation awaits the baseline would never show its error.
    if not task.cancelled() and task.exception() is not None:
        log.error("eval: measuring the majority baseline failed: %r", task.exception())
