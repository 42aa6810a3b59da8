"""One coroutine per trajectory: env session -> turns (check, generate, env step) -> reward.

:func:`run_trajectory` returns a token-exact :class:`~rollart.controller.buffer.sample.Sample` or raises
one of three per-trajectory outcomes the controller turns into buffer calls:

- :class:`TrajectoryFailed` (``reason``: ``env_error``, ``env_timeout``, ``env_not_found``,
  ``env_host_lost``, ``generation_error``, ``generation_timeout``, ``generation_aborted``,
  ``invalid_worker_output`` (the reply broke the ``GenerateResult`` contract, see
  ``rollart.controller.routing.workercheck``), ``reward_error``, ``reward_too_large``,
  ``prompt_too_long``, ``trajectory_timeout`` (``run.trajectory_timeout_s``),
  ``invalid_action`` (only under the domain's ``invalid_action = "fail"``); agent trajectories
  (``rollart.controller.agents``) add ``agent_error`` and ``history_rewritten``): never a
  reward of 0; the buffer may retry the slot;
- :class:`TrajectoryStale`: the per-turn staleness check said restart;
- :class:`TrajectoryNotNeeded`: the buffer said the group no longer needs it.

Fatal errors (a pool or every env host gone, a bug) propagate unchanged. Cancellation (redundant
member, shutdown) cancels the pending generate call, which aborts it on the worker, and the env
session is closed in a shielded ``finally`` so cleanup runs even while being cancelled.

Limits: ``max_turns`` assistant turns, ``max_tokens_per_turn`` generated tokens per turn,
``max_tokens_per_trajectory`` tokens in the whole training sequence. ``finish_reason`` of the
sample: ``terminated`` / ``env_truncated`` (the env ended it), ``length`` (the engine reported
``finish_reason="length"`` on a turn: the env still scores that truncated action, then the
trajectory ends), ``max_tokens`` (the sequence budget ran out), ``max_turns``,
``invalid_action`` (the env rejected an action under ``invalid_action = "penalty"``).

Invalid actions (the multi-turn reward contract): an env rejects a malformed action by raising
``InvalidActionError`` (an env host replies ``invalid_action``). That is the model's doing, not
an env failure, so the trajectory is *not* re-drawn: under the domain's ``invalid_action =
"observe"`` the error message is the turn's observation (step reward 0; the episode goes on and
the reward function scores it as usual); under ``"penalty"`` the trajectory ends and its reward
is ``invalid_action_penalty`` (the reward function is not called). Either way it is trained on
and counted (``TrajectoryContext.invalid_actions``, ``metadata["num_invalid_actions"]``).
"""

from __future__ import annotations

import array
import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollart.config import DomainConfig, RunConfig
from rollart.controller.buffer.sample import Sample
from rollart.controller.modes import TurnBarrier
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvHostsExhaustedError, EnvRouter, RewardRouter
from rollart.controller.routing.workercheck import INVALID_OUTPUT_REASON, InvalidWorkerOutput
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import (
    EnvError,
    InvalidActionError,
    PeerDeadError,
    RemoteError,
    RemoteTimeoutError,
    RewardError,
    RewardTooLargeError,
)

log = logging.getLogger(__name__)

#: seconds allowed for closing an env session during cleanup
CLOSE_TIMEOUT_S = 10.0
#: one prompt token's loss mask (repeated for a whole prompt)
_ZERO_MASK = array.array("b", [0])


class TrajectoryFailed(Exception):
    """Per-trajectory failure with a machine-readable ``reason`` and a human ``detail``."""

    def __init__(self, reason: str, detail: str, num_generated: int = 0) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.num_generated = num_generated


class TrajectoryStale(Exception):
    """The buffer's staleness check said ``restart``: abort and start a fresh attempt."""


class TrajectoryNotNeeded(Exception):
    """The buffer said ``cancel``: the group has enough members (or was retired)."""


@dataclass(slots=True)
class Activity:
    """What a running trajectory is doing (``phase``: ``env open``, ``generating turn 2``,
    ``env step 2``, ``reward``, ``waiting for weights``) since ``since`` (controller clock, s)."""

    group_key: str
    phase: str
    since: float
    num_generated: int = 0
    num_invalid_actions: int = 0
    #: the trajectory's ``run.trajectory_timeout_s`` deadline while it runs under one
    deadline: asyncio.Timeout | None = None

    def enter(self, phase: str, now: float) -> None:
        self.phase, self.since = phase, now


async def admit_first_turn(ctx: TrajectoryContext, act: Activity, traj_id: str, domain: str,
                           num_prompt_tokens: int = 0) -> None:
    """Wait until ``traj_id``'s first turn may start on its pool (the KV working-set hold,
    ``LLMProxy.admit``; at once without it). The wait does not count towards
    ``run.trajectory_timeout_s``: the deadline moves by the seconds waited. A trajectory that
    has not started is not stuck, and failing it would open its env again for nothing;
    ``run.group_timeout_s`` still bounds its group."""
    if ctx.proxy.try_admit(traj_id, domain, num_prompt_tokens):
        return  # the common case: no wait, and no timer rescheduled per trajectory
    act.enter("waiting for KV room", ctx.clock())  # the stall report's label
    deadline = act.deadline
    when = deadline.when() if deadline is not None and not deadline.expired() else None
    if deadline is None or when is None:
        await ctx.proxy.admit(traj_id, domain, num_prompt_tokens)
        return
    # The deadline runs on the event loop's clock, which ``ctx.clock`` may not be.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline.reschedule(None)  # stopped while it waits
    try:
        await ctx.proxy.admit(traj_id, domain, num_prompt_tokens)
    finally:
        deadline.reschedule(when + (loop.time() - t0))


@dataclass
class TrajectoryContext:
    """Everything a trajectory coroutine uses; one per controller.

    ``buffer`` is the ``SampleBuffer`` (begin_turn / record_tokens); ``wait_for_weights(v)``
    returns once the workers serve a version newer than ``v`` (used on a ``wait`` verdict);
    ``barrier`` is set in ``sync`` mode; ``clock`` is the event loop's monotonic time (seconds).
    """

    run: RunConfig
    proxy: LLMProxy
    envs: EnvRouter
    rewards: RewardRouter
    chat: dict[str, ChatTokens]
    buffer: Any
    clock: Callable[[], float]
    wait_for_weights: Callable[[int], Awaitable[None]]
    barrier: TurnBarrier | None = None
    generated_tokens: int = 0
    env_steps: int = 0
    #: env steps the env rejected as invalid actions (model-caused; trained on)
    invalid_actions: int = 0
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    #: trajectory id -> what it is doing now (running trajectories only)
    activity: dict[str, Activity] = field(default_factory=dict)
    #: env-session closes still running: shielded, they outlive a trajectory cancelled while
    #: it closes, so ``Controller.close`` waits for them before its owner closes the clients
    closing: set[asyncio.Task[None]] = field(default_factory=set)

    async def shielded_cleanup(self, cleanup: Awaitable[None]) -> None:
        """Await a trajectory's cleanup (closing its env session, ...) so that cancelling the
        trajectory does not cut it off, and ``Controller.close`` still waits for it."""
        task = asyncio.ensure_future(cleanup)
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)
        await asyncio.shield(task)


def env_failure(exc: BaseException, num_generated: int = 0) -> TrajectoryFailed:
    if isinstance(exc, RemoteTimeoutError):
        return TrajectoryFailed("env_timeout", str(exc), num_generated)
    if isinstance(exc, EnvError):
        reason = {"env_timeout": "env_timeout", "not_found": "env_not_found"}.get(
            exc.code, "env_error"
        )
        return TrajectoryFailed(reason, str(exc), num_generated)
    if isinstance(exc, RemoteError):
        return TrajectoryFailed("env_error", str(exc), num_generated)
    return TrajectoryFailed("env_host_lost", f"{type(exc).__name__}: {exc}", num_generated)


async def _close_session(envs: EnvRouter, session_id: str) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await envs.close_session(session_id)
    except Exception as exc:  # cleanup must not mask the trajectory's own outcome
        log.warning("closing env session %s failed: %s: %s", session_id, type(exc).__name__, exc)


#: a trajectory body: ``await body(ctx, traj_id, group_key, domain, seed, activity)``
TrajectoryBody = Callable[
    [TrajectoryContext, str, str, DomainConfig, int, Activity], Awaitable[Sample]]


async def run_trajectory(
    ctx: TrajectoryContext, traj_id: str, group_key: str, domain: DomainConfig, seed: int,
    body: TrajectoryBody | None = None,
) -> Sample:
    """Run trajectory ``traj_id`` of ``domain`` with env ``seed`` to a scored sample, within
    ``run.trajectory_timeout_s`` (wall clock, less the seconds its first turn waited for KV room:
    :func:`admit_first_turn`) when set. While it runs, ``ctx.activity[traj_id]``
    says what it is doing and since when (the stall watchdog reads it). ``body``: what runs the
    trajectory (default: the gym loop below; agent domains pass
    ``rollart.controller.agents.runner.AgentRunner``'s), under the same timeout and record.

    Raises:
        TrajectoryFailed, TrajectoryStale, TrajectoryNotNeeded: see the module docstring.
        PoolExhaustedError, EnvHostsExhaustedError: fatal.
    """
    act = ctx.activity[traj_id] = Activity(group_key, "starting", ctx.clock())
    timeout_s = ctx.run.trajectory_timeout_s
    body = body or _run_trajectory
    try:
        if timeout_s is None:
            return await body(ctx, traj_id, group_key, domain, seed, act)
        deadline = act.deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                return await body(ctx, traj_id, group_key, domain, seed, act)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise TrajectoryFailed(
                "trajectory_timeout",
                f"{traj_id} ran longer than run.trajectory_timeout_s = {timeout_s:g} s "
                f"(it was {act.phase} since {ctx.clock() - act.since:.1f} s)",
                act.num_generated,
            ) from None
    finally:
        ctx.activity.pop(traj_id, None)


def _filled(item: array.array, n: int) -> array.array:
    """``n`` copies of the one-item array ``item``, with room for ``n / 16`` more items: a
    repeat of one item needs no temporary bytes of the prompt's size to copy from, and the
    headroom (what ``frombytes`` would leave) keeps the turns' appends from reallocating, and
    so copying, the whole prompt's array."""
    out = item * (n + (n >> 4) + 16)
    del out[n:]  # shrinks in place to n + n / 16 + 7 items allocated (CPython's array_resize)
    return out


def _as_i32(buf: Any) -> memoryview:
    """A reply's int32 field (bytes or any contiguous buffer) as an int32 memoryview, no copy."""
    return memoryview(buf).cast("B").cast("i")


def _prompt_i32(chat: ChatTokens, system_prompt: str | None, prompt_text: str) -> bytes:
    """The opening messages' chat-template tokens (int32 bytes); the message list is not kept
    alive for the trajectory's lifetime."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": prompt_text})
    return chat.prompt_i32(messages)


async def _run_trajectory(
    ctx: TrajectoryContext, traj_id: str, group_key: str, domain: DomainConfig, seed: int,
    act: Activity,
) -> Sample:
    run, envs, chat = ctx.run, ctx.envs, ctx.chat[domain.name]
    t_start = ctx.clock()
    session_id: str | None = None
    # The training sequence grows in place, turn by turn, as compact arrays: ids and loss mask
    # per token (5 bytes), logprobs and versions per generated token only (a bytearray each:
    # not tracked by the garbage collector), which is also how the Sample keeps them; a turn's
    # tokens are appended from the reply's bytes with one memcpy each.
    token_ids = array.array("i")
    gen_logprobs = bytearray()
    gen_versions = bytearray()
    turn_workers: list[str] = []  # the worker that served each turn (engine/trainer checks)
    num_generated = 0
    turns_ended = False  # its footprint is a final one (the KV working set's domain means)
    if ctx.barrier is not None:
        ctx.barrier.join(traj_id)
    try:
        act.enter("env open", ctx.clock())
        try:
            opened = await envs.open(domain.env, seed, domain.env_options,
                                     timeout_s=run.env_timeout_s)
        except EnvHostsExhaustedError:
            raise
        except (RemoteError, PeerDeadError) as exc:
            raise env_failure(exc) from exc
        except InvalidActionError as exc:  # there is no action at reset: the env's fault
            raise TrajectoryFailed("env_error", f"reset raised {exc!r}") from exc
        session_id = opened.session_id
        prompt_text = domain.prompt_template.format(observation=opened.observation)
        token_ids.frombytes(_prompt_i32(chat, domain.system_prompt, prompt_text))
        num_prompt = len(token_ids)
        loss_mask = _filled(_ZERO_MASK, num_prompt)
        sampling = domain.sampling
        max_turns = domain.max_turns or run.max_turns
        env_return = 0.0
        penalty: float | None = None
        responses: list[str] = []
        finish = "max_turns"
        turn = 0
        params: m.SamplingParams | None = None
        while turn < max_turns:
            verdict = ctx.buffer.begin_turn(traj_id, ctx.proxy.version)
            if verdict == "restart":
                raise TrajectoryStale(traj_id)
            if verdict == "cancel":
                raise TrajectoryNotNeeded(traj_id)
            if verdict == "wait":
                act.enter("waiting for weights", ctx.clock())
                await ctx.wait_for_weights(ctx.proxy.version)
                continue
            budget = run.max_tokens_per_trajectory - len(token_ids)
            if budget <= 0 and num_generated == 0:
                raise TrajectoryFailed(
                    "prompt_too_long",
                    f"prompt of {len(token_ids)} tokens leaves no room under "
                    f"run.max_tokens_per_trajectory = {run.max_tokens_per_trajectory}",
                )
            if budget <= 0:
                finish = "max_tokens"
                break
            max_new = min(run.max_tokens_per_turn, budget)
            if ctx.barrier is not None:
                await ctx.barrier.wait(traj_id)
            if params is None or params.max_tokens != max_new:  # the same on most turns
                params = m.SamplingParams(
                    max_tokens=max_new,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                )
            if turn == 0:
                await admit_first_turn(ctx, act, traj_id, domain.name, len(token_ids))
            act.enter(f"generating turn {turn}", ctx.clock())
            try:
                result = await ctx.proxy.generate(
                    traj_id, domain.name, f"{traj_id}/t{turn}", token_ids, params,
                    timeout_s=run.generate_timeout_s,
                )
            except RemoteTimeoutError as exc:
                raise TrajectoryFailed("generation_timeout", str(exc), num_generated) from exc
            except InvalidWorkerOutput as exc:
                raise TrajectoryFailed(INVALID_OUTPUT_REASON, str(exc), num_generated) from exc
            except RemoteError as exc:
                raise TrajectoryFailed("generation_error", str(exc), num_generated) from exc
            # The proxy checked the reply (lengths, versions, logprobs, token ids).
            n = result.num_tokens
            turn_workers.append(ctx.proxy.served_by(traj_id) or "")
            # Straight from the reply's bytes (whole int32 / float32 items: the proxy checked
            # the lengths); no per-turn array copies are kept across the env step below.
            token_ids.frombytes(result.token_ids)
            loss_mask.frombytes(b"\x01" * n)
            gen_logprobs += result.logprobs
            gen_versions += result.versions
            num_generated += n
            act.num_generated = num_generated
            ctx.generated_tokens += n
            ctx.buffer.record_tokens(traj_id, tb.to_array(result.versions, "i"))  # transient
            if result.finish_reason == "abort":
                raise TrajectoryFailed(
                    "generation_aborted", f"worker aborted turn {turn}", num_generated
                )
            action = chat.decode(_as_i32(result.token_ids))
            responses.append(action)
            turn += 1
            act.enter(f"env step {turn - 1}", ctx.clock())  # turn counts the action just taken
            invalid: str | None = None
            try:
                step = await envs.step(session_id, action, timeout_s=run.env_timeout_s)
            except InvalidActionError as exc:  # in-process env
                invalid = exc.message
            except EnvError as exc:
                if exc.code != "invalid_action":
                    raise env_failure(exc, num_generated) from exc
                invalid = exc.message
            except (RemoteError, PeerDeadError) as exc:
                raise env_failure(exc, num_generated) from exc
            ctx.env_steps += 1
            if invalid is not None:
                # The model's action was malformed: its fault, not the env's. Train on it.
                ctx.invalid_actions += 1
                act.num_invalid_actions += 1
                if domain.invalid_action == "fail":
                    raise TrajectoryFailed("invalid_action", invalid, num_generated)
                if domain.invalid_action == "penalty":
                    finish = "invalid_action"
                    penalty = domain.invalid_action_penalty
                    break
                step = m.EnvStepResult(session_id=session_id, observation=invalid, reward=0.0,
                                       terminated=False, truncated=False)
            env_return += step.reward
            if result.finish_reason == "length":
                finish = "length" if max_new == run.max_tokens_per_turn else "max_tokens"
                break
            if step.terminated or step.truncated:
                finish = "terminated" if step.terminated else "env_truncated"
                break
            if turn >= max_turns:
                break
            content = domain.turn_template.format(observation=step.observation)
            obs_bytes = chat.observation_i32(content, _as_i32(result.token_ids))
            k = len(obs_bytes) >> 2
            if len(token_ids) + k >= run.max_tokens_per_trajectory:
                finish = "max_tokens"
                break
            token_ids.frombytes(obs_bytes)
            loss_mask.frombytes(bytes(k))
        if not num_generated:  # nothing to train on: the trainer would refuse the whole batch
            raise TrajectoryFailed("generation_error", "the worker generated no token", 0)
        turns_ended = True
        if ctx.barrier is not None:
            ctx.barrier.leave(traj_id)
        metadata = {
            **opened.info,
            **domain.reward_metadata,
            "env_name": domain.env,
            "seed": seed,
            "env_return": env_return,
            "num_turns": turn,
            "finish_reason": finish,
            "responses": responses,
        }
        act.enter("reward", ctx.clock())
        if penalty is not None:
            # Ended by an invalid action: the domain's penalty is its reward (configured,
            # explicit; the reward function never saw a finished episode).
            reward, details = penalty, {"invalid_action": True}
        else:
            try:
                scored = await ctx.rewards.score(
                    domain.reward, domain.reward_url, prompt_text,
                    responses[-1] if responses else "", opened.info.get("reference"), metadata,
                )
            except RewardTooLargeError as exc:
                raise TrajectoryFailed("reward_too_large", str(exc), num_generated) from exc
            except RewardError as exc:
                raise TrajectoryFailed("reward_error", str(exc), num_generated) from exc
            reward, details = float(scored.reward), dict(scored.details)
        return Sample(
            sample_id=traj_id,
            group_key=group_key,
            token_ids=token_ids,
            loss_mask=loss_mask,
            behaviour_logprobs=gen_logprobs,
            versions=gen_versions,
            reward=reward,
            domain=domain.name,
            num_turns=turn,
            finish_reason=finish,
            turn_workers=turn_workers,
            metadata={
                "seed": seed,
                "num_prompt_tokens": num_prompt,
                "env_return": env_return,
                "t_start": t_start,
                "t_end": ctx.clock(),
                "reward_details": details,
                "num_invalid_actions": act.num_invalid_actions,
                # the task's reference answer, for the transcripts (where the env gives one)
                **({} if opened.info.get("reference") is None
                   else {"reference": opened.info["reference"]}),
                **ctx.extra_metadata,
            },
        )
    finally:
        if ctx.barrier is not None:
            ctx.barrier.leave(traj_id)
        ctx.proxy.release(traj_id, finished=turns_ended)
        # Most episodes end with a step that closed the session on its host: nothing to close
        # then, and no shielded task, timeout and coroutine per trajectory to do nothing.
        if session_id is not None and envs.is_open(session_id):
            await ctx.shielded_cleanup(_close_session(envs, session_id))
