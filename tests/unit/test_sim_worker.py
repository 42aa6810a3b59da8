"""The simulated inference worker: timing by the cost model, batching, abort, pause, weights."""

from __future__ import annotations

import asyncio

import pytest

from rollart.sim import costs
from rollart.sim.clock import run_virtual
from rollart.sim.hardware import H800
from rollart.sim.models import QWEN3_8B
from rollart.sim.trainer import SimTensor, SimTrainer
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import (
    EOS_TOKEN_ID,
    Dist,
    DomainSpec,
    DomainTable,
    SimTokenizer,
    const,
    observation,
)
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError

TABLE = DomainTable([DomainSpec("fixed", response_tokens=const(100)),
                     DomainSpec("long", response_tokens=const(5000)),
                     DomainSpec("varied", response_tokens=Dist("lognormal", 300, 200, 1, 1e9))])
TOK = SimTokenizer(TABLE)


def _worker(**kw) -> SimInferenceWorker:
    kw.setdefault("max_batch", 64)
    return SimInferenceWorker("w0", hardware=H800, model=QWEN3_8B, domains=TABLE, **kw)


def _req(rid: str, domain: str = "fixed", prompt: int = 999, max_tokens: int = 4096,
         ids: list[int] | None = None) -> m.Generate:
    ids = ids if ids is not None else TOK.encode(observation(domain, prompt, tag=rid))
    return m.Generate(request_id=rid, new_token_ids=tb.pack_i32(ids),
                      sampling=m.SamplingParams(max_tokens=max_tokens))


def ids_of(res: m.GenerateResult) -> list[int]:
    return tb.view_i32(res.token_ids).tolist()


def versions_of(res: m.GenerateResult) -> list[int]:
    return tb.view_i32(res.versions).tolist()


def _step(batch: int, kv: float) -> float:
    return costs.decode_step_s(QWEN3_8B, H800, batch, kv)


def test_single_request_time_is_prefill_plus_decode_steps() -> None:
    async def main():
        w = _worker()
        res = await w.generate(_req("a"))
        return res, asyncio.get_running_loop().time()

    res, t = run_virtual(main)
    assert len(ids_of(res)) == 100 and res.finish_reason == "stop"
    assert ids_of(res)[-1] == EOS_TOKEN_ID
    assert versions_of(res) == [0] * 100 and res.num_tokens == 100 and len(res.logprobs) == 400
    assert res.num_prompt_tokens == 1000
    # Prefill of 1000 tokens emits token 1; 99 decode steps hold 1001..1099 cached tokens,
    # whose mean is 1050: time = prefill + 99 * step(kv=1050).
    expected = costs.prefill_s(QWEN3_8B, H800, 1000) + 99 * _step(1, 1050)
    assert t == pytest.approx(expected, abs=1e-5)


def test_max_tokens_truncates_with_length() -> None:
    async def main():
        return await _worker().generate(_req("a", max_tokens=10))

    res = run_virtual(main)
    assert len(ids_of(res)) == 10 and res.finish_reason == "length"
    assert EOS_TOKEN_ID not in ids_of(res)


def test_batching_shares_steps() -> None:
    async def n_requests(n: int) -> float:
        w = _worker()
        await asyncio.gather(*(w.generate(_req(f"r{i}")) for i in range(n)))
        return asyncio.get_running_loop().time()

    one = run_virtual(lambda: n_requests(1))
    eight = run_virtual(lambda: n_requests(8))
    # Decode is memory-bound: 8 sequences cost far less than 8x one (weights read once/step).
    assert one < eight < 2 * one


def test_max_batch_limits_concurrency() -> None:
    async def main(max_batch: int) -> float:
        w = _worker(max_batch=max_batch)
        await asyncio.gather(*(w.generate(_req(f"r{i}")) for i in range(4)))
        return asyncio.get_running_loop().time()

    assert run_virtual(lambda: main(1)) > 3 * run_virtual(lambda: main(4))


def test_late_arrival_joins_at_a_step_boundary() -> None:
    async def main():
        w = _worker()
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(1.0)
        t0 = loop.time()
        await w.generate(_req("b"))
        late = loop.time() - t0
        await first
        return late

    late = run_virtual(main)
    # b waits at most one decode step, then prefills and decodes 99 steps batched with a.
    lower = costs.prefill_s(QWEN3_8B, H800, 1000) + 99 * _step(2, 0)
    upper = lower + _step(2, 20_000) * 101
    assert lower < late < upper


def test_abort_returns_partial_tokens() -> None:
    async def main():
        w = _worker()
        task = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(1.0)
        await w.abort("a")
        res = await task
        stats = await w.stats()
        return res, stats

    res, stats = run_virtual(main)
    assert res.finish_reason == "abort"
    # ~1 s of decoding at ~7.6 ms per step (prefill 33 ms first).
    assert 100 < len(ids_of(res)) < 200
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_cancel_aborts_and_timeout_raises() -> None:
    async def main():
        w = _worker()
        task = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await w.stats()).num_running == 0
        with pytest.raises(RemoteTimeoutError):
            await w.generate(_req("b", domain="long"), timeout_s=0.5)
        return await w.stats()

    stats = run_virtual(main)
    assert stats.num_running == 0


def test_pause_apply_resume_marks_versions_and_checks_staging() -> None:
    async def main():
        w = _worker()
        trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8)
        with pytest.raises(RemoteError) as err:
            await w.apply_weights(1)
        assert err.value.code == "incomplete_version"
        await trainer.train([_Fake(1000)])
        await trainer.push_weights(1, [w])
        task = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(1.0)
        await w.pause("keep")
        paused_tokens = (await w.stats()).num_generated_tokens
        await asyncio.sleep(5.0)
        assert (await w.stats()).num_generated_tokens == paused_tokens  # nothing while paused
        applied = await w.apply_weights(1)
        with pytest.raises(RemoteError) as err:
            await w.apply_weights(1)
        assert err.value.code == "stale_version"
        await w.resume()
        return await task, applied

    res, applied = run_virtual(main)
    assert applied.version == 1
    # 16.4e9 B host -> device at 25e9 B/s
    assert applied.apply_time_s == pytest.approx(0.656)
    assert versions_of(res)[0] == 0 and versions_of(res)[-1] == 1
    vs = versions_of(res)
    assert vs == sorted(vs) and len(vs) == 4096  # max_tokens


class _Fake:
    def __init__(self, n: int) -> None:
        self.num_tokens = n


def test_pause_abort_returns_everything() -> None:
    async def main():
        w = _worker(max_batch=1)
        tasks = [asyncio.ensure_future(w.generate(_req(f"r{i}", domain="long"))) for i in range(3)]
        await asyncio.sleep(0.5)
        await w.pause("abort")
        return [await t for t in tasks]

    results = run_virtual(main)
    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert len(ids_of(results[0])) > 0 and len(ids_of(results[2])) == 0


def test_kill_raises_peer_dead() -> None:
    async def main():
        w = _worker()
        task = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(0.1)
        w.kill()
        with pytest.raises(PeerDeadError):
            await task
        with pytest.raises(PeerDeadError):
            await w.generate(_req("b"))
        assert w.dead

    run_virtual(main)


def test_prefix_cache_skips_the_cached_prompt() -> None:
    async def main(cache: bool) -> float:
        w = _worker(prefix_cache=cache)
        loop = asyncio.get_running_loop()
        first = await w.generate(_req("t1", prompt=8000))
        turn2 = first_prompt = TOK.encode(observation("fixed", 8000, tag="t1"))
        turn2 = first_prompt + ids_of(first) + TOK.encode(observation("fixed", 50))
        t0 = loop.time()
        await w.generate(_req("t2", ids=turn2))
        return loop.time() - t0

    cached, uncached = run_virtual(lambda: main(True)), run_virtual(lambda: main(False))
    # Turn 2 = 8001 prompt + 100 generated + 51 new tokens; the cache holds the first 8101, so
    # only 51 tokens are computed, attending the 8101 cached ones.
    saved = costs.prefill_s(QWEN3_8B, H800, 8152) - costs.prefill_s(QWEN3_8B, H800, 51,
                                                                    context=8101)
    assert uncached - cached == pytest.approx(saved, rel=1e-3)


def test_prefix_cache_shares_the_kv_pool_and_is_evicted() -> None:
    async def main(memory_utilization: float) -> SimInferenceWorker:
        w = _worker(memory_utilization=memory_utilization)
        first = await w.generate(_req("t1", prompt=2000))
        # A 3000-token request needs the pool the cached 2101 tokens of t1 occupy.
        await w.generate(_req("big", prompt=3000))
        turn2 = TOK.encode(observation("fixed", 2000, tag="t1")) + ids_of(first) \
            + TOK.encode(observation("fixed", 50))
        await w.generate(_req("t2", ids=turn2))
        return w

    # 4_069 tokens of KV (see the preemption test): t1's 2_101 cached + big's 3_101 do not fit.
    small = run_virtual(lambda: main(0.2125))
    assert small.cache_evicted_tokens >= 2101 and small.prefix_hit_tokens == 0
    large = run_virtual(lambda: main(0.9))
    assert large.cache_evicted_tokens == 0 and large.prefix_hit_tokens == 2101


def test_chunked_prefill_shares_iterations_with_decode() -> None:
    async def main(budget: int) -> int:
        w = _worker(max_num_batched_tokens=budget)
        long = asyncio.ensure_future(w.generate(_req("a", domain="long", max_tokens=5000)))
        await asyncio.sleep(1.0)
        # 20_001 prompt tokens; with a budget of 8192 they take three iterations
        # (8191 + 8191 + 3619; the decoding request takes one token of each budget).
        await w.generate(_req("b", prompt=20_000, max_tokens=1))
        progress = w._running["a"].generated
        long.cancel()
        return progress

    chunked, whole = run_virtual(lambda: main(8192)), run_virtual(lambda: main(100_000))
    # Same progress before b arrives; then three mixed iterations vs one.
    assert chunked - whole == 2


def test_preemption_under_small_kv_cache_still_completes() -> None:
    async def main():
        # (80e9 * 0.2125 - 16.4e9) / 147_456 = 0.6e9 / 147_456 = 4_069 tokens of KV cache,
        # less than the 3 x 2_000 tokens the three requests grow to: preemption must happen.
        w = _worker(memory_utilization=0.2125)
        assert w.capacity == 4_069
        return await asyncio.gather(*(w.generate(_req(f"r{i}", prompt=999, max_tokens=1000,
                                                      domain="long")) for i in range(3)))

    results = run_virtual(main)
    assert [len(ids_of(r)) for r in results] == [1000] * 3


def test_prompt_over_capacity_is_a_bad_request() -> None:
    async def main():
        w = _worker(memory_utilization=0.2125)
        with pytest.raises(RemoteError, match="exceeds the KV cache") as info:
            await w.generate(_req("big", prompt=10_000))
        assert info.value.code == "bad_request"  # the input's fault: no quarantine count

    run_virtual(main)


def test_lengths_depend_on_seed_and_request_not_order() -> None:
    async def main(order: list[int], seed: int) -> dict[str, int]:
        w = _worker(seed=seed)
        res = await asyncio.gather(*(w.generate(_req(f"r{i}", domain="varied")) for i in order))
        return {r.request_id: len(ids_of(r)) for r in res}

    a = run_virtual(lambda: main([0, 1, 2, 3], 7))
    b = run_virtual(lambda: main([3, 2, 1, 0], 7))
    c = run_virtual(lambda: main([0, 1, 2, 3], 8))
    assert a == b and a != c


def test_push_weights_takes_bytes_over_link() -> None:
    async def main():
        w = _worker()
        loop = asyncio.get_running_loop()
        await w.push_weights(1, [("x", SimTensor(50_000_000_000))], bucket_bytes=1 << 30)
        return loop.time()

    # 50e9 B / 25e9 B/s (200 Gb Ethernet)
    assert run_virtual(main) == pytest.approx(2.0)


def test_duplicate_request_id_is_rejected_until_done() -> None:
    async def main():
        w = _worker()
        task = asyncio.ensure_future(w.generate(_req("a")))
        await asyncio.sleep(0)
        with pytest.raises(RemoteError) as err:
            await w.generate(_req("a"))
        assert err.value.code == "bad_request"
        await task
        return await w.generate(_req("a"))  # finished ids may be reused

    assert run_virtual(main).finish_reason == "stop"


def test_zero_time_scale_answers_without_simulated_time() -> None:
    async def main():
        w = _worker(time_scale=0.0)
        res = await w.generate(_req("a"))
        return res, asyncio.get_running_loop().time()

    res, t = run_virtual(main)
    assert len(ids_of(res)) == 100 and t == 0.0


def test_trainer_pushes_share_the_trainer_egress() -> None:
    async def main(egress: float | None) -> float:
        workers = [SimInferenceWorker(f"w{i}", hardware=H800, model=QWEN3_8B, domains=TABLE)
                   for i in range(4)]
        trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8,
                             egress_bytes_per_s=egress)
        await trainer.train([_Fake(1000)])
        t0 = asyncio.get_running_loop().time()
        await trainer.push_weights(1, workers)
        assert all(w._staged == {1: QWEN3_8B.weight_bytes} for w in workers)
        return asyncio.get_running_loop().time() - t0

    # Own links: 16.4e9 B / 25e9 B/s each, in parallel.
    assert run_virtual(lambda: main(None)) == pytest.approx(0.656)
    # One 25e9 B/s egress shared by 4 pulls: 4 x 16.4e9 / 25e9.
    assert run_virtual(lambda: main(25e9)) == pytest.approx(4 * 0.656)
    # A wide egress: each pull is bounded by its own link again.
    assert run_virtual(lambda: main(1e12)) == pytest.approx(0.656)


def test_reprefill_recomputes_every_running_request() -> None:
    async def main() -> tuple[int, int]:
        w = _worker()
        trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8)
        await trainer.train([_Fake(1000)])
        await trainer.push_weights(1, [w])
        task = asyncio.ensure_future(w.generate(_req("a", domain="long")))
        await asyncio.sleep(1.0)
        await w.pause("keep")
        before = w.prefill_tokens
        kv = w._running["a"].kv_tokens
        await w.apply_weights(1, reprefill=True)
        await w.resume()
        await task
        return w.prefill_tokens - before, kv

    recomputed, kv = run_virtual(main)
    assert recomputed == kv


def test_prefix_cache_evicts_least_recently_used_but_never_the_kept_hit() -> None:
    from rollart.sim.prefix_cache import PrefixCache

    cache = PrefixCache()
    a, b = list(range(100)), list(range(1000, 1050))
    cache.add(a)
    cache.add(b)
    hit = cache.lookup(a + [7, 8])  # a is now the most recently used
    assert hit is not None and cache.length(hit) == 100 and cache.lookup([5]) is None
    # 120 running tokens + 150 cached > 250: evicting b (LRU) is enough.
    assert cache.evict_for(120, 250, keep=hit)
    assert cache.tokens == 100 and cache.evicted_tokens == 50
    # The kept hit is never evicted, even when the pool cannot fit.
    assert not cache.evict_for(160, 250, keep=hit) and cache.tokens == 100
    assert cache.evict_for(160, 250) and cache.tokens == 0 and len(cache) == 0


def test_a_request_holds_its_prompt_as_the_wire_bytes_not_a_list() -> None:
    async def main():
        w = _worker()
        await w.pause("keep")
        task = asyncio.create_task(w.generate(_req("r0", prompt=5000)))
        await asyncio.sleep(0)
        (req,) = [*w._waiting, *w._running.values()]
        prompt = req.prompt
        await w.resume()
        res = await task
        return prompt, req.prompt_bytes, res

    prompt, raw, res = run_virtual(main)
    # No per-token Python objects for a 5000-token prompt: a view of the received bytes.
    assert isinstance(prompt, memoryview) and prompt.obj is raw and len(prompt) == 5001
    assert res.num_prompt_tokens == 5001 and res.finish_reason == "stop"


def test_prefix_cache_takes_int32_bytes_and_lists_alike() -> None:
    from rollart.sim.prefix_cache import PrefixCache
    from rollart.transport import tokenbytes as tb

    cache = PrefixCache()
    seq = list(range(40, 140))
    cache.add(tb.pack_i32(seq))
    cache.add(seq)  # the same sequence: one entry
    assert len(cache) == 1 and cache.tokens == 100
    hit = cache.lookup(tb.pack_i32([*seq, 1, 2]))
    assert hit is not None and hit == cache.lookup([*seq, 1, 2]) and cache.length(hit) == 100
    # A prompt sharing only the head is no hit; a shorter prompt cannot hold the entry.
    assert cache.lookup(tb.pack_i32([*seq[:50], 7, *seq[51:], 1])) is None
    assert cache.lookup(tb.pack_i32(seq[:99])) is None


def test_pause_and_resume_update_the_stats_routing_reads() -> None:
    """Routing reads ``last_stats``; after a resume a pool must not read as paused until its
    next reply (online affinity never moves a paused pool's domain), as a real worker's
    client does on Pause / Resume."""
    async def main():
        w = _worker()
        await w.generate(_req("a"))
        assert w.last_stats is not None and not w.last_stats.paused
        await w.pause()
        assert w.last_stats.paused
        await w.resume()
        return w.last_stats

    stats = run_virtual(main)
    assert stats is not None and not stats.paused
