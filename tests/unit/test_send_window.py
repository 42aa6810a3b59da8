"""The proxy's per-worker send window (issue 11): at most ``max_generate_in_flight`` generate requests
outstanding per worker, the rest waiting in arrival order, timed only once sent."""

from __future__ import annotations

import array
import asyncio

import pytest

from helpers.fakes import FakeWorker
from rollart.controller.routing.proxy import LLMProxy, PoolExhaustedError
from rollart.controller.routing.sendwindow import SendWindow
from rollart.controller.routing.workercheck import InvalidWorkerOutput, ViolationWindow
from rollart.transport import messages as m
from rollart.transport.errors import RemoteTimeoutError


def req(rid: str) -> tuple[str, array.array, m.SamplingParams]:
    return rid, array.array("i", [1, 2, 3]), m.SamplingParams(max_tokens=8)


async def until(cond, what: str) -> None:
    """Let the loop run until ``cond()`` holds (bounded: a test fails, it never hangs)."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class HeldWorker(FakeWorker):
    """FakeWorker whose requests finish only when the test releases them, one by one, and
    that applies a call's ``timeout_s`` as a real client does (from when it is sent, raising
    ``RemoteTimeoutError``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gates: dict[str, asyncio.Event] = {}
        self.max_outstanding = 0
        self.outstanding = 0

    async def generate(self, request: m.Generate, *, timeout_s=None) -> m.GenerateResult:
        gate = self.gates.setdefault(request.request_id, asyncio.Event())
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        try:
            async with asyncio.timeout(timeout_s):
                await gate.wait()
                return await super().generate(request)
        except TimeoutError:
            raise RemoteTimeoutError(f"{self.name}: no reply to Generate within "
                                     f"{timeout_s} s") from None
        finally:
            self.outstanding -= 1

    def finish(self, request_id: str) -> None:
        self.gates.setdefault(request_id, asyncio.Event()).set()


async def test_requests_beyond_the_window_wait_and_go_in_arrival_order() -> None:
    w = HeldWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"}, max_generate_in_flight=2)
    tasks = [asyncio.create_task(proxy.generate(f"t{i}", "d", *req(f"r{i}"))) for i in range(5)]
    await until(lambda: len(w.gates) == 2 and proxy.num_window_waits == 3, "two sent")
    assert sorted(w.gates) == ["r0", "r1"]
    assert proxy.load(w) == 5  # routing sees the waiting ones too
    for rid in ("r1", "r0", "r2", "r3", "r4"):
        w.finish(rid)
        await until(lambda rid=rid: rid in [r.request_id for r in w.requests], f"{rid} done")
    results = await asyncio.gather(*tasks)
    assert [r.request_id for r in results] == [f"r{i}" for i in range(5)]
    assert [r.request_id for r in w.requests] == ["r1", "r0", "r2", "r3", "r4"]
    assert list(w.gates) == ["r0", "r1", "r2", "r3", "r4"]  # sent in arrival order
    assert w.max_outstanding == 2
    assert proxy._window.in_flight["w"] == 0


async def test_without_a_limit_every_request_is_sent_at_once() -> None:
    w = HeldWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"})
    tasks = [asyncio.create_task(proxy.generate(f"t{i}", "d", *req(f"r{i}"))) for i in range(5)]
    await until(lambda: len(w.gates) == 5, "all sent")
    for rid in list(w.gates):
        w.finish(rid)
    await asyncio.gather(*tasks)
    assert proxy.num_window_waits == 0


async def test_the_timeout_of_a_waiting_request_starts_when_it_is_sent() -> None:
    w = HeldWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"}, max_generate_in_flight=1)
    first = asyncio.create_task(proxy.generate("t0", "d", *req("r0")))
    second = asyncio.create_task(proxy.generate("t1", "d", *req("r1"), timeout_s=0.05))
    await until(lambda: proxy.num_window_waits == 1, "second waits")
    await asyncio.sleep(0.3)  # the second has now waited 6x its timeout, unsent
    assert not second.done()
    w.finish("r0")
    w.finish("r1")  # answers as soon as it is sent
    assert (await second).request_id == "r1"
    await first
    # Once sent, the timeout does apply.
    with pytest.raises(RemoteTimeoutError):
        await proxy.generate("t2", "d", *req("r2"), timeout_s=0.05)
    assert proxy._window.in_flight["w"] == 0


async def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    w = HeldWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"}, max_generate_in_flight=1)
    first = asyncio.create_task(proxy.generate("t0", "d", *req("r0")))
    waiter = asyncio.create_task(proxy.generate("t1", "d", *req("r1")))
    await until(lambda: proxy.num_window_waits == 1, "second waits")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    w.finish("r0")
    await first
    assert "r1" not in w.gates  # never sent
    w.finish("r2")
    assert (await proxy.generate("t2", "d", *req("r2"))).request_id == "r2"
    assert proxy._window.in_flight["w"] == 0


async def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_passes_on() -> None:
    window = SendWindow(["w"], 1)
    assert window.try_acquire("w")
    second = asyncio.create_task(window.wait("w"))
    third = asyncio.create_task(window.wait("w"))
    await until(lambda: window.waiting("w") == 2, "both wait")
    window.release("w")  # the slot is now the second's...
    second.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await third is True
    assert window.in_flight["w"] == 1
    window.release("w")
    assert window.in_flight["w"] == 0
    assert window.try_acquire("w")


async def test_waiters_of_a_removed_worker_route_to_the_rest_of_the_pool() -> None:
    a, b = HeldWorker("a"), HeldWorker("b")
    proxy = LLMProxy({"P": ("cpu", [a, b])}, {"d": "P"}, max_generate_in_flight=1)
    a.finish("warm")
    await proxy.generate("t1", "d", *req("warm"))  # t1 is now sticky to a
    busy = asyncio.create_task(proxy.generate("t0", "d", *req("r0")))
    await until(lambda: "r0" in a.gates, "t0 holds a's slot")  # least loaded: a (b has 0)...
    waiter = asyncio.create_task(proxy.generate("t1", "d", *req("r1")))
    await until(lambda: proxy.num_window_waits == 1, "t1 waits for a")
    proxy.remove_worker("a", "test")
    b.finish("r1")
    assert (await waiter).request_id == "r1"
    assert [r.request_id for r in b.requests] == ["r1"]
    a.finish("r0")
    await busy
    # A pool left empty while requests wait fails them as fatal, not silently.
    c = HeldWorker("c")
    solo = LLMProxy({"P": ("cpu", [c])}, {"d": "P"}, max_generate_in_flight=1)
    held = asyncio.create_task(solo.generate("t0", "d", *req("r0")))
    waiting = asyncio.create_task(solo.generate("t1", "d", *req("r1")))
    await until(lambda: solo.num_window_waits == 1, "t1 waits for c")
    solo.remove_worker("c", "test")
    with pytest.raises(PoolExhaustedError):
        await waiting
    c.finish("r0")
    await held


async def test_a_slot_freed_by_the_reply_that_quarantines_its_worker_is_not_used_there() -> None:
    # The bad reply releases its slot (handing it to the waiter) before it is judged and
    # the worker quarantined: the waiter must route again, not send to the quarantined one.
    a, b = HeldWorker("a"), HeldWorker("b")
    a.respond = lambda r: "ok"  # token ids >= 50: out of this vocabulary
    b.respond = lambda r: "\x01"
    proxy = LLMProxy({"P": ("cpu", [a, b])}, {"d": "P"}, max_generate_in_flight=1, vocab_size=50,
                     violations=ViolationWindow(1, 1))
    t0 = asyncio.create_task(proxy.generate("t0", "d", *req("r0")))
    await until(lambda: "r0" in a.gates, "r0 on a")
    tb = asyncio.create_task(proxy.generate("tb", "d", *req("rb")))
    await until(lambda: "rb" in b.gates, "rb on b")
    t1 = asyncio.create_task(proxy.generate("t1", "d", *req("r1")))  # equal load: a, waits
    await until(lambda: proxy.num_window_waits == 1, "t1 waits for a")
    a.finish("r0")
    with pytest.raises(InvalidWorkerOutput):
        await t0
    assert proxy.quarantined == ["a"]
    b.finish("rb")
    b.finish("r1")
    await asyncio.wait_for(tb, 30)
    assert (await asyncio.wait_for(t1, 30)).request_id == "r1"
    assert "r1" not in a.gates and [r.request_id for r in b.requests] == ["rb", "r1"]
    assert proxy._window.in_flight == {"a": 0, "b": 0}


async def test_a_worker_that_answers_keeps_its_waiters_through_a_timeout() -> None:
    # One request times out: the requests waiting behind it are sent in turn, not failed.
    w = HeldWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"}, max_generate_in_flight=2)
    slow = asyncio.create_task(proxy.generate("t0", "d", *req("r0"), timeout_s=0.3))
    fast = asyncio.create_task(proxy.generate("t1", "d", *req("r1")))
    waiter = asyncio.create_task(proxy.generate("t2", "d", *req("r2")))
    await until(lambda: proxy.num_window_waits == 1, "t2 waits")
    w.finish("r1")
    await fast
    await until(lambda: "r2" in w.gates, "r2 sent in r1's slot")
    with pytest.raises(RemoteTimeoutError):
        await slow
    w.finish("r2")
    assert (await waiter).request_id == "r2"


async def test_cancelled_waiters_are_not_routing_load() -> None:
    a, b = HeldWorker("a"), HeldWorker("b")
    proxy = LLMProxy({"P": ("cpu", [a, b])}, {"d": "P"}, max_generate_in_flight=1)
    held = asyncio.create_task(proxy.generate("t0", "d", *req("r0")))
    await until(lambda: "r0" in a.gates, "r0 on a")
    a.finish("warm")
    waiters = []
    for i in range(5):  # sticky to a by an answered turn each, then waiting there
        proxy._sticky[f"s{i}"] = a
        waiters.append(asyncio.create_task(proxy.generate(f"s{i}", "d", *req(f"q{i}"))))
    await until(lambda: proxy._window.waiting("a") == 5, "five wait")
    assert proxy.load(a) == 6
    for t in waiters:
        t.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert proxy._window.waiting("a") == 0 and proxy.load(a) == 1
    a.finish("r0")
    await held


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        SendWindow(["w"], 0)
