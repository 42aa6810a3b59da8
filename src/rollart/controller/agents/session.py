"""One agent trajectory's completion calls: the same per-turn steps as the gym path.

Each ``chat.completions`` call of a trajectory's agent runs, in order: validation
(``rollart.controller.agents.params``), the delta of the conversation
(``rollart.controller.agents.capture``), the buffer's staleness check (``begin_turn``: ``wait``
waits for newer weights, ``restart`` / ``cancel`` end the trajectory), the token budgets, the
sync-mode turn barrier, the proxy's generate (affinity by domain, sticky worker, delta prompts),
and the token record (``record_tokens``). What the agent sees:

- 400 ``invalid_request_error`` for a bad request (``unsupported_value`` /
  ``unsupported_parameter`` naming ``param``: this call only, nothing recorded, the trajectory
  goes on), and for ``history_rewritten`` (the trajectory fails with that reason, counted and
  retried per ``run.retry``, never a sample; later calls get 404 ``session_not_found``);
- 409 ``trajectory_restarted`` / ``trajectory_cancelled`` when the staleness check restarts the
  trajectory (it is retried from the start) or its group no longer needs it;
- 400 ``context_length_exceeded`` / ``max_turns_exceeded`` when a budget ends the trajectory: it
  is *finished* (not failed) and scored like a gym trajectory truncated there;
- 502 ``generation_failed`` when the worker failed the turn (the trajectory fails with the gym
  path's reason: ``generation_error``, ``generation_timeout``, ...).

Every ending resolves :attr:`AgentSession.ended` so the runner stops the agent at once; the agent
task is cancelled, and so is a completion in flight (which aborts the vLLM request).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from rollart.config import DomainConfig
from rollart.controller.agents.capture import Conversation, HistoryRewritten, TemplateRefused
from rollart.controller.agents.params import ChatRequest
from rollart.controller.rollout.trajectory import (
    Activity,
    TrajectoryContext,
    TrajectoryFailed,
    TrajectoryNotNeeded,
    TrajectoryStale,
)
from rollart.controller.routing.workercheck import INVALID_OUTPUT_REASON, InvalidWorkerOutput
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError, RemoteTimeoutError

#: the model id ``/v1/models`` lists; requests may name any model (one policy is served)
MODEL_ID = "rollart-policy"


class ApiError(Exception):
    """An OpenAI-style error reply: HTTP ``status``, ``code``, ``message`` and ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.kind = (
            status, code, message, param, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class Finished(Exception):
    """The trajectory ended normally at a budget (``finish_reason``: ``max_tokens`` or
    ``max_turns``); it is scored."""

    def __init__(self, finish_reason: str) -> None:
        super().__init__(finish_reason)
        self.finish_reason = finish_reason


class AgentSession:
    """The state of one agent trajectory behind its own base URL (``token`` is its secret:
    ``secrets.token_urlsafe(24)``, 192 random bits)."""

    def __init__(self, ctx: TrajectoryContext, traj_id: str, domain: DomainConfig,
                 conv: Conversation, act: Activity, tool_parser: str) -> None:
        self.ctx, self.traj_id, self.domain, self.conv, self.act = ctx, traj_id, domain, conv, act
        self.tool_parser = tool_parser
        self.token = secrets.token_urlsafe(24)
        #: resolved with the exception that ends the trajectory (``Finished`` for a budget)
        self.ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.turn_workers: list[str] = []
        self.last_content = ""
        self._busy = False
        self._calls = 0
        self._inflight: asyncio.Task[dict[str, Any]] | None = None

    def end(self, exc: BaseException) -> None:
        """End the trajectory with ``exc`` (the first ending wins)."""
        if not self.ended.done():
            self.ended.set_result(exc)

    def cancel_inflight(self) -> None:
        """Cancel a completion in flight (its generate call, so the worker aborts it)."""
        if self._inflight is not None:
            self._inflight.cancel()

    async def complete(self, req: ChatRequest) -> dict[str, Any]:
        """Serve one validated request; returns the ``chat.completion`` object.

        Raises:
            ApiError: see the module docstring (the trajectory may have ended with it).
        """
        if self.ended.done():
            raise ApiError(404, "session_finished", "this trajectory has ended")
        if self._busy:
            raise ApiError(400, "concurrent_request", "a completion of this trajectory is "
                           "already in flight: one at a time (each extends one sequence)")
        self._busy = True
        self._inflight = asyncio.ensure_future(self._complete(req))
        try:
            return await self._inflight
        finally:
            self._busy = False
            self._inflight = None

    def _fail(self, exc: BaseException, api: ApiError) -> ApiError:
        self.end(exc)
        return api

    async def _complete(self, req: ChatRequest) -> dict[str, Any]:
        ctx, run, conv, act, tid = self.ctx, self.ctx.run, self.conv, self.act, self.traj_id
        if req.parse_tools and not self.tool_parser:
            raise ApiError(400, "tools_unsupported", "this agent was registered without a tool "
                           "parser (cluster.agent(..., tool_parser=...))", "tools")
        try:
            delta = conv.delta(req.messages, req.tools)
        except TemplateRefused as exc:  # the conversation is unchanged: the agent may retry
            raise ApiError(400, "template_error", str(exc), "messages") from None
        except HistoryRewritten as exc:
            raise self._fail(TrajectoryFailed("history_rewritten", str(exc), conv.num_generated),
                             ApiError(400, "history_rewritten", f"{exc} (rollart trains one "
                                      "token sequence per trajectory; it has failed and will be "
                                      "retried)", "messages")) from None
        max_turns = self.domain.max_turns or run.max_turns
        if conv.num_turns >= max_turns:
            raise self._fail(Finished("max_turns"), ApiError(
                400, "max_turns_exceeded", f"the trajectory reached max_turns = {max_turns}"))
        while True:
            verdict = ctx.buffer.begin_turn(tid, ctx.proxy.version)
            if verdict == "restart":
                raise self._fail(TrajectoryStale(tid), ApiError(
                    409, "trajectory_restarted", "the policy moved on past the staleness bound: "
                    "this trajectory is restarted from the beginning", kind="conflict"))
            if verdict == "cancel":
                raise self._fail(TrajectoryNotNeeded(tid), ApiError(
                    409, "trajectory_cancelled", "this trajectory's group no longer needs it",
                    kind="conflict"))
            if verdict != "wait":
                break
            act.enter("waiting for weights", ctx.clock())
            await ctx.wait_for_weights(ctx.proxy.version)
        total = len(conv.token_ids) + len(delta)
        budget = run.max_tokens_per_trajectory - total
        if budget <= 0:
            if not conv.num_generated:
                raise self._fail(TrajectoryFailed("prompt_too_long", (
                    f"prompt of {total} tokens leaves no room under "
                    f"run.max_tokens_per_trajectory = {run.max_tokens_per_trajectory}")),
                    ApiError(400, "context_length_exceeded", "the prompt is too long"))
            raise self._fail(Finished("max_tokens"), ApiError(
                400, "context_length_exceeded", f"the trajectory reached "
                f"run.max_tokens_per_trajectory = {run.max_tokens_per_trajectory} tokens"))
        max_new = min(run.max_tokens_per_turn, budget, req.max_tokens or run.max_tokens_per_turn)
        if ctx.barrier is not None:
            await ctx.barrier.wait(tid)
        prompt = conv.token_ids[:]
        prompt.extend(delta)
        params = m.SamplingParams(max_tokens=max_new, temperature=self.domain.sampling.temperature,
                                  top_p=self.domain.sampling.top_p,
                                  top_k=self.domain.sampling.top_k)
        act.enter(f"generating turn {conv.num_turns}", ctx.clock())
        result = await self._generate(prompt, params, req)
        n = result.num_tokens
        self.turn_workers.append(ctx.proxy.served_by(tid) or "")
        new_ids = tb.to_array(result.token_ids, "i")
        new_versions = tb.to_array(result.versions, "i")
        if result.finish_reason == "abort":
            raise self._fail(TrajectoryFailed("generation_aborted", "worker aborted turn "
                                              f"{conv.num_turns}", conv.num_generated + n),
                             ApiError(502, "generation_failed", "the worker aborted the turn",
                                      kind="server_error"))
        if req.parse_tools and result.tool_calls is None:
            raise self._fail(TrajectoryFailed(
                "generation_error", f"worker {self.turn_workers[-1] or '?'} did not parse tool "
                f"calls (Generate.tool_parser {self.tool_parser!r}): a backend without tool "
                "parsing", conv.num_generated + n),
                ApiError(502, "generation_failed", "the worker did not parse tool calls",
                         kind="server_error"))
        if req.parse_tools:
            content = result.content or ""
            calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}}
                     for c in result.tool_calls or []]
        else:
            content, calls = ctx.chat[self.domain.name].decode(new_ids), []
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        conv.append_prompt(delta)
        conv.append_generated(req.messages, req.tools, new_ids, result.logprobs, new_versions,
                              reply)
        act.num_generated = conv.num_generated
        ctx.generated_tokens += n
        ctx.buffer.record_tokens(tid, new_versions)
        self.last_content = content
        act.enter("agent running", ctx.clock())
        finish = ("tool_calls" if calls else
                  "length" if result.finish_reason == "length" else "stop")
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
            "created": int(time.time()), "model": MODEL_ID,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {**reply, "content": content or None}}],
            "usage": {"prompt_tokens": total, "completion_tokens": n,
                      "total_tokens": total + n},
        }

    async def _generate(self, prompt: Any, params: m.SamplingParams,
                        req: ChatRequest) -> m.GenerateResult:
        ctx, tid, n0 = self.ctx, self.traj_id, self.conv.num_generated
        self._calls += 1

        def fail(reason: str, exc: BaseException) -> ApiError:
            failed = TrajectoryFailed(reason, str(exc), n0)
            # The run loop reads the cause: a generate timeout under overload
            # (``exc.overload``) is not a failure in a row.
            failed.__cause__ = exc
            return self._fail(failed, ApiError(502, "generation_failed", f"{reason}: {exc}",
                                               kind="server_error"))

        try:
            return await ctx.proxy.generate(
                # Unique per call: a call sent again after a disconnect must not collide with
                # the aborted one's id while the worker still winds it down.
                tid, self.domain.name, f"{tid}/t{self.conv.num_turns}c{self._calls}", prompt,
                params,
                timeout_s=ctx.run.generate_timeout_s,
                tool_parser=self.tool_parser if req.parse_tools else "")
        except RemoteTimeoutError as exc:
            raise fail("generation_timeout", exc) from exc
        except InvalidWorkerOutput as exc:
            raise fail(INVALID_OUTPUT_REASON, exc) from exc
        except RemoteError as exc:
            raise fail("generation_error", exc) from exc
        except Exception as exc:
            # Fatal (PoolExhaustedError, ControllerStalledError, ...): ending the session with it
            # makes the runner raise it, so it stops the run as it does from a gym trajectory
            # instead of becoming one failed HTTP call.
            raise self._fail(exc, ApiError(
                503, "run_stopped", f"the run stopped: {type(exc).__name__}: {exc}",
                kind="server_error")) from exc

