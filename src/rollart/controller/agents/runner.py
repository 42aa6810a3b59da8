"""Agent trajectories: a user coroutine driving one trajectory through an OpenAI client.

``AgentRunner.body`` is the trajectory body ``run_trajectory`` runs for a domain with a
registered agent (instead of the gym loop), so an agent trajectory gets everything a gym one
gets from the controller: groups and redundancy, affinity, ``run.trajectory_timeout_s``, the
activity record, cancellation, retries and failure counting by reason (never a reward of 0).

One trajectory:

1. opens an env session of the domain (``domain.env``) for the group's seed: its observation is
   the task (``task = {"prompt", "system_prompt", "observation", "info", "seed", "domain"}``,
   ``prompt`` = ``domain.prompt_template`` applied to the observation), then closes it at the end;
2. opens an :class:`~rollart.controller.agents.session.AgentSession` with its own base URL and
   runs ``await agent(client, task)`` with an ``openai.AsyncOpenAI`` client on it
   (``max_retries=0``: a retried call would be a second turn);
3. ends when the agent returns (a float is the reward; ``None``: the domain's reward function
   scores the last assistant message, with the env's ``reference``), or when the session ends the
   trajectory first (restart, cancel, failure, budget): the agent gets ``ENDED_GRACE_S`` to
   read the error its call got (later calls get 404), then its task is cancelled. A cancelled
   trajectory task (a redundant member, ``run.trajectory_timeout_s``, a staleness restart,
   shutdown) cancels the agent task (``CancelledError`` where the agent awaits) and its
   completion in flight at once, which aborts that vLLM request on the worker.

Failure reasons beyond the gym path's: ``agent_error`` (the agent raised, or returned something
that is not a float / ``None``, or made no completion call) and ``history_rewritten``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollart.config import DomainConfig
from rollart.controller.agents.capture import Conversation
from rollart.controller.agents.server import AgentServer
from rollart.controller.agents.session import AgentSession, Finished
from rollart.controller.buffer.sample import Sample
from rollart.controller.rollout.trajectory import (
    CLOSE_TIMEOUT_S,
    Activity,
    TrajectoryContext,
    TrajectoryFailed,
    admit_first_turn,
    env_failure,
)
from rollart.controller.routing.routers import EnvHostsExhaustedError
from rollart.transport.errors import (
    InvalidActionError,
    PeerDeadError,
    RemoteError,
    RewardError,
    RewardTooLargeError,
)

log = logging.getLogger(__name__)

#: seconds an agent may still run after its trajectory ended (to read the error of its call)
ENDED_GRACE_S = 5.0
#: ``await agent(client, task) -> reward | None``; ``client`` is an ``openai.AsyncOpenAI``
AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float | None]]


@dataclass(frozen=True)
class AgentSpec:
    """A registered agent: its coroutine function and the vLLM tool parser that reads tool
    calls from the model's output (``""``: requests with ``tools`` are refused)."""

    fn: AgentFn
    tool_parser: str = "hermes"


class AgentRunner:
    """Registered agents by domain, and the endpoint their trajectories talk to."""

    def __init__(self, agents: dict[str, AgentSpec], server: AgentServer | None = None) -> None:
        self.agents = dict(agents)
        self.server = server or AgentServer()

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    def body_for(self, domain: str) -> Callable[..., Awaitable[Sample]] | None:
        """The trajectory body for ``domain`` (``None``: not an agent domain, the gym loop)."""
        return self._run if domain in self.agents else None

    async def _run(self, ctx: TrajectoryContext, traj_id: str, group_key: str,
                   domain: DomainConfig, seed: int, act: Activity) -> Sample:
        import openai  # the optional client: only agent runs need it

        spec = self.agents[domain.name]
        t_start = ctx.clock()
        session_id: str | None = None
        session: AgentSession | None = None
        agent_task: asyncio.Task[Any] | None = None
        client = None
        turns_ended = False  # its footprint is a final one (the KV working set's domain means)
        if ctx.barrier is not None:
            ctx.barrier.join(traj_id)
        try:
            act.enter("env open", ctx.clock())
            try:
                opened = await ctx.envs.open(domain.env, seed, domain.env_options,
                                             timeout_s=ctx.run.env_timeout_s)
            except EnvHostsExhaustedError:
                raise
            except (RemoteError, PeerDeadError) as exc:
                raise env_failure(exc) from exc
            except InvalidActionError as exc:
                raise TrajectoryFailed("env_error", f"reset raised {exc!r}") from exc
            session_id = opened.session_id
            prompt = domain.prompt_template.format(observation=opened.observation)
            task = {"prompt": prompt, "system_prompt": domain.system_prompt,
                    "observation": opened.observation, "info": dict(opened.info),
                    "seed": seed, "domain": domain.name}
            conv = Conversation(ctx.chat[domain.name])
            session = AgentSession(ctx, traj_id, domain, conv, act, spec.tool_parser)
            self.server.sessions[session.token] = session
            client = openai.AsyncOpenAI(base_url=self.server.base_url(session),
                                        api_key="rollart", max_retries=0,
                                        timeout=ctx.run.generate_timeout_s or 600.0)
            # Before the agent starts: its HTTP client's timeout must not run while the first
            # turn waits for KV room.
            await admit_first_turn(ctx, act, traj_id, domain.name)
            act.enter("agent running", ctx.clock())
            agent_task = asyncio.ensure_future(spec.fn(client, task))
            await asyncio.wait({agent_task, session.ended}, return_when=asyncio.FIRST_COMPLETED)
            finish = "stop"
            if session.ended.done():
                if not agent_task.done():
                    # Let the agent read the error its call got (it usually raises at once);
                    # past the grace it is cancelled.
                    await asyncio.wait({agent_task}, timeout=ENDED_GRACE_S)
                if agent_task.done() and not agent_task.cancelled():
                    agent_task.exception()  # retrieved: the ending below is the outcome
                ending = session.ended.result()
                if not isinstance(ending, Finished):
                    raise ending
                finish, value = ending.finish_reason, None
                turns_ended = conv.num_generated > 0
            else:
                # The agent makes no more calls, whatever it returned or raised: its footprint
                # is a final one, as is a gym trajectory's whose reward then fails.
                turns_ended = conv.num_generated > 0
                try:
                    value = agent_task.result()
                except Exception as exc:
                    raise TrajectoryFailed(
                        "agent_error", f"the agent raised {type(exc).__name__}: {exc}",
                        conv.num_generated) from exc
                if session.ended.done():  # it ended the trajectory and the agent returned
                    ending = session.ended.result()
                    if not isinstance(ending, Finished):
                        turns_ended = False
                        raise ending
                    finish, value = ending.finish_reason, None
                session.end(Finished(finish))
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value)):
                raise TrajectoryFailed("agent_error", f"the agent returned {value!r}; a finite "
                                       "float reward or None expected", conv.num_generated)
            if not conv.num_generated:
                raise TrajectoryFailed("agent_error", "the agent made no completion call", 0)
            if ctx.barrier is not None:
                ctx.barrier.leave(traj_id)
            metadata = {**opened.info, **domain.reward_metadata, "env_name": domain.env,
                        "seed": seed, "num_turns": conv.num_turns, "finish_reason": finish,
                        "messages": conv.messages}
            act.enter("reward", ctx.clock())
            if value is not None:
                reward, details = float(value), {"source": "agent"}
            else:
                try:
                    scored = await ctx.rewards.score(
                        domain.reward, domain.reward_url, prompt, session.last_content,
                        opened.info.get("reference"), metadata)
                except RewardTooLargeError as exc:
                    raise TrajectoryFailed("reward_too_large", str(exc),
                                           conv.num_generated) from exc
                except RewardError as exc:
                    raise TrajectoryFailed("reward_error", str(exc), conv.num_generated) from exc
                reward, details = float(scored.reward), dict(scored.details)
            return Sample(
                sample_id=traj_id, group_key=group_key, token_ids=conv.token_ids,
                loss_mask=conv.loss_mask, behaviour_logprobs=conv.logprobs,
                versions=conv.versions, reward=reward, domain=domain.name,
                num_turns=conv.num_turns, finish_reason=finish,
                turn_workers=session.turn_workers,
                metadata={"seed": seed, "num_prompt_tokens": conv.num_prompt_tokens,
                          "t_start": t_start, "t_end": ctx.clock(), "reward_details": details,
                          "agent": True, "messages": conv.messages, "tools": conv.tools,
                          **ctx.extra_metadata},
            )
        finally:
            if ctx.barrier is not None:
                ctx.barrier.leave(traj_id)
            await ctx.shielded_cleanup(self._cleanup(ctx, traj_id, session, agent_task, client,
                                                     session_id, turns_ended))

    async def _cleanup(self, ctx: TrajectoryContext, traj_id: str,
                       session: AgentSession | None, agent_task: asyncio.Task[Any] | None,
                       client: Any, session_id: str | None, turns_ended: bool) -> None:
        """Stop the agent and its completion in flight, then free the session, the worker's
        prefix and the env session (shielded: runs to the end while being cancelled).
        ``turns_ended``: the agent finished its turns (``LLMProxy.release``'s ``finished``)."""
        if session is not None:
            session.end(Finished("closed"))
            session.cancel_inflight()
            self.server.sessions.pop(session.token, None)
        if agent_task is not None and not agent_task.done():
            agent_task.cancel()
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await agent_task
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        ctx.proxy.release(traj_id, finished=turns_ended)
        if session_id is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await ctx.envs.close_session(session_id)
            except Exception as exc:
                log.warning("closing env session %s failed: %s: %s", session_id,
                            type(exc).__name__, exc)
