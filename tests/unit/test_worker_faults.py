"""Worker failures judged by their cause: an engine's transient refusals are retried and never
held against the worker, its fatal errors still quarantine it; a hung worker (alive, answering
nothing) is probed and quarantined, its requests served elsewhere, while a healthy slow worker
that answers the probe keeps serving. Fakes over the proxy's worker-client interface."""

from __future__ import annotations

import array
import asyncio

import msgspec
import pytest

from helpers.fakes import FakeWorker
from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.routing.hangcheck import HangCheck
from rollart.controller.routing.proxy import TRANSIENT_RETRIES, LLMProxy
from rollart.controller.routing.workercheck import ViolationWindow
from rollart.transport import messages as m
from rollart.transport.errors import RemoteError, RemoteTimeoutError


def prompt() -> array.array:
    return array.array("i", [1, 2, 3])


PARAMS = m.SamplingParams(max_tokens=8)


class FakeRefusingWorker(FakeWorker):
    """Refuses its first ``refusals`` requests with ``engine_error`` of ``fault``, then serves
    (``refusals=None``: refuses every one)."""

    def __init__(self, name: str, fault: str, refusals: int | None) -> None:
        super().__init__(name)
        self.fault, self.refusals, self.refused = fault, refusals, 0

    async def generate(self, request, *, timeout_s=None):
        if self.refusals is None or self.refused < self.refusals:
            self.refused += 1
            raise RemoteError("engine_error", f"{self.name}: {request.request_id} refused "
                              "(injected)", fault=self.fault)
        return await super().generate(request, timeout_s=timeout_s)


# ---------------------------------------------------------------------- transient vs fatal
@pytest.mark.looptime
async def test_a_transient_rejecter_is_retried_and_never_quarantined() -> None:
    # Refuses 5 requests in a row for now (a weight update, overloaded), then serves: each
    # call gets through after pauses; nothing counts against it.
    w = FakeRefusingWorker("w", "transient", refusals=5)
    proxy = LLMProxy({"p": ("cpu", [w, FakeWorker("b")])}, {"d": "p"},
                     violations=ViolationWindow(3, 100))
    t0 = asyncio.get_running_loop().time()
    r = await proxy.generate("t0", "d", "r0", prompt(), PARAMS)  # least loaded: w
    waited = asyncio.get_running_loop().time() - t0
    assert r.finish_reason == "stop" and w.requests and w.requests[-1].request_id == "r0"
    assert 0.05 + 0.1 + 0.2 + 0.4 + 0.8 <= waited < 2.0  # backed off, doubling
    assert proxy.quarantined == [] and proxy.violations is not None
    assert proxy.violations.count("w") == 0
    assert proxy.num_transient_errors == 5 and proxy.num_engine_errors == 0


@pytest.mark.looptime
async def test_a_worker_refusing_everything_for_now_fails_turns_but_stays() -> None:
    w = FakeRefusingWorker("w", "transient", refusals=None)
    proxy = LLMProxy({"p": ("cpu", [w])}, {"d": "p"}, violations=ViolationWindow(3, 100))
    for i in range(4):  # more failed turns than would quarantine it for fatal errors
        with pytest.raises(RemoteError, match="refused") as info:
            await proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS)
        assert info.value.fault == "transient"
    assert w.refused == 4 * (TRANSIENT_RETRIES + 1)
    assert proxy.quarantined == [] and proxy.num_engine_errors == 0


@pytest.mark.parametrize("fault", ["fatal", ""])
async def test_a_fatal_rejecter_is_still_quarantined(fault: str) -> None:
    # "": a worker that does not classify its errors counts as before.
    w = FakeRefusingWorker("w", fault, refusals=None)
    proxy = LLMProxy({"p": ("cpu", [w, FakeWorker("b")])}, {"d": "p"},
                     violations=ViolationWindow(3, 100))
    for i in range(3):
        with pytest.raises(RemoteError, match="refused"):
            await proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS)
    assert proxy.quarantined == ["w"] and proxy.num_engine_errors == 3
    assert w.refused == 3  # not retried
    assert proxy.num_transient_errors == 0


def test_error_replies_carry_their_fault_and_old_peers_still_decode_them() -> None:
    class OldErrorReply(m.Msg, tag="ErrorReply"):  # what a peer before the field decodes
        code: str
        message: str

    old = msgspec.msgpack.Decoder(OldErrorReply)
    new = msgspec.msgpack.Decoder(m.ErrorReply)
    plain = msgspec.msgpack.encode(m.ErrorReply(code="bad_request", message="x"))
    assert old.decode(plain) == OldErrorReply(code="bad_request", message="x")
    tagged = m.ErrorReply(code="engine_error", message="busy", fault="transient")
    assert new.decode(msgspec.msgpack.encode(tagged)).fault == "transient"
    from_old = msgspec.msgpack.encode(OldErrorReply(code="engine_error", message="y"))
    assert new.decode(from_old).fault == ""  # an old worker's reply: unclassified


# ---------------------------------------------------------------------- the worker's tags
class FakeRenderer:
    def render_cmpl(self, prompts):
        return prompts


class FakeFailingEngine:
    """The engine calls ``InferenceWorker.generate`` makes; ``generate`` raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.renderer = FakeRenderer()

    async def generate(self, prompt, sampling, request_id):
        raise self.exc
        yield  # an async generator, as vLLM's


def _worker_error(exc: BaseException) -> RemoteError:
    from rollart.inference.engine import SchedulerCounts
    from rollart.inference.worker import InferenceWorker

    class FakeStager:
        def discard_up_to(self, version: int) -> None:
            pass

    worker = InferenceWorker(FakeFailingEngine(exc), name="w0", version=0, stager=FakeStager(),
                             counts=SchedulerCounts())
    request = m.Generate(request_id="r0", new_token_ids=bytes(4), sampling=PARAMS)
    with pytest.raises(RemoteError) as info:
        asyncio.run(worker.generate(request, ()))
    return info.value


def test_the_worker_tags_its_engine_errors_transient_or_fatal() -> None:
    pytest.importorskip("vllm")
    from vllm.exceptions import QueueOverflowError, RetryableRequestError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    def caused(cause: BaseException) -> BaseException:
        exc = EngineGenerateError()
        exc.__cause__ = cause
        return exc

    cases = [(QueueOverflowError(), "transient"), (caused(RetryableRequestError()), "transient"),
             (caused(RuntimeError("CUDA error")), "fatal"), (EngineDeadError(), "fatal")]
    for exc, fault in cases:
        err = _worker_error(exc)
        assert (err.code, err.fault) == ("engine_error", fault), (exc, err)


# ---------------------------------------------------------------------- hung vs slow workers
class FakeTimedWorker(FakeWorker):
    """Answers a request after ``delay(request)`` seconds (``None``: never), honouring the
    call's ``timeout_s`` as a real client does (``RemoteTimeoutError`` from when it is sent).
    ``sent`` lists every request received, probes included."""

    def __init__(self, name: str, delay) -> None:
        super().__init__(name)
        self.delay = delay
        self.sent: list[m.Generate] = []

    async def generate(self, request, *, timeout_s=None):
        self.sent.append(request)
        d = self.delay(request)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.sleep(1e9 if d is None else d)
        except TimeoutError:
            raise RemoteTimeoutError(f"{self.name}: no reply to Generate within {timeout_s} "
                                     "s") from None
        return await super().generate(request)


def probes(w: FakeTimedWorker) -> list[m.Generate]:
    return [r for r in w.sent if r.request_id.startswith("hang-probe-")]


@pytest.mark.looptime
async def test_a_hung_worker_is_probed_quarantined_and_its_requests_served_elsewhere(
        caplog) -> None:
    hung = FakeTimedWorker("a", lambda r: None)  # alive (never dead), answers nothing
    good = FakeTimedWorker("b", lambda r: 1.0)
    proxy = LLMProxy({"p": ("cpu", [hung, good])}, {"d": "p"}, max_generate_in_flight=2,
                     violations=ViolationWindow(3, 100))
    proxy.hang.probe_timeout_s = 5.0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks = [asyncio.create_task(proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS,
                                                timeout_s=10.0)) for i in range(8)]
    results = await asyncio.gather(*tasks)  # none fails
    took = loop.time() - t0
    assert proxy.quarantined == ["a"] and "a" in proxy.hang.hung
    assert [w.name for w in proxy.pools["p"].workers] == ["b"]
    # a took two requests (its window) and one probe; its two waiters never reached it, and
    # nothing went back to it once its calls timed out (least-loaded routing saw it empty).
    assert len(hung.sent) == 3 and len(probes(hung)) == 1
    assert probes(hung)[0].sampling.max_tokens == 1
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(8)]
    assert all(r.request_id in [q.request_id for q in good.requests] for r in results)
    assert proxy.num_rerouted == 2  # its two in-flight calls (the waiters just route again)
    assert 15.0 <= took < 25.0  # timeout (10 s), probe (5 s), then served by b
    assert proxy.hang.num_probes == 1 and proxy.hang.num_probes_failed == 1
    assert any("worker a removed (quarantined: hung" in r.getMessage() for r in caplog.records)


@pytest.mark.looptime
async def test_a_healthy_slow_worker_answers_its_probe_and_keeps_serving() -> None:
    # Its first request takes 100 s (past the 10 s timeout); everything else, the probe
    # included, takes 1 s. A window of 1: the requests behind the slow one wait for it.
    slow = FakeTimedWorker("a", lambda r: 100.0 if r.request_id == "r0" else 1.0)
    other = FakeTimedWorker("b", lambda r: 1.0)
    proxy = LLMProxy({"p": ("cpu", [slow, other])}, {"d": "p"}, max_generate_in_flight=1,
                     violations=ViolationWindow(3, 100))
    proxy.hang.probe_timeout_s = 5.0
    tasks = [asyncio.create_task(proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS,
                                                timeout_s=10.0)) for i in range(6)]
    out = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(out[0], RemoteTimeoutError)  # the slow request fails as before
    assert all(isinstance(r, m.GenerateResult) for r in out[1:])  # its waiters do not
    assert proxy.quarantined == [] and not proxy.hang.hung
    assert len(probes(slow)) == 1 and proxy.hang.num_probes_failed == 0
    served_by_a = [r.request_id for r in slow.requests if not r.request_id.startswith("hang")]
    assert served_by_a and "r0" not in served_by_a  # it went on serving its waiters
    r = await proxy.generate("t9", "d", "r9", prompt(), PARAMS, timeout_s=10.0)
    assert r.request_id == "r9" and [w.name for w in proxy.pools["p"].workers] == ["a", "b"]


@pytest.mark.looptime
async def test_nobody_is_suspected_when_every_worker_is_silent() -> None:
    # The controller stalled, or every engine is slow: a timeout is not a hung worker.
    a = FakeTimedWorker("a", lambda r: 100.0)
    b = FakeTimedWorker("b", lambda r: 100.0)
    proxy = LLMProxy({"p": ("cpu", [a, b])}, {"d": "p"})
    out = await asyncio.gather(*(proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS,
                                                timeout_s=10.0) for i in range(4)),
                               return_exceptions=True)
    assert all(isinstance(r, RemoteTimeoutError) for r in out)
    assert proxy.hang.num_probes == 0 and proxy.quarantined == []


def _silent_until(until_s: float | None, then_s: float = 1.0):
    """Answers nothing (``None``) until loop time ``until_s`` (``None``: ever), then in
    ``then_s`` seconds; judged when a request is sent."""
    def delay(request):
        if until_s is None or asyncio.get_running_loop().time() < until_s:
            return None
        return then_s
    return delay


async def _time_out_while_another_answers(proxy: LLMProxy, i: int) -> BaseException | None:
    """One call of domain ``d`` (pool ``p``) with a 10 s timeout, while a call of domain ``e``
    (another worker) is answered: what the ``d`` call raised (``None``: it was answered)."""
    silent = asyncio.create_task(proxy.generate(f"t{i}", "d", f"r{i}", prompt(), PARAMS,
                                                timeout_s=10.0))
    await proxy.generate(f"u{i}", "e", f"s{i}", prompt(), PARAMS, timeout_s=10.0)
    try:
        await silent
    except Exception as exc:
        return exc
    return None


def _kept_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kept as overloaded" in r.getMessage()]


@pytest.mark.looptime
@pytest.mark.parametrize("pool_of_two", [False, True])
async def test_a_hung_last_worker_of_a_pool_is_kept_as_overloaded(caplog, pool_of_two) -> None:
    # Pool p's only live worker a answers nothing until t = 100 s; pool q's b answers. With
    # pool_of_two, p also had c, quarantined already: a is the last one all the same.
    hung = FakeTimedWorker("a", _silent_until(100.0))
    other = FakeTimedWorker("b", lambda r: 1.0)
    p = [hung, FakeWorker("c")] if pool_of_two else [hung]
    proxy = LLMProxy({"p": ("cpu", p), "q": ("cpu", [other])}, {"d": "p", "e": "q"})
    if pool_of_two:
        proxy.quarantine("c", "bad output")
    proxy.hang.probe_timeout_s = 5.0
    proxy.hang.max_overload_s = 1000.0
    for i in range(3):  # three timeouts, each probed, each probe failed
        exc = await _time_out_while_another_answers(proxy, i)
        assert isinstance(exc, RemoteTimeoutError) and exc.overload  # not a failure in a row
    assert proxy.hang.num_probes_failed == 3
    assert proxy.quarantined == (["c"] if pool_of_two else []) and not proxy.hang.hung
    assert [w.name for w in proxy.pools["p"].workers] == ["a"]
    warned = _kept_warnings(caplog)  # the decision is logged once, not per call
    assert len(warned) == 1 and "pool p: worker a" in warned[0]
    assert "run.retry.max_overload_s = 1000" in warned[0]
    await asyncio.sleep(max(0.0, 100.0 - asyncio.get_running_loop().time()))
    r = await proxy.generate("t9", "d", "r9", prompt(), PARAMS, timeout_s=10.0)
    assert r.request_id == "r9" and "r9" in [q.request_id for q in hung.requests]


@pytest.mark.looptime
async def test_a_last_worker_silent_past_max_overload_s_stops_the_run_naming_it() -> None:
    hung = FakeTimedWorker("a", _silent_until(None))
    other = FakeTimedWorker("b", lambda r: 1.0)
    proxy = LLMProxy({"p": ("gpu-x", [hung]), "q": ("cpu", [other])}, {"d": "p", "e": "q"})
    proxy.hang.probe_timeout_s = 5.0
    proxy.hang.max_overload_s = 30.0
    loop = asyncio.get_running_loop()
    outcomes = []
    for i in range(10):
        exc = await _time_out_while_another_answers(proxy, i)
        outcomes.append(type(exc).__name__)
        if isinstance(exc, ControllerStalledError):
            break
    # first failed probe at 15 s; later ones every 15 s (a 10 s timeout, a 5 s probe): the
    # one at 45 s is 30 s after it
    assert outcomes == ["RemoteTimeoutError"] * 2 + ["ControllerStalledError"]
    assert loop.time() == pytest.approx(45.0, abs=2.0)
    msg = str(exc)
    assert "pool 'p' (gpu-x)" in msg and "last worker 'a'" in msg
    assert "run.retry.max_overload_s = 30" in msg
    assert proxy.quarantined == [] and [w.name for w in proxy.pools["p"].workers] == ["a"]


@pytest.mark.looptime
async def test_a_reply_from_the_kept_worker_restarts_its_overload_clock(caplog) -> None:
    # Silent, answers once, silent again: each silence is an episode of its own, measured
    # from its own first failed probe (and warned about once).
    loop = asyncio.get_running_loop()

    def delay(request):
        return 1.0 if 40.0 <= loop.time() < 40.5 else None

    hung = FakeTimedWorker("a", delay)
    proxy = LLMProxy({"p": ("cpu", [hung]), "q": ("cpu", [FakeTimedWorker("b", lambda r: 1.0)])},
                     {"d": "p", "e": "q"})
    proxy.hang.probe_timeout_s = 5.0
    proxy.hang.max_overload_s = 25.0
    for i in range(2):  # failed probes at 15 s and 30 s: 15 s into the episode
        assert isinstance(await _time_out_while_another_answers(proxy, i), RemoteTimeoutError)
    await asyncio.sleep(40.0 - loop.time())
    assert await _time_out_while_another_answers(proxy, 2) is None  # answered at 41 s
    for i in range(3, 5):  # failed probes at ~56 s and ~71 s: a new episode, 15 s into it
        assert isinstance(await _time_out_while_another_answers(proxy, i), RemoteTimeoutError)
    assert len(_kept_warnings(caplog)) == 2
    exc = await _time_out_while_another_answers(proxy, 5)  # ~86 s: 30 s into it
    assert isinstance(exc, ControllerStalledError) and "last worker 'a'" in str(exc)


@pytest.mark.looptime
async def test_no_probe_while_the_controller_pauses_the_worker() -> None:
    # A probe sent into a pause (a weight update) would time out although the worker is
    # healthy: it waits for the resume.
    w = FakeTimedWorker("a", lambda r: 1.0)
    hang = HangCheck(probe_timeout_s=5.0)
    hang.pausing(["a"])
    probe = asyncio.create_task(hang.probe(w, 1))
    await asyncio.sleep(100.0)
    assert not w.sent and not probe.done()
    hang.resumed(["a"])
    assert await probe is False and len(w.sent) == 1


# ---------------------------------------------------------------------- overload, not failure
def _slow_until(until_s: float):
    """Every call takes 30 s (past a 20 s timeout) until loop time ``until_s``, then 0.5 s."""
    def delay(request):
        return 30.0 if asyncio.get_running_loop().time() < until_s else 0.5
    return delay


@pytest.mark.looptime
async def test_timeouts_of_an_overloaded_pool_do_not_stop_the_run() -> None:
    # Every worker is too slow for 300 s: dozens of generate timeouts in a row, far past
    # max_failures_in_a_row = 5, which used to stop the run; then it trains on.
    from test_controller_faults import backends, check_batches, failed, scenario
    from test_controller_modes import run_steps

    from rollart.controller import Cluster

    sc = scenario(generate_timeout_s=20.0, retry={"max_failures_in_a_row": 5})
    worker = FakeTimedWorker("w1", _slow_until(300.0))
    async with Cluster.from_scenario(sc, backends=backends(worker=worker)) as c:
        steps = await run_steps(c, 2, timeout_s=5000.0)
    check_batches(steps)
    assert failed(steps)["generation_timeout"] > 5


@pytest.mark.looptime
async def test_an_overload_that_outlasts_its_bound_stops_the_run() -> None:
    from test_controller_faults import backends, scenario
    from test_controller_modes import run_steps

    from rollart.controller import Cluster
    from rollart.controller.observe.stall import ControllerStalledError

    sc = scenario(generate_timeout_s=20.0, retry={"max_overload_s": 500.0})
    worker = FakeTimedWorker("w1", _slow_until(1e9))
    async with Cluster.from_scenario(sc, backends=backends(worker=worker)) as c:
        with pytest.raises(ControllerStalledError, match=r"generate calls kept timing out under "
                           r"overload for 5\d\d s .*run.retry.max_overload_s = 500"):
            await run_steps(c, 1, timeout_s=5000.0)


@pytest.mark.looptime
async def test_a_run_with_a_hung_worker_quarantines_it_and_fails_no_trajectory() -> None:
    from test_controller_faults import check_batches, failed, scenario
    from test_controller_modes import run_steps

    from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeTrainer
    from rollart.controller import Backends, Cluster

    sc = scenario(generate_timeout_s=20.0,
                  worker_checks={"hang_probe_timeout_s": 5.0})
    hung = FakeTimedWorker("w1", lambda r: None)
    good = FakeTimedWorker("w2", lambda r: 0.5)
    b = Backends(pools={"p1": [hung, good]}, trainer=FakeTrainer(), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=2, latency=lambda i, s: 1.0)],
                 reward_service=FakeReward())
    async with Cluster.from_scenario(sc, backends=b) as c:
        steps = await run_steps(c, 3, timeout_s=5000.0)
        assert c.controller is not None
        assert c.controller.proxy.quarantined == ["w1"]
    check_batches(steps)
    assert failed(steps) == {}  # its calls went to w2 instead of failing
    assert [w for s in steps for w in s.metrics.quarantined_workers] == ["w1"]
    assert len(probes(hung)) == 1


def _two_pools(w1: FakeWorker, w2: FakeWorker):
    from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeTrainer
    from rollart.controller import Backends

    # make_scenario: domain "game" on pool p1 (w1), "math" on p2 (w2)
    return Backends(pools={"p1": [w1], "p2": [w2]}, trainer=FakeTrainer(), tokenizer=TOK,
                    env_hosts=[FakeEnvHost(turns=2, latency=lambda i, s: 1.0)],
                    reward_service=FakeReward())


@pytest.mark.looptime
async def test_a_run_whose_pool_has_one_hung_worker_slows_down_and_goes_on(caplog) -> None:
    # w1, pool p1's only worker, answers nothing for its first 400 s while w2 (pool p2)
    # answers: its probes fail, but it stays; its domain's timeouts do not count toward
    # max_failures_in_a_row = 3, and once it answers again its trajectories train.
    from test_controller_faults import failed

    from helpers.fakes import make_scenario
    from rollart.controller import Cluster

    sc = make_scenario(generate_timeout_s=20.0, worker_checks={"hang_probe_timeout_s": 5.0},
                       retry={"max_failures_in_a_row": 3, "max_overload_s": 3000.0})
    hung = FakeTimedWorker("w1", _silent_until(400.0, then_s=0.5))
    good = FakeTimedWorker("w2", lambda r: 0.5)
    steps: list = []
    async with Cluster.from_scenario(sc, backends=_two_pools(hung, good)) as c:
        async with asyncio.timeout(20_000):
            while not any("w1" in s.turn_workers for st in steps for s in st.samples):
                async for st in c.train(steps=1):
                    steps.append(st)
        assert c.controller is not None
        assert c.controller.proxy.quarantined == []
        assert [w.name for w in c.controller.proxy.pools["p1"].workers] == ["w1"]
    assert failed(steps).get("generation_timeout", 0) > 3
    assert len(probes(hung)) >= 2 and len(_kept_warnings(caplog)) == 1
    assert not [w for st in steps for w in st.metrics.quarantined_workers]
    assert any(s.domain == "game" for st in steps for s in st.samples)


@pytest.mark.looptime
async def test_a_run_whose_pool_last_worker_stays_hung_stops_past_max_overload_s() -> None:
    from test_controller_modes import run_steps

    from helpers.fakes import make_scenario
    from rollart.controller import Cluster

    # domain_mix "weight": under the default "yield" the hung pool's domain, which trains
    # nothing, is started ever more often, so no trajectory finishes anywhere and the run
    # stops on the overload rule (same bound) before this pool-specific one.
    sc = make_scenario(generate_timeout_s=20.0, worker_checks={"hang_probe_timeout_s": 5.0},
                       retry={"max_overload_s": 200.0}, domain_mix="weight")
    hung = FakeTimedWorker("w1", _silent_until(None))
    good = FakeTimedWorker("w2", lambda r: 0.5)
    async with Cluster.from_scenario(sc, backends=_two_pools(hung, good)) as c:
        with pytest.raises(ControllerStalledError, match=r"pool 'p1' \(cpu\): its last worker "
                           r"'w1' has answered no generate call for 2\d\d s .*"
                           r"run.retry.max_overload_s = 200"):
            await run_steps(c, 1000, timeout_s=20_000.0)


async def test_a_fault_crosses_the_wire_with_its_error() -> None:
    from rollart.transport.rpc import RpcClient, RpcServer
    from rollart.transport.security import env_credentials

    async def refuse(msg: m.Generate, _frames):
        fault = {"t": "transient", "f": "fatal"}.get(msg.request_id, "")
        raise RemoteError("engine_error", f"{msg.request_id} refused", fault=fault)

    server = RpcServer("tcp://127.0.0.1:0", {m.Generate: refuse}, name="w",
                       auth=env_credentials())
    task = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        for rid, fault in (("t", "transient"), ("f", "fatal"), ("u", "")):
            with pytest.raises(RemoteError, match=f"{rid} refused") as info:
                await client.call(m.Generate(request_id=rid, new_token_ids=bytes(4),
                                             sampling=PARAMS), timeout_s=30.0)
            assert (info.value.code, info.value.fault) == ("engine_error", fault)
    finally:
        await client.close()
        await server.close()
        task.cancel()
