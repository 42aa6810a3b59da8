"""The inference worker as a real subprocess (``python -m rollart.inference.worker``) on vLLM.

One module-scoped worker serves most tests (engine start-up takes ~15-30 s on 2 cores); tests
read the worker's current version instead of assuming one, so they do not depend on order, except
the last test, which kills that worker. That a worker exits non-zero when its engine core dies
is checked on the worker of ``test_security_transport`` (an engine start-up fewer).
"""

from __future__ import annotations

import array
import asyncio
import struct
import time

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from polling import wait_for

from rollart.controller.routing.proxy import LLMProxy
from rollart.inference.client import InferenceClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import PeerDeadError, RemoteError
from rollart.transport.rpc import RpcClient
from rollart.transport.security import env_credentials
from rollart.weights.buckets import crc32_hex, plan_buckets, tensor_to_frame

pytestmark = pytest.mark.vllm

WORKER = "rollart.inference.worker"
PROMPT = [2, 60, 79, 72, 72, 75, 3]  # "<|im_start|>Hello<|im_end|>" style ids; any in-vocab ids do
#: vLLM's prompt logprobs vs transformers' log_softmax, both float32 on CPU, same weights. The
#: kernels differ (oneDNN GEMM, vLLM attention vs eager PyTorch), so not bit-equal; measured
#: differences are ~1e-6, a wrong or stale weight moves them by ~1e-1.
LOGPROB_ATOL = 1e-4
#: max_tokens of a request still running when the test acts on it (one request decodes at
#: ~600 tokens/s on the 2-core development machine: 2000 tokens take > 3 s)
LONG = 2000


@pytest.fixture(scope="module")
def worker(tiny_model_dir, service_starter, tmp_path_factory):
    service = service_starter(
        WORKER,
        [
            "--model",
            str(tiny_model_dir),
            "--name",
            "w0",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "64",
        ],
        log_dir=tmp_path_factory.mktemp("worker"),
    )

    async def warm_up() -> None:
        # vLLM's first request pays one-off compilation (~2 s): keep it out of timed tests.
        async with InferenceClient(service.address, name="w0", heartbeat_interval_s=0, auth=env_credentials()) as c:
            await c.generate(gen("warm-up", 4))

    asyncio.run(warm_up())
    yield service
    service.stop()


@pytest.fixture
async def client(worker):
    c = InferenceClient(
        worker.address,
        name="w0",
        default_timeout_s=120,
        heartbeat_interval_s=0.5,
        # generous: the shared 2-core machine can starve a process for seconds
        liveness_timeout_s=15,
        auth=env_credentials(),
    )
    yield c
    await c.close()


def gen(rid: str, max_tokens: int, **sampling) -> m.Generate:
    return m.Generate(
        request_id=rid,
        new_token_ids=tb.pack_i32(PROMPT),
        sampling=m.SamplingParams(max_tokens=max_tokens, **sampling),
    )


def ids_of(r: m.GenerateResult) -> list[int]:
    return tb.view_i32(r.token_ids).tolist()


def versions_of(r: m.GenerateResult) -> list[int]:
    return tb.view_i32(r.versions).tolist()


def logprobs_of(r: m.GenerateResult) -> list[float]:
    return tb.view_f32(r.logprobs).tolist()


async def started(client: InferenceClient, *tasks: asyncio.Task, timeout_s: float = 20.0):
    """Wait until the worker holds ``len(tasks)`` requests; fail early if one already ended."""
    start = time.monotonic()
    seen = []  # (seconds since start, round trip s, requests in flight): for the failure message
    while time.monotonic() - start < timeout_s:
        for t in tasks:
            if t.done():
                raise AssertionError(
                    f"a request ended before the test acted on it (stats polls: {seen}): "
                    f"{str(t.result())[:300]}"
                )
        sent = time.monotonic()
        stats = await client.stats()
        in_flight = stats.num_running + stats.num_waiting
        seen.append((round(sent - start, 3), round(time.monotonic() - sent, 3), in_flight))
        if in_flight >= len(tasks):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{len(tasks)} requests not in flight within {timeout_s} s: {seen}")


def check_shape(r: m.GenerateResult) -> None:
    assert len(ids_of(r)) == len(logprobs_of(r)) == len(versions_of(r))
    assert all(lp <= 0.0 for lp in logprobs_of(r))


def submit_long(client: InferenceClient, prefix: str, n: int) -> list[asyncio.Task]:
    return [
        asyncio.create_task(client.generate(gen(f"{prefix}{i}", LONG, seed=i, ignore_eos=True)))
        for i in range(n)
    ]


#: requests sharing every decode step with a test's targets, so LONG tokens take well over 10 s
#: (one request alone: ~3 s; a CI run once starved the test process between its resume and its
#: pause for longer than 4 requests needed to finish).
NUM_LOAD = 12


async def prompt_logprobs(client: InferenceClient, tokens: list[int]) -> list[float]:
    r = await client.generate(
        m.Generate(
            request_id=f"plp-{time.monotonic_ns()}",
            new_token_ids=tb.pack_i32(tokens),
            sampling=m.SamplingParams(max_tokens=1, prompt_logprobs=True),
        )
    )
    assert r.prompt_logprobs is not None and r.prompt_logprobs[0] is None
    assert len(r.prompt_logprobs) == len(tokens)
    return [float(x) for x in r.prompt_logprobs[1:]]


def new_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    from rollart.models.tiny import TinyModelSpec, init_tiny_model

    model = init_tiny_model(TinyModelSpec(seed=seed))
    # state_dict has the tied lm_head.weight too: the worker must accept and drop it.
    return list(model.state_dict().items())


def transformers_logprobs(named: list[tuple[str, torch.Tensor]], tokens: list[int]) -> list[float]:
    from rollart.models.tiny import TinyModelSpec, init_tiny_model

    model = init_tiny_model(TinyModelSpec(seed=12345))
    model.load_state_dict(dict(named))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, t].item() for i, t in enumerate(tokens[1:])]


async def raw_bucket(
    rpc: RpcClient, version: int, index: int, num: int, named, *, checksum: str | None = None
):
    metas, frames = zip(*(tensor_to_frame(n, t) for n, t in named), strict=True)
    msg = m.WeightBucket(
        version=version,
        bucket_index=index,
        num_buckets=num,
        tensors=list(metas),
        checksum=checksum if checksum is not None else crc32_hex(frames),
    )
    return await rpc.call(msg, buffers=list(frames))


# ------------------------------------------------------------------------------------------------


async def test_generate_lengths_versions_and_finish_reasons(client):
    version = (await client.stats()).version
    r = await client.generate(gen("len", 16, temperature=0.0, ignore_eos=True))
    check_shape(r)
    assert r.finish_reason == "length" and len(ids_of(r)) == 16
    assert versions_of(r) == [version] * 16 and r.num_prompt_tokens == len(PROMPT)
    assert r.stats.version == version and r.stats.worker == "w0"
    # Greedy is deterministic, so the first token is known: make it a stop token.
    first = ids_of(r)[0]
    s = await client.generate(gen("stop", 16, temperature=0.0, stop_token_ids=[first]))
    check_shape(s)
    assert s.finish_reason == "stop" and ids_of(s) == [first]
    assert client.last_stats is not None and client.last_stats.num_generated_tokens >= 17


async def test_reports_kv_capacity_and_prefix_cache_hits(client):
    """What the KV working-set hold reads: the engine's KV capacity in tokens (its blocks x
    block size, known once the engine profiled memory), its block size (vLLM's CPU backend:
    128 tokens unless set) and, per request, the prompt tokens served from the prefix cache:
    none the first time, whole blocks of it the second."""
    stats = await client.stats()
    assert stats.kv_capacity_tokens is not None and stats.kv_capacity_tokens >= len(PROMPT)
    assert stats.kv_block_tokens == 128
    assert stats.kv_capacity_tokens % stats.kv_block_tokens == 0
    long_prompt = [20 + (11 * i) % 200 for i in range(200)]
    sp = m.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = await client.generate(m.Generate(
        request_id="cache-a", new_token_ids=tb.pack_i32(long_prompt), sampling=sp))
    again = await client.generate(m.Generate(
        request_id="cache-b", new_token_ids=tb.pack_i32(long_prompt), sampling=sp))
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens is not None and 0 < again.num_cached_tokens < len(long_prompt)


async def test_32_concurrent_generates(client):
    results = await asyncio.gather(
        *(client.generate(gen(f"c{i}", 24, seed=i, ignore_eos=True)) for i in range(32))
    )
    assert [r.request_id for r in results] == [f"c{i}" for i in range(32)]
    for r in results:
        check_shape(r)
        assert r.finish_reason == "length" and len(ids_of(r)) == 24
    assert len({tuple(ids_of(r)) for r in results}) > 1  # different seeds, different samples


async def test_delta_prompts_give_the_same_prompt_as_full_resends(client):
    """Three turns through the controller's proxy: later turns send only the observation, and the
    worker's prompt (its length, vLLM's logprob of every prompt token) and the greedy
    continuation equal those of a request that sends the whole prompt."""
    proxy = LLMProxy({"p": ("cpu", [client])}, {"d": "p"})
    sp = m.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    observation = [61, 62, 63, 64]
    prompt = array.array("i", PROMPT)
    for turn in range(3):
        sent_before = proxy.num_prompt_tokens_sent
        r = await proxy.generate("traj-delta", "d", f"delta-{turn}", prompt, sp)
        full = await client.generate(
            m.Generate(request_id=f"full-{turn}", new_token_ids=prompt.tobytes(), sampling=sp)
        )
        assert r.num_prompt_tokens == full.num_prompt_tokens == len(prompt)
        assert ids_of(r) == ids_of(full)
        assert r.prompt_logprobs is not None and full.prompt_logprobs is not None
        assert r.prompt_logprobs[1:] == pytest.approx(full.prompt_logprobs[1:], abs=LOGPROB_ATOL)
        sent = proxy.num_prompt_tokens_sent - sent_before
        assert sent == (len(PROMPT) if turn == 0 else len(observation))
        prompt.extend(ids_of(r))
        prompt.extend(observation)
    # The worker loses the prefix (as after a restart or an eviction): one whole resend.
    await client.generate(m.Generate(
        request_id="drop", new_token_ids=tb.pack_i32(PROMPT), release=["traj-delta"],
        sampling=m.SamplingParams(max_tokens=1),
    ))
    r = await proxy.generate("traj-delta", "d", "delta-3", prompt, sp)
    assert proxy.num_prefix_resends == 1 and r.num_prompt_tokens == len(prompt)


async def test_abort_long_request_returns_partial_tokens(client):
    # Pauses make this independent of timing (a starved worker could otherwise finish the
    # request before the test acts): started while paused, run ~1 s, frozen, then aborted.
    # 15 more long requests share each decode step, so the target needs well over 10 s for
    # LONG tokens (alone: ~3 s on a quiet machine, and a CI run once starved the test for that).
    await client.pause("keep")
    try:
        task = asyncio.create_task(client.generate(gen("long-abort", LONG, ignore_eos=True)))
        load = submit_long(client, "load-", 15)
        await started(client, task, *load)
        await client.resume()
        await asyncio.sleep(0.5)  # let it produce some tokens
        await client.pause("keep")
        await client.abort("long-abort")
        r = await asyncio.wait_for(task, 10)
    finally:
        for i in range(15):
            await client.abort(f"load-{i}")
        await client.resume()
    await asyncio.wait_for(asyncio.gather(*load, return_exceptions=True), 30)
    check_shape(r)
    assert r.finish_reason == "abort" and 0 < len(ids_of(r)) < LONG
    await client.abort("long-abort")  # idempotent: finished ids are acknowledged


async def test_cancelled_generate_sends_abort(client):
    # While paused the request cannot finish by itself: only the client's Abort removes it.
    await client.pause("keep")
    try:
        task = asyncio.create_task(client.generate(gen("long-cancel", LONG, ignore_eos=True)))
        await started(client, task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def idle():
            s = await client.stats()
            return s.num_running == 0 and s.num_waiting == 0

        await wait_for(idle, timeout_s=10.0)
    finally:
        await client.resume()


async def test_pause_keep_then_resume_finishes_requests(client):
    await client.pause("keep")  # submitted while paused, so none can finish before we look
    tasks = submit_long(client, "keep", 4)
    load = submit_long(client, "keep-load", NUM_LOAD)
    try:
        await started(client, *tasks, *load)
        await client.resume()
        await asyncio.sleep(0.02)  # let the engine schedule them
        await client.pause("keep")
        stats = await client.stats()
        assert stats.paused and stats.num_running + stats.num_waiting == 4 + NUM_LOAD
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in tasks)
        for i in range(NUM_LOAD):
            await client.abort(f"keep-load{i}")
    finally:
        await client.resume()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for r in results:  # kept, not aborted: every request completes its LONG tokens
        check_shape(r)
        assert r.finish_reason == "length" and len(ids_of(r)) == LONG
    assert all(r.finish_reason == "abort" for r in await asyncio.gather(*load))
    assert not (await client.stats()).paused


async def test_pause_abort_returns_partial_and_queues_new_requests(client):
    await client.pause("keep")  # submitted while paused, so none can finish before we look
    tasks = submit_long(client, "pa", 4 + NUM_LOAD)
    try:
        await started(client, *tasks)
        await client.resume()
        await asyncio.sleep(0.02)  # scheduled, far from done
        await client.pause("abort")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        ends = [(r.request_id, r.finish_reason, len(ids_of(r))) for r in results]
        for r in results:
            check_shape(r)
            assert r.finish_reason == "abort" and len(ids_of(r)) < LONG, ends
        queued = asyncio.create_task(client.generate(gen("after-pause", 8, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert not queued.done()  # held while paused
    finally:
        await client.resume()
    r = await asyncio.wait_for(queued, 30)
    assert r.finish_reason == "length" and len(ids_of(r)) == 8


async def test_weight_update_versions_and_logprobs_match_transformers(client):
    tokens = [2, *range(20, 60), 3]
    before = await prompt_logprobs(client, tokens)
    target = (await client.stats()).version + 1
    named = new_weights(seed=target + 100)
    bucket_bytes = 300_000
    assert len(plan_buckets(named, bucket_bytes)) >= 2
    await client.push_weights(target, named, bucket_bytes=bucket_bytes)
    applied = await client.apply_weights(target)
    assert applied.version == target and applied.stats.version == target

    fresh = await client.generate(gen("after-update", 8))
    assert versions_of(fresh) == [target] * len(ids_of(fresh))
    after = await prompt_logprobs(client, tokens)
    expected = transformers_logprobs(named, tokens)
    assert max(abs(a - b) for a, b in zip(before, expected, strict=True)) > 100 * LOGPROB_ATOL
    assert after == pytest.approx(expected, abs=LOGPROB_ATOL)


async def test_request_spanning_an_update_carries_both_versions(client):
    # The request must be generating when the update lands. How long that takes depends on the
    # machine's speed and load, so the window before the pause adapts: longer when no token
    # came before the update, shorter when the request finished before it.
    window_s = 0.1
    seen = []  # (window s, first version, last version, num_tokens): for the failure message
    for attempt in range(8):
        current = (await client.stats()).version
        target = current + 1
        await client.pause("keep")
        spanning = asyncio.create_task(
            client.generate(gen(f"span{attempt}", LONG, ignore_eos=True))
        )
        try:
            await started(client, spanning)
            await client.resume()
            await asyncio.sleep(window_s)  # some tokens under the old weights
            await client.pause("keep")
            await client.push_weights(target, new_weights(seed=attempt), bucket_bytes=1 << 30)
            applied = await client.apply_weights(target)
            assert applied.stats.paused  # a client pause outlives the update
        finally:
            await client.resume()
        r = await asyncio.wait_for(spanning, 120)
        check_shape(r)
        seen.append((round(window_s, 5), versions_of(r)[0], versions_of(r)[-1], len(ids_of(r))))
        if versions_of(r)[0] == current and versions_of(r)[-1] == target:
            switch = versions_of(r).index(target)
            assert set(versions_of(r)[:switch]) == {current}
            assert set(versions_of(r)[switch:]) == {target}
            return
        window_s = window_s * 3 if versions_of(r)[0] == target else window_s / 3
    pytest.fail(f"the request never spanned the update in 8 attempts: {seen}")


async def test_stale_version_rejected(client, worker):
    current = (await client.stats()).version
    if current == 0:  # make sure there is a version to be stale against
        await client.push_weights(1, new_weights(seed=7), bucket_bytes=1 << 30)
        await client.apply_weights(1)
        current = 1
    with pytest.raises(RemoteError) as info:
        await client.apply_weights(current)
    assert info.value.code == "stale_version"
    with pytest.raises(RemoteError) as info:
        await client.push_weights(current, new_weights(seed=8), bucket_bytes=1 << 30)
    assert info.value.code == "stale_version"
    assert (await client.stats()).version == current


async def test_checksum_mismatch_rejected_and_old_weights_kept(client, worker):
    tokens = [2, *range(30, 50), 3]
    before = await prompt_logprobs(client, tokens)
    target = (await client.stats()).version + 1
    named = new_weights(seed=999)
    async with RpcClient(worker.address, heartbeat_interval_s=0, auth=env_credentials()) as rpc:
        with pytest.raises(RemoteError) as info:
            await raw_bucket(rpc, target, 0, 1, named, checksum="00000000")
    assert info.value.code == "checksum_mismatch"
    with pytest.raises(RemoteError) as info:
        await client.apply_weights(target)
    assert info.value.code == "incomplete_version"  # nothing was staged
    assert await prompt_logprobs(client, tokens) == before
    assert (await client.stats()).version == target - 1


async def test_incomplete_version_rejected(client, worker):
    # Far ahead, so the partial versions left staged here never collide with other tests.
    target = (await client.stats()).version + 1000
    named = new_weights(seed=5)
    half = len(named) // 2
    async with RpcClient(worker.address, heartbeat_interval_s=0, auth=env_credentials()) as rpc:
        await raw_bucket(rpc, target, 0, 2, named[:half])  # bucket 1 of 2 never sent
        with pytest.raises(RemoteError) as info:
            await client.apply_weights(target)
        assert info.value.code == "incomplete_version" and "buckets missing" in info.value.message
        # All buckets present but a checkpoint tensor absent is incomplete too.
        partial = [(n, t) for n, t in named if n != "model.norm.weight"]
        await raw_bucket(rpc, target + 1, 0, 1, partial)
        with pytest.raises(RemoteError) as info:
            await client.apply_weights(target + 1)
        assert info.value.code == "incomplete_version" and "model.norm.weight" in info.value.message
    assert (await client.stats()).version == target - 1000


async def test_bad_input_gets_errors_and_worker_keeps_serving(client, worker):
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    env_credentials().secure_client(sock)  # the run's key, as every client
    sock.connect(worker.address)
    try:
        await sock.send_multipart([struct.pack(">Q", 7), b"\xc1 not msgpack"])
        call_id, body, *_ = await asyncio.wait_for(sock.recv_multipart(), 10)
        reply = msgspec.msgpack.decode(body, type=m.Reply)
        assert struct.unpack(">Q", call_id) == (7,)
        assert isinstance(reply, m.ErrorReply) and reply.code == "bad_request"
    finally:
        sock.close()

    async with RpcClient(worker.address, heartbeat_interval_s=0, auth=env_credentials()) as rpc:
        with pytest.raises(RemoteError) as info:  # a message kind this worker does not serve
            await rpc.call(m.EnvStep(session_id="s", action="a"))
        assert info.value.code == "unknown_kind"
        bad_shape = [("model.norm.weight", torch.zeros(3))]
        with pytest.raises(RemoteError) as info:
            await raw_bucket(rpc, 10_000, 0, 1, bad_shape)
        assert info.value.code == "bad_request" and "shape" in info.value.message
        with pytest.raises(RemoteError) as info:
            await raw_bucket(rpc, 10_000, 0, 1, [("no.such.weight", torch.zeros(3))])
        assert info.value.code == "bad_request" and "no.such.weight" in info.value.message

    with pytest.raises(RemoteError) as info:
        await client.generate(
            m.Generate(
                request_id="empty", new_token_ids=b"", sampling=m.SamplingParams(max_tokens=4)
            )
        )
    assert info.value.code == "bad_request"
    with pytest.raises(RemoteError) as info:  # token id outside the vocabulary: vLLM rejects it
        await client.generate(
            m.Generate(
                request_id="oov", new_token_ids=tb.pack_i32([10**6]),
                sampling=m.SamplingParams(max_tokens=4)
            )
        )
    # the input's fault, not the engine's: it does not count towards the worker's quarantine
    assert info.value.code == "bad_request" and "rejected" in info.value.message
    r = await client.generate(gen("still-serving", 4, ignore_eos=True))
    assert len(ids_of(r)) == 4


async def test_collective_messages_to_a_zmq_worker_are_refused(client):
    """A worker that receives weights over zmq (the default) refuses the collective
    weight-transfer messages, and keeps serving."""
    with pytest.raises(RemoteError, match="receives weights over zmq"):
        await client.weight_transfer(m.WeightTransferStart(), timeout_s=30)
    assert (await client.stats()).weight_transfer == "zmq"  # still serving


async def test_killed_worker_raises_peer_dead_not_hang(client, worker):
    """Last test of the module: it kills the shared worker."""
    await client.pause("keep")  # the request stays pending until the worker dies
    pending = asyncio.create_task(client.generate(gen("orphan", LONG, ignore_eos=True)))
    await started(client, pending)
    worker.kill()
    start = time.monotonic()
    with pytest.raises(PeerDeadError):
        await asyncio.wait_for(pending, 60)
    assert time.monotonic() - start < 30  # liveness_timeout_s=15 plus slack
    assert client.dead
    with pytest.raises(PeerDeadError):
        await client.stats()
