"""LLM proxy: affinity, least-loaded + sticky routing, dead-worker re-route, abort, weight sync."""

from __future__ import annotations

import array
import asyncio
import logging

import pytest

from helpers.fakes import FakeWorker
from rollart.controller.routing.proxy import LLMProxy, PoolExhaustedError
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import ConfigError, RemoteError


def req(rid: str) -> tuple[str, array.array, m.SamplingParams]:
    """``proxy.generate``'s request arguments: request id, whole prompt, sampling."""
    return rid, array.array("i", [1, 2, 3]), m.SamplingParams(max_tokens=8)


def stats(name: str, running: int) -> m.WorkerStats:
    return m.WorkerStats(worker=name, num_running=running, num_waiting=0, version=0)


def two_pools():
    a1, a2, b1 = FakeWorker("a1"), FakeWorker("a2"), FakeWorker("b1")
    proxy = LLMProxy({"A": ("h800", [a1, a2]), "B": ("h20", [b1])},
                     {"prefill_heavy": "A", "decode_heavy": "B"})
    return proxy, a1, a2, b1


async def test_domain_affinity_picks_the_pool() -> None:
    proxy, a1, a2, b1 = two_pools()
    await proxy.generate("t1", "decode_heavy", *req("r1"))
    await proxy.generate("t2", "prefill_heavy", *req("r2"))
    assert [r.request_id for r in b1.requests] == ["r1"]
    assert len(a1.requests) + len(a2.requests) == 1
    assert proxy.pool_of("decode_heavy").hardware == "h20"


async def test_set_affinity_moves_a_domain_and_rejects_unknown_pools() -> None:
    proxy, a1, a2, b1 = two_pools()
    proxy.set_affinity("decode_heavy", "A")
    await proxy.generate("t1", "decode_heavy", *req("r1"))
    assert b1.requests == []
    with pytest.raises(ConfigError, match="unknown pool 'C'"):
        proxy.set_affinity("decode_heavy", "C")
    with pytest.raises(ConfigError, match="unknown pool"):
        LLMProxy({"A": ("cpu", [FakeWorker("x")])}, {"d": "nope"})


async def test_least_loaded_uses_reported_and_local_load() -> None:
    proxy, a1, a2, _ = two_pools()
    a1.last_stats = stats("a1", 5)  # busy with other clients' work
    a2.last_stats = stats("a2", 1)
    assert proxy.route("t1", "prefill_heavy") is a2
    # Local in-flight requests count even before any report reflects them.
    a1.last_stats, a2.last_stats = stats("a1", 0), stats("a2", 0)
    a1.latency_s = a2.latency_s = 10.0
    tasks = [asyncio.create_task(proxy.generate(f"t{i}", "prefill_heavy", *req(f"r{i}")))
             for i in range(10, 14)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert (len(a1.requests), len(a2.requests)) == (2, 2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_sticky_per_trajectory_even_when_another_worker_is_idler() -> None:
    proxy, a1, a2, _ = two_pools()
    await proxy.generate("t1", "prefill_heavy", *req("r1"))
    first = a1 if a1.requests else a2
    other = a2 if first is a1 else a1
    first.last_stats, other.last_stats = stats(first.name, 9), stats(other.name, 0)
    await proxy.generate("t1", "prefill_heavy", *req("r2"))
    assert [r.request_id for r in first.requests] == ["r1", "r2"]
    proxy.release("t1")
    first.last_stats = stats(first.name, 9)  # its reply refreshed the stats
    await proxy.generate("t1", "prefill_heavy", *req("r3"))
    assert [r.request_id for r in other.requests] == ["r3"]


async def test_dead_worker_is_removed_and_its_request_rerouted() -> None:
    proxy, a1, a2, _ = two_pools()
    a1.latency_s = 0.05
    a2.last_stats = stats("a2", 3)  # so the first request goes to a1
    task = asyncio.create_task(proxy.generate("t1", "prefill_heavy", *req("r1")))
    for _ in range(10):
        await asyncio.sleep(0)
    assert [r.request_id for r in a1.requests] == ["r1"]
    a1.kill()  # dies mid-request: the fake raises PeerDeadError when it wakes
    result = await task
    assert result.request_id == "r1" and [r.request_id for r in a2.requests] == ["r1"]
    assert proxy.pools["A"].removed == ["a1"] and proxy.num_rerouted == 1
    # Later routing never picks it again; sticky entries to it are gone.
    await proxy.generate("t1", "prefill_heavy", *req("r2"))
    assert len(a1.requests) == 1


@pytest.mark.parametrize("stopping", [False, True])
async def test_a_worker_lost_while_the_run_stops_is_not_reported_again(caplog, stopping) -> None:
    """Once the owner found the fatal fault (``Controller.stop_soon``: the launcher reports the
    dead process, once), a request failing on that worker removes it at INFO: a WARNING would
    print the launcher's message a second time on the console (``rollart run`` shows WARNING)."""
    proxy, a1, a2, _ = two_pools()
    proxy.stopping = stopping
    a1.latency_s = 0.05
    a2.last_stats = stats("a2", 3)
    task = asyncio.create_task(proxy.generate("t1", "prefill_heavy", *req("r1")))
    for _ in range(10):
        await asyncio.sleep(0)
    caplog.set_level(logging.INFO, logger="rollart.controller.routing.proxy")
    a1.kill()
    await task
    removals = [r for r in caplog.records if "worker a1 removed" in r.getMessage()]
    assert len(removals) == 1 and "died during r1" in removals[0].getMessage()
    assert removals[0].levelno == (logging.INFO if stopping else logging.WARNING)
    # A live worker taken out (quarantined for its output) is news, stopping or not.
    with pytest.raises(PoolExhaustedError):
        proxy.quarantine("b1", "bad replies")
    (quarantined,) = [r for r in caplog.records if "worker b1 removed" in r.getMessage()]
    assert quarantined.levelno == logging.WARNING


async def test_pool_exhausted_is_fatal_and_distinct() -> None:
    proxy, _, _, b1 = two_pools()
    b1.kill()
    with pytest.raises(PoolExhaustedError, match="pool 'B'"):
        await proxy.generate("t1", "decode_heavy", *req("r1"))


async def test_cancelling_the_caller_aborts_the_request() -> None:
    proxy, _, _, b1 = two_pools()
    b1.latency_s = 30.0
    task = asyncio.create_task(proxy.generate("t1", "decode_heavy", *req("r1")))
    for _ in range(10):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b1.aborted == ["r1"]
    assert proxy.load(b1) == 0  # local in-flight count released


async def test_pause_apply_resume_on_every_worker() -> None:
    proxy, a1, a2, b1 = two_pools()
    await proxy.pause()
    b1_task = asyncio.create_task(proxy.generate("t1", "decode_heavy", *req("r1")))
    await asyncio.sleep(0.01)
    assert not b1_task.done()  # paused: the request waits
    applied = await proxy.apply_weights(3, reprefill=True)
    assert [w.version for w in applied] == [3, 3, 3] and proxy.version == 3
    assert a1.applied == a2.applied == b1.applied == [(3, True)]
    await proxy.resume()
    result = await b1_task
    assert set(tb.view_i32(result.versions).tolist()) == {3}


async def test_a_worker_dying_in_a_staggered_apply_leaves_no_other_worker_behind() -> None:
    workers = [FakeWorker(f"a{i}") for i in range(1, 5)]
    proxy = LLMProxy({"A": ("cpu", workers)}, {"d": "A"})
    workers[0].kill()  # wave 0 = a1, a3: a1 is found dead and removed during the first wave
    await proxy.apply_in_waves(1, 2)
    assert proxy.pools["A"].removed == ["a1"]
    # every live worker applied the version exactly once (not a3 twice and a2 / a4 never)
    assert [w.applied for w in workers[1:]] == [[(1, False)]] * 3
    assert proxy.version == 1


async def test_weight_sync_drops_dead_workers_but_fails_on_an_empty_pool() -> None:
    proxy, a1, _, b1 = two_pools()
    a1.kill()
    await proxy.apply_weights(1)
    assert proxy.pools["A"].removed == ["a1"]
    b1.kill()
    with pytest.raises(PoolExhaustedError):
        await proxy.apply_weights(2)


async def test_releases_of_a_failed_request_are_sent_again() -> None:
    w = FakeWorker("w")
    proxy = LLMProxy({"P": ("cpu", [w])}, {"d": "P"})
    await proxy.generate("t1", "d", *req("r1"))
    proxy.release("t1")  # rides on the next request to w
    inner = w.generate

    async def refuse(request, *, timeout_s=None):
        raise RemoteError("bad_request", "refused before its prompt was read")

    w.generate = refuse  # type: ignore[method-assign]
    with pytest.raises(RemoteError, match="refused"):
        await proxy.generate("t2", "d", *req("r2"))
    w.generate = inner  # type: ignore[method-assign]
    await proxy.generate("t3", "d", *req("r3"))
    assert sorted(w.requests[-1].release) == ["t1", "t2"]


@pytest.mark.looptime
async def test_a_worker_dying_after_its_domain_moved_leaves_its_own_pool() -> None:
    proxy, a1, a2, b1 = two_pools()
    a1.latency_s = 10.0  # t1's turn is in flight on a1 when the domain moves
    turn = asyncio.create_task(proxy.generate("t1", "prefill_heavy", *req("r1")))
    for _ in range(10):
        await asyncio.sleep(0)
    assert [r.request_id for r in a1.requests] == ["r1"]
    proxy.set_affinity("prefill_heavy", "B")
    a1.kill()
    result = await asyncio.wait_for(turn, 30)  # re-sent, now to the domain's pool B
    assert result.request_id == "r1" and [r.request_id for r in b1.requests] == ["r1"]
    assert proxy.pools["A"].workers == [a2] and proxy.pools["A"].removed == ["a1"]
