"""The majority baseline of a held-out eval set: the accuracy of the best fixed answer.

A *fixed* action sequence ignores every observation: played on each eval task (env seed) by
opening the env, stepping the sequence and scoring the episode with the domain's reward, as a
trajectory is scored (the domain's ``invalid_action`` policy included; ``env_return`` rewards
are summed here, as the reward would). Candidate actions: the ``eval.baseline_candidates``
most frequent answers among the eval set's reference answers (``info["reference"]`` of the
first evaluation's trajectories, played as ``\\boxed{answer}``) and the model's actions of the first evaluation and of the first trained
batch after it (sampled: varied even when the greedy answers are one). Each candidate is first
played repeated on every turn; the longest episode of those (an env ends a single-turn task
after one step) is the horizon, and, above one turn, each position of the best sequence is
then in turn replaced by every other candidate, keeping a change that scores higher (one pass
of coordinate ascent). Cost: ``candidates * size`` episodes, plus ``(horizon - 1) *
(candidates - 1) * size`` for a multi-turn domain, at most ``eval.max_concurrency`` at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import msgspec

from rollart.config import DomainConfig, EvalConfig
from rollart.controller.evaluation.stats import action_key, last_boxed
from rollart.controller.rollout.trajectory import (
    TrajectoryContext,
    TrajectoryFailed,
    _close_session,
    env_failure,
)
from rollart.controller.routing.routers import EnvHostsExhaustedError
from rollart.transport.errors import (
    EnvError,
    InvalidActionError,
    PeerDeadError,
    RemoteError,
    RewardError,
)

log = logging.getLogger(__name__)


class Baseline(msgspec.Struct):
    """A measured baseline: ``accuracy`` of fixed ``actions`` (one per turn) over ``tasks``
    eval tasks that could be played."""

    accuracy: float
    actions: list[str]
    tasks: int


class BaselineSearch:
    """Measures majority baselines (module docstring) through an evaluation's trajectory
    context ``ctx`` (its env and reward routers and run config), ``cfg`` (``[eval]``), at
    most as many episodes at once as ``sem`` lets through."""

    def __init__(self, ctx: TrajectoryContext, cfg: EvalConfig, sem: asyncio.Semaphore) -> None:
        self.ctx, self.run, self.cfg, self._sem = ctx, ctx.run, cfg, sem

    def candidates(self, references: list[Any], actions: list[list[str]]) -> list[str]:
        """The ``eval.baseline_candidates`` most frequent answers among ``references`` (each
        played as ``\\boxed{answer}``) and the model's ``actions`` (per trajectory, per turn;
        a boxed answer is played as ``\\boxed{answer}``, any other as its stripped text)."""
        counts: Counter[str] = Counter()
        text: dict[str, str] = {}
        for ref in references:
            if ref is None:
                continue
            key = " ".join(str(ref).split())
            counts[key] += 1
            text[key] = "\\boxed{" + key + "}"
        for seq in actions:
            for a in seq:
                key = action_key(a)
                counts[key] += 1
                text.setdefault(key, "\\boxed{" + key + "}" if last_boxed(a) is not None else key)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return [text[k] for k, _ in ranked[: self.cfg.baseline_candidates]]

    async def measure(self, dom: DomainConfig, seeds: list[int], actions: list[list[str]],
                      references: list[Any]) -> Baseline | None:
        """The best fixed action sequence of ``dom`` on eval ``seeds`` (module docstring),
        with candidates from the eval tasks' ``references`` (the env's reference answers, as
        the first evaluation's trajectories saw them) and the model's ``actions`` (per
        trajectory, per turn); ``None`` when there is no candidate or no task could be played.

        Raises:
            EnvHostsExhaustedError: fatal; per-task failures are retried, then left out.
        """
        cands = self.candidates(references, actions)
        if not cands:
            return None
        horizon = dom.max_turns or self.run.max_turns
        best: tuple[float, tuple[str, ...], int] | None = None
        turns_used = 1
        for c in cands:
            acc, n, used = await self._score_sequence(dom, seeds, (c,) * horizon)
            turns_used = max(turns_used, used)
            if n and (best is None or acc > best[0]):
                best = (acc, (c,) * horizon, n)
        if best is None:
            return None
        seq = best[1][:turns_used]
        for t in range(1, turns_used) if turns_used > 1 else ():
            for c in cands:
                if c == seq[t]:
                    continue
                trial = (*seq[:t], c, *seq[t + 1:])
                acc, n, _ = await self._score_sequence(dom, seeds, trial)
                if n and acc > best[0]:
                    best, seq = (acc, trial, n), trial
        return Baseline(accuracy=best[0], actions=list(seq), tasks=best[2])

    async def _score_sequence(self, dom: DomainConfig, seeds: list[int], seq: tuple[str, ...]
                              ) -> tuple[float, int, int]:
        """(accuracy, scored tasks, most turns an episode took) of fixed action ``seq``."""
        outs = await asyncio.gather(*(self._play_fixed(dom, s, seq) for s in seeds))
        ok = [o for o in outs if o is not None]
        if not ok:
            return 0.0, 0, 0
        correct = sum(r >= self.cfg.success_threshold for r, _ in ok)
        return correct / len(ok), len(ok), max(t for _, t in ok)

    async def _play_fixed(self, dom: DomainConfig, seed: int, seq: tuple[str, ...]
                          ) -> tuple[float, int] | None:
        """(reward, turns) of playing ``seq`` on ``seed``, scored as a trajectory is;
        ``None`` when the env or the reward failed on every attempt."""
        for _ in range(self.run.retry.max_attempts):
            try:
                async with self._sem:
                    return await self._play_once(dom, seed, seq)
            except (TrajectoryFailed, RewardError) as exc:
                log.info("eval baseline: %s seed %d: %s", dom.name, seed, exc)
        return None

    async def _play_once(self, dom: DomainConfig, seed: int, seq: tuple[str, ...]
                         ) -> tuple[float, int]:
        envs, run = self.ctx.envs, self.run
        try:
            opened = await envs.open(dom.env, seed, dom.env_options, timeout_s=run.env_timeout_s)
        except EnvHostsExhaustedError:
            raise
        except (RemoteError, PeerDeadError) as exc:
            raise env_failure(exc) from exc
        sid = opened.session_id
        try:
            env_return, turn, finish = 0.0, 0, "max_turns"
            for action in seq:
                turn += 1
                try:
                    step = await envs.step(sid, action, timeout_s=run.env_timeout_s)
                except (InvalidActionError, EnvError) as exc:
                    if isinstance(exc, EnvError) and exc.code != "invalid_action":
                        raise env_failure(exc) from exc
                    if dom.invalid_action == "observe":
                        continue
                    # "penalty" scores the penalty; "fail" would re-draw a model's trajectory,
                    # but a fixed sequence would fail again: not correct either way.
                    reward = (dom.invalid_action_penalty if dom.invalid_action == "penalty"
                              else float("-inf"))
                    return reward, turn
                except (RemoteError, PeerDeadError) as exc:
                    raise env_failure(exc) from exc
                env_return += step.reward
                if step.terminated or step.truncated:
                    finish = "terminated" if step.terminated else "env_truncated"
                    break
            if dom.reward == "env_return" and dom.reward_url in ("local", "service"):
                return env_return, turn  # both compute the env's return: no round trip
            metadata = {**opened.info, **dom.reward_metadata, "env_name": dom.env,
                        "seed": seed, "env_return": env_return, "num_turns": turn,
                        "finish_reason": finish, "responses": list(seq[:turn])}
            prompt = dom.prompt_template.format(observation=opened.observation)
            scored = await self.ctx.rewards.score(
                dom.reward, dom.reward_url, prompt, seq[turn - 1],
                opened.info.get("reference"), metadata)
            return float(scored.reward), turn
        finally:
            if envs.is_open(sid):
                await self.ctx.shielded_cleanup(_close_session(envs, sid))
