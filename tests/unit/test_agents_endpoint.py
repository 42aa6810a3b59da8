"""Agent trajectories end to end over fake backends: a real ``openai.AsyncOpenAI`` client talks
to the controller's endpoint over loopback HTTP; the worker, env, reward and trainer are fakes.
Covers the sample's tokens, the agent's reward, failure reasons (history rewrite, agent error,
timeout), bad requests, a finished session's 404, a client disconnect, cancellation and the
staleness restart."""

from __future__ import annotations

import asyncio
import gc
import re
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from test_controller_modes import backends, run_steps

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeWorker, make_scenario
from rollart.config import Scenario
from rollart.controller import Cluster
from rollart.controller.agents.capture import Conversation
from rollart.controller.agents.params import parse_request
from rollart.controller.agents.session import AgentSession, ApiError
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.rollout.trajectory import (
    Activity,
    TrajectoryContext,
    TrajectoryFailed,
    TrajectoryStale,
)
from rollart.controller.routing.proxy import PoolExhaustedError
from rollart.transport.errors import RemoteError, RemoteTimeoutError
from rollart.transport.messages import ToolCall

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Finalise the cancelled HTTP clients' leftovers here, not inside a later compile:
    CPython 3.11.7's AST builder reports a recursion depth mismatch when a collection runs
    their finalisers in the middle of it (seen as a SystemError at pytest's summary)."""
    yield
    gc.collect()


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)


def echo(message) -> dict:
    """The assistant message as an agent appends it to its history."""
    return message.model_dump(exclude_none=True)


def agent_scenario(**run) -> Scenario:
    """The fakes' scenario with its ``math`` domain only (pool p2, reward ``fake``)."""
    sc = make_scenario(batch_size=2, group_size=2, **run)
    return msgspec.structs.replace(sc, domains=[d for d in sc.domains if d.name == "math"])


def cluster_for(worker: FakeWorker | None = None, **run) -> tuple[Cluster, FakeReward]:
    reward = FakeReward(fn=lambda response, md: 1.0 if response == "ok" else 0.0)
    scenario = agent_scenario(**run)
    b = backends(FakeEnvHost(turns=2), workers=(FakeWorker("w1"), worker or FakeWorker("w2")),
                 reward=reward)
    return Cluster.from_scenario(scenario, backends=b), reward


async def two_turns(client: openai.AsyncOpenAI, task: dict) -> None:
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="any", messages=messages)
    messages += [echo(first.choices[0].message), {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="any", messages=messages)
    return None


async def test_an_agent_trains_with_exact_tokens_and_its_domains_reward() -> None:
    cluster, reward = cluster_for()
    cluster.agent("math")(two_turns)
    async with cluster:
        (step,) = await run_steps(cluster, 1)
    math = [s for s in step.samples if s.domain == "math"]
    assert math, "the batch holds the agent domain's group"
    for s in math:
        seed = s.metadata["seed"]
        text = chatml(("user", f"start {seed}"), ("assistant", "ok"), ("user", "again"),
                      ("assistant", "ok"))
        assert s.token_ids.tolist() == TOK.encode(text)[:-1]  # ends with the last eos
        assert s.loss_mask.tolist().count(1) == 6 and s.num_turns == 2
        assert s.metadata["agent"] and s.reward == 1.0
    scored = [c for c in reward.calls if c["metadata"].get("messages")]
    assert scored and all(c["response"] == "ok" and c["reference"] == "ok" for c in scored)


class FakeToolWorker(FakeWorker):
    """Answers "ok" and, where the request names a tool parser, reports one ``calc`` call on
    a trajectory's first turn (what vLLM's parser would find in the text), none later."""

    async def generate(self, request, *, timeout_s=None):
        result = await super().generate(request, timeout_s=timeout_s)
        if not request.tool_parser:
            return result
        first = "/t0c" in request.request_id
        calls = [ToolCall(name="calc", arguments='{"expr": "1+2"}')] if first else []
        return msgspec.structs.replace(result, tool_calls=calls,
                                       content=None if first else "ok")


async def test_tool_calls_reach_the_agent_and_tool_results_extend_the_sequence() -> None:
    seen = []

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        messages, reasons = [{"role": "user", "content": task["prompt"]}], []
        for _ in range(3):
            reply = await client.chat.completions.create(model="m", messages=messages,
                                                         tools=[CALC])
            choice = reply.choices[0]
            reasons.append(choice.finish_reason)
            messages.append(echo(choice.message))
            if not choice.message.tool_calls:
                seen.append(reasons)
                return 1.0
            for call in choice.message.tool_calls:
                assert (call.function.name, call.function.arguments) == (
                    "calc", '{"expr": "1+2"}')
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "3"})
        return 0.0

    cluster, _ = cluster_for(FakeToolWorker("w2"))
    cluster.agent("math")(solve)
    async with cluster:
        (step,) = await run_steps(cluster, 1)
    assert seen and all(r == ["tool_calls", "stop"] for r in seen)
    for s in step.samples:
        text = chatml(("user", f"start {s.metadata['seed']}"), ("assistant", "ok"),
                      ("tool", "3"), ("assistant", "ok"))
        assert s.token_ids.tolist() == TOK.encode(text)[:-1] and s.reward == 1.0
        assert s.metadata["messages"][1]["tool_calls"][0]["function"]["name"] == "calc"


async def test_a_worker_that_does_not_parse_tool_calls_fails_the_trajectory_by_name() -> None:
    errors: list[tuple[int, str]] = []
    retried = asyncio.Event()

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], tools=[CALC])
        except openai.APIStatusError as exc:
            errors.append((exc.status_code, exc.code))
            if len(errors) > 4:  # a retry ran: a first failure was counted (4 start at once)
                retried.set()
            raise
        return 1.0

    cluster, _ = cluster_for()  # plain fake workers: Generate.tool_parser is not honoured
    cluster.agent("math")(solve)
    await cluster.start()
    try:
        await retried.wait()
    finally:
        await cluster.close()
    assert set(errors) == {(502, "generation_failed")}
    assert cluster.controller.buffer.stats().failed.get("generation_error", 0) >= 1


async def test_failures_are_counted_by_reason_and_bad_requests_fail_only_the_call() -> None:
    calls = {"n": 0}
    seen: dict[str, object] = {}

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        calls["n"] += 1
        n = calls["n"]
        messages = [{"role": "user", "content": task["prompt"]}]
        try:
            await client.chat.completions.create(model="m", messages=messages, top_p=0.5)
        except openai.BadRequestError as exc:  # this call only: the trajectory goes on
            seen["bad"] = (exc.status_code, exc.code, exc.param)
        models = await client.models.list()
        seen["models"] = [m.id for m in models.data]
        first = await client.chat.completions.create(model="m", messages=messages)
        if n == 1:  # rewrites its history: the trajectory fails, the agent sees why
            try:
                await client.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": "something else"}, echo(first.choices[0].message),
                    {"role": "user", "content": "more"}])
            except openai.BadRequestError as exc:
                seen["rewrite"] = exc.code
                raise
        if n == 2:
            raise RuntimeError("agent bug")
        seen["url"] = str(client.base_url)
        return 0.5

    cluster, _ = cluster_for()
    cluster.agent("math")(solve)
    async with cluster:
        steps = []
        # The failing members may finish after another group filled the first batch.
        while len(steps) < 6 and len(cluster.controller.buffer.stats().failed) < 2:
            steps += await run_steps(cluster, 1)
        failed = cluster.controller.buffer.stats().failed
        # A finished trajectory's URL (and one never issued) answers 404 in OpenAI's shape.
        for url in (seen["url"], seen["url"].replace("/t/", "/t/x")):
            async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as late:
                with pytest.raises(openai.NotFoundError) as err:
                    await late.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "x"}])
            assert err.value.code == "session_not_found"
    assert failed.get("history_rewritten") == 1 and failed.get("agent_error") == 1
    assert seen["bad"] == (400, "unsupported_value", "top_p")
    assert seen["rewrite"] == "history_rewritten" and seen["models"] == ["rollart-policy"]
    samples = [s for step in steps for s in step.samples]
    assert samples and all(s.reward == 0.5 and s.metadata["reward_details"] == {"source": "agent"}
                           for s in samples)


async def test_malformed_bodies_get_openai_shaped_errors_and_the_trajectory_goes_on() -> None:
    seen: dict[str, object] = {}

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        url = str(client.base_url).rstrip("/") + "/chat/completions"
        async with aiohttp.ClientSession() as http:
            for name, body in (("deep", b"[" * 200_000), ("notjson", b"{nope")):
                async with http.post(url, data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
                    seen[name] = (resp.status, (await resp.json())["error"]["code"])
        await two_turns(client, task)
        return 0.5

    cluster, _ = cluster_for()
    cluster.agent("math")(solve)
    async with cluster:
        steps = await run_steps(cluster, 1)
    assert seen == {"deep": (400, "invalid_json"), "notjson": (400, "invalid_json")}
    assert steps[0].samples and not cluster.controller.buffer.stats().failed


async def test_a_hanging_agent_fails_with_trajectory_timeout() -> None:
    hung: set[int] = set()

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        # One member of every group hangs once, so no group completes before a timeout.
        if task["seed"] not in hung:
            hung.add(task["seed"])
            await asyncio.Event().wait()  # never returns: the trajectory's deadline ends it
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": task["prompt"]}])
        return 1.0

    # 10 s: generous for the members that do not hang, on a loaded machine.
    cluster, _ = cluster_for(trajectory_timeout_s=10.0)
    cluster.agent("math")(solve)
    async with cluster:
        await run_steps(cluster, 1)
        assert cluster.controller.buffer.stats().failed.get("trajectory_timeout", 0) >= 1


class FakeHangingWorker(FakeWorker):
    """Its first generate never finishes (until cancelled); ``started`` / ``cancelled`` say when
    it began and when it was aborted."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()
        self.hung = False

    async def generate(self, request, *, timeout_s=None):
        if not self.hung:
            self.hung = True
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.aborted.append(request.request_id)
                self.cancelled.set()
                raise
        return await super().generate(request, timeout_s=timeout_s)


async def test_a_client_disconnect_aborts_the_generation_and_records_nothing() -> None:
    worker = FakeHangingWorker("w2")

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        messages = [{"role": "user", "content": task["prompt"]}]
        if not worker.started.is_set():
            async with aiohttp.ClientSession() as http:
                call = asyncio.ensure_future(http.post(
                    f"{client.base_url}chat/completions", json={"messages": messages}))
                await worker.started.wait()
                call.cancel()  # the agent goes away mid-generation: the connection closes
                await asyncio.gather(call, return_exceptions=True)
            await worker.cancelled.wait()
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0

    cluster, _ = cluster_for(worker)
    cluster.agent("math")(solve)
    async with cluster:
        (step,) = await run_steps(cluster, 1)
    assert len(worker.aborted) == 1
    for s in (s for s in step.samples if s.domain == "math"):
        assert s.num_turns == 1 and s.loss_mask.tolist().count(1) == 3


async def test_closing_the_cluster_cancels_the_agent_and_aborts_its_request() -> None:
    worker = FakeHangingWorker("w2")
    agent_cancelled = asyncio.Event()

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": task["prompt"]}])
        except asyncio.CancelledError:
            agent_cancelled.set()
            raise
        return 1.0

    cluster, _ = cluster_for(worker)
    cluster.agent("math")(solve)
    await cluster.start()
    await worker.started.wait()
    await cluster.close()
    assert worker.cancelled.is_set() and len(worker.aborted) == 1
    assert agent_cancelled.is_set()


class FakeStaleBuffer:
    """A buffer whose staleness check says ``restart``."""

    def begin_turn(self, traj_id, version):
        return "restart"


async def test_a_stale_trajectory_is_restarted_and_the_agent_told() -> None:
    scenario = make_scenario()
    domain = next(d for d in scenario.domains if d.name == "math")
    ctx = TrajectoryContext(run=scenario.run, proxy=None, envs=None, rewards=None,
                            chat={"math": ChatTokens(TOK)}, buffer=FakeStaleBuffer(),
                            clock=lambda: 0.0, wait_for_weights=None)
    ctx.proxy = type("P", (), {"version": 1})()
    session = AgentSession(ctx, "g0/0", domain, Conversation(ChatTokens(TOK)),
                           Activity("g0", "x", 0.0), "hermes")
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, 1.0)
    with pytest.raises(ApiError) as err:
        await session.complete(req)
    assert (err.value.status, err.value.code) == (409, "trajectory_restarted")
    assert isinstance(session.ended.result(), TrajectoryStale)
    with pytest.raises(ApiError, match="ended"):
        await session.complete(req)


class FakeContinueBuffer:
    """A buffer whose staleness check lets every turn go on."""

    def begin_turn(self, traj_id, version):
        return "continue"


def _session_whose_generate_raises(exc: BaseException) -> AgentSession:
    """An agent session (domain "math") whose proxy raises ``exc`` on every generate call."""

    class RaisingProxy:
        version = 1

        async def generate(self, *args, **kwargs):
            raise exc

    scenario = make_scenario()
    domain = next(d for d in scenario.domains if d.name == "math")
    ctx = TrajectoryContext(run=scenario.run, proxy=RaisingProxy(), envs=None, rewards=None,
                            chat={"math": ChatTokens(TOK)}, buffer=FakeContinueBuffer(),
                            clock=lambda: 0.0, wait_for_weights=None)
    return AgentSession(ctx, "g0/0", domain, Conversation(ChatTokens(TOK)),
                        Activity("g0", "x", 0.0), "hermes")


async def test_a_generate_timeout_fails_the_trajectory_with_the_timeout_as_its_cause() -> None:
    # The run loop judges overload by the cause's ``overload`` mark: without the chained cause an
    # agent's generate timeouts would always count toward max_failures_in_a_row.
    timeout = RemoteTimeoutError("no worker answered")
    timeout.overload = True  # type: ignore[attr-defined]

    session = _session_whose_generate_raises(timeout)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, 1.0)
    with pytest.raises(ApiError) as err:
        await session.complete(req)
    assert (err.value.status, err.value.code) == (502, "generation_failed")
    failed = session.ended.result()
    assert isinstance(failed, TrajectoryFailed)
    assert failed.reason == "generation_timeout"
    assert failed.__cause__ is timeout


async def test_a_fatal_generate_error_ends_the_session_with_it_so_the_run_stops() -> None:
    # The runner raises a non-Finished ending out of the trajectory, where it is fatal; a fatal
    # error swallowed into one HTTP 500 would leave the run spinning on a dead pool.
    fatal = PoolExhaustedError("every worker of pool 'gpu' is dead")

    session = _session_whose_generate_raises(fatal)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, 1.0)
    with pytest.raises(ApiError) as err:
        await session.complete(req)
    assert (err.value.status, err.value.code) == (503, "run_stopped")
    assert session.ended.result() is fatal


def test_the_readme_shows_the_example_agent() -> None:
    root = Path(__file__).resolve().parents[2]
    section = (root / "README.md").read_text().split("## Agents written against the OpenAI API",
                                                     1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert code.startswith("async def solve(")
    assert code in (root / "examples" / "agent_calculator.py").read_text()


async def test_closing_the_cluster_waits_for_an_agent_trajectorys_env_session_close() -> None:
    # The agent ended; its trajectory's cleanup closes the env session (3 s here) when the
    # cluster closes. close() cancels that trajectory, whose shielded cleanup goes on: close()
    # must wait for it, or the env clients are closed under it ("client closed" warnings).
    from test_controller_faults import SlowCloseEnvHost

    env = SlowCloseEnvHost(3.0, turns=2)

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float:
        return 1.0

    b = backends(env, workers=(FakeWorker("w1"), FakeWorker("w2")), reward=FakeReward())
    cluster = Cluster.from_scenario(agent_scenario(), backends=b)
    cluster.agent("math")(solve)
    await cluster.start()
    await asyncio.wait_for(env.close_started.wait(), 60)
    assert env.closing
    await cluster.close()
    assert env.closing == 0 and env.closed


async def test_an_agent_trajectory_tells_the_proxy_whether_it_finished_its_turns() -> None:
    """One second completion fails (its trajectory is cut short: ``finished=False``); every
    trained agent trajectory ended its turns (``finished=True``)."""
    failed: list[str] = []

    def respond(req):
        if req.prefix_len and not failed:
            failed.append(req.trajectory_id)
            return RemoteError("engine_error", "boom")
        return "ok"

    cluster, _ = cluster_for(FakeWorker("w2", respond))
    cluster.agent("math")(two_turns)
    released: dict[str, bool] = {}
    async with cluster:
        proxy = cluster.controller.proxy
        release = proxy.release

        def record(traj_id: str, *, finished: bool = True) -> None:
            released[traj_id] = finished
            release(traj_id, finished=finished)

        proxy.release = record  # type: ignore[method-assign]
        (step,) = await run_steps(cluster, 1)
    trained = {s.sample_id for s in step.samples}
    assert trained and all(released[t] for t in trained)
    assert failed and released[failed[0]] is False
