"""Token data stay compact arrays end to end; prompts travel as deltas on worker-held prefixes.

A real trajectory runs against ``FakeWorker`` (the real ``PrefixStore``) behind a wire double
that msgpack-encodes every ``Generate`` and ``GenerateResult`` as the RPC layer does, so the
types checked are the ones a remote peer decodes.
"""

from __future__ import annotations

import array
import asyncio
import base64

import msgspec
import numpy as np
import pytest
import torch

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeWorker, make_scenario
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.rollout.trajectory import TrajectoryContext, run_trajectory
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvRouter, RewardRouter
from rollart.controller.training.remote import to_train_samples
from rollart.inference.prefixes import PrefixStore
from rollart.trainer.step import collate
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError
from rollart.transport.security import env_credentials

ENC = msgspec.msgpack.Encoder()
REQ = msgspec.msgpack.Decoder(m.Request)
REP = msgspec.msgpack.Decoder(m.Reply)


class FakeWireWorker(FakeWorker):
    """``FakeWorker`` whose requests and replies cross a msgpack encode/decode, as on the wire;
    ``wire_requests`` keeps each encoded ``Generate`` and ``wire_results`` each decoded reply."""

    def __init__(self, name: str, respond=None, **kw) -> None:
        super().__init__(name, respond, **kw)
        self.wire_requests: list[bytes] = []
        self.wire_results: list[m.GenerateResult] = []

    async def generate(self, request: m.Generate, *, timeout_s=None) -> m.GenerateResult:
        raw = ENC.encode(request)
        self.wire_requests.append(raw)
        result = REP.decode(ENC.encode(await super().generate(REQ.decode(raw))))
        assert isinstance(result, m.GenerateResult)
        self.wire_results.append(result)
        return result


class RecordingBuffer(SampleBuffer):
    """Records the type of every per-turn ``versions`` the trajectory hands the buffer."""

    recorded: list[object]

    def record_tokens(self, traj_id, versions) -> None:
        self.__dict__.setdefault("recorded", []).append(versions)
        super().record_tokens(traj_id, versions)


def make_ctx(worker, env, *, other=None, **run):
    scenario = make_scenario(**run)
    proxy = LLMProxy({"p1": ("cpu", [worker, *([other] if other else [])])},
                     {"game": "p1", "math": "p1"})
    buffer = RecordingBuffer(alpha=scenario.run.alpha, batch_size=scenario.run.batch_size,
                             group_size=scenario.run.group_size)
    chat = ChatTokens(TOK)
    ctx = TrajectoryContext(
        run=scenario.run, proxy=proxy, envs=EnvRouter([env]), rewards=RewardRouter(FakeReward()),
        chat={"game": chat, "math": chat}, buffer=buffer, clock=lambda: 0.0,
        wait_for_weights=lambda v: asyncio.sleep(0),
    )
    return ctx, buffer, {d.name: d for d in scenario.domains}


async def test_token_data_stay_arrays_through_a_whole_trajectory() -> None:
    worker = FakeWireWorker("w1", lambda req: "ok")
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=3))
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=7)

    # engine output -> wire: every per-token field of every reply is one bytes value
    assert len(worker.wire_results) == 3
    for res in worker.wire_results:
        assert {type(res.token_ids), type(res.logprobs), type(res.versions)} == {bytes}
    for raw in worker.wire_requests:
        assert type(REQ.decode(raw).new_token_ids) is bytes
    # wire -> buffer: each turn's versions arrive as an int32 array, not a list
    assert all(isinstance(v, array.array) and v.typecode == "i" for v in buffer.recorded)
    # -> sample: typed views over the buffers the trajectory grew in place: ids and mask per
    # token, logprobs and versions per generated token (5 bytes per token + 8 per generated)
    fields = ("token_ids", "loss_mask", "behaviour_logprobs", "versions")
    assert [getattr(sample, f).format for f in fields] == ["i", "b", "f", "i"]
    assert [type(getattr(sample, f).obj) for f in fields] == [array.array, array.array,
                                                               bytearray, bytearray]
    assert sum(getattr(sample, f).nbytes for f in fields) == \
        5 * sample.num_tokens + 8 * sample.num_generated
    assert sample.num_generated == 9 and sample.min_version == 0
    assert sample.token_ids.tolist() == worker.prompts[-1] + [*TOK.encode("ok"), 2]
    # -> trainer: wire bytes, and the trainer's tensors hold the very same values
    assert buffer.complete(tid, sample) == []
    (ts,) = to_train_samples([sample])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ts), type=m.TrainSample)
    assert {type(wire.token_ids), type(wire.loss_mask), type(wire.behaviour_logprobs)} == {bytes}
    batch = collate([wire])
    assert batch["input_ids"][0].tolist() == sample.token_ids.tolist()
    assert batch["loss_mask"][0].tolist() == [bool(x) for x in sample.loss_mask]
    assert wire.behaviour_logprobs == sample.behaviour_logprobs.tobytes()  # generated only
    assert torch.equal(batch["behaviour_logprobs"][0],
                       torch.tensor(sample.full_behaviour_logprobs().tolist(),
                                    dtype=torch.float32))
    # -> checkpoint: base64 of the bytes in the JSON snapshot, and back to the same arrays
    snap = buffer.snapshot()
    text = msgspec.json.encode(snap)
    (slot,) = [s for s in snap["groups"][0]["slots"] if s and s["state"] == "held"]
    assert isinstance(slot["sample"]["token_ids"], str)  # base64, not a list of numbers
    restored = SampleBuffer.restore(msgspec.json.decode(text))
    (back,) = [t.sample for t in restored._trajs.values() if t.sample is not None]
    assert back == sample and back.token_ids.format == "i" and back.min_version == 0


def test_sample_loads_the_list_form_older_snapshots_hold() -> None:
    old = {"sample_id": "a", "group_key": "g", "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
           "behaviour_logprobs": [0.0, -0.5, -0.25], "versions": [-1, 4, 3], "reward": 1.0}
    s = msgspec.convert(old, Sample)
    # Their per-token logprobs and versions are reduced to the generated tokens'.
    assert s.token_ids.format == "i" and s.behaviour_logprobs.tolist() == [-0.5, -0.25]
    assert s.versions.tolist() == [4, 3] and s.full_versions().tolist() == [-1, 4, 3]
    assert (s.num_generated, s.min_version) == (2, 3)
    assert msgspec.convert(msgspec.to_builtins(s), Sample) == s
    # The per-token base64 form of the snapshots before this one loads the same way.
    per_token = {**old, **{k: base64.b64encode(array.array(c, old[k]).tobytes()).decode()
                           for k, c in (("token_ids", "i"), ("loss_mask", "b"),
                                        ("behaviour_logprobs", "f"), ("versions", "i"))}}
    assert msgspec.convert(per_token, Sample) == s


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss_mask": [0, 1]}, "token_ids/loss_mask lengths 3/2 differ"),
        ({"behaviour_logprobs": [-0.5]},
         r"have 1/3 items: expected one per generated token \(2\) or one per token \(3\)"),
        ({"versions": [4, 3, 3, 3]}, "have 3/4 items"),
        ({"versions": [4, -1], "behaviour_logprobs": [-0.5, -0.25]},
         "generated token 2 has version -1"),
        ({"loss_mask": [0, 2, 1]}, "0 or 1"),
        ({"versions": [-1, 4, -1]}, "generated token 2 has version -1"),
        ({"token_ids": b"\x01\x00\x00"}, "token_ids"),
        ({"reward": float("inf")}, "not finite"),
    ],
)
def test_sample_validation_names_the_problem(change, match) -> None:
    fields = {"sample_id": "a", "group_key": "g", "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
              "behaviour_logprobs": [0.0, -0.5, -0.25], "versions": [-1, 4, 3], "reward": 1.0}
    with pytest.raises(ValueError, match=match):
        Sample(**{**fields, **change})


def test_min_version_ignores_tokens_the_policy_did_not_generate() -> None:
    n = 40_000
    versions = np.full(n, -1, dtype=np.int32)
    mask = np.zeros(n, dtype=np.int8)
    mask[100:200], versions[100:200] = 1, 7
    mask[30_000:30_010], versions[30_000:30_010] = 1, 5
    s = Sample(sample_id="a", group_key="g", token_ids=np.arange(n, dtype=np.int32).tobytes(),
               loss_mask=mask.tobytes(), behaviour_logprobs=bytes(4 * n),
               versions=versions.tobytes(), reward=0.0)
    assert (s.num_generated, s.min_version, s.num_tokens) == (110, 5, n)
    none = Sample(sample_id="b", group_key="g", token_ids=[1], loss_mask=[0],
                  behaviour_logprobs=[0.0], versions=[-1], reward=0.0)
    assert none.min_version is None and none.num_generated == 0


# ----------------------------------------------------------------------------- prefix deltas


async def test_later_turns_send_only_the_new_tokens() -> None:
    worker = FakeWireWorker("w1", lambda req: "ok " * 100)
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=3), max_tokens_per_turn=400,
                                    max_tokens_per_trajectory=5000)
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=7)
    first, *later = [REQ.decode(raw) for raw in worker.wire_requests]
    assert first.prefix_len == 0 and first.num_new_tokens == len(worker.prompts[0])
    for i, req in enumerate(later, start=1):
        prev_prompt, prev_gen = worker.prompts[i - 1], worker.wire_results[i - 1].num_tokens
        observation = worker.prompts[i][len(prev_prompt) + prev_gen:]
        assert req.trajectory_id == tid and req.prefix_len == len(prev_prompt) + prev_gen
        assert tb.view_i32(req.new_token_ids).tolist() == observation
        # the whole message: the observation's 4 bytes per token plus a fixed envelope
        empty = ENC.encode(msgspec.structs.replace(req, new_token_ids=b""))
        assert len(worker.wire_requests[i]) - len(empty) <= 4 * len(observation) + 3
        assert len(worker.wire_requests[i]) < 4 * req.prefix_len
    assert ctx.proxy.num_prompt_tokens_sent < ctx.proxy.num_prompt_tokens
    assert sample.num_turns == 3 and worker.prefix_misses == []


async def test_a_worker_without_the_prefix_gets_the_whole_prompt_once() -> None:
    worker = FakeWorker("w1", lambda req: "ok")
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=3))
    real_generate = worker.generate
    turns = 0

    async def restart_after_first_turn(request, *, timeout_s=None):
        nonlocal turns
        turns += 1
        if turns == 2:
            worker.prefixes = PrefixStore()  # the worker restarted: it holds nothing
        return await real_generate(request, timeout_s=timeout_s)

    worker.generate = restart_after_first_turn
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=7)
    assert len(worker.prefix_misses) == 1 and ctx.proxy.num_prefix_resends == 1
    # the resend carries the whole prompt; the turn after it is a delta again
    resend, third = worker.requests[1], worker.requests[2]
    assert resend.prefix_len == 0 and resend.num_new_tokens == len(worker.prompts[1])
    assert third.prefix_len > 0
    assert sample.token_ids.tolist()[: len(worker.prompts[2])] == worker.prompts[2]


async def test_a_rerouted_trajectory_sends_its_whole_prompt() -> None:
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    proxy = LLMProxy({"p": ("cpu", [w1, w2])}, {"d": "p"})
    sp = m.SamplingParams(max_tokens=8)
    prompt = array.array("i", TOK.encode("hello"))
    first = await proxy.generate("t", "d", "t/0", prompt, sp)
    prompt.extend(tb.view_i32(first.token_ids).tolist() + TOK.encode("more"))
    home, other = (w1, w2) if w1.requests else (w2, w1)
    home.kill()
    await proxy.generate("t", "d", "t/1", prompt, sp)
    (moved,) = other.requests
    assert moved.prefix_len == 0 and other.prompts == [prompt.tolist()]
    assert other.prefix_misses == []


async def test_finished_trajectories_are_released_on_the_next_generate() -> None:
    worker = FakeWorker("w1")
    proxy = LLMProxy({"p": ("cpu", [worker])}, {"d": "p"})
    sp = m.SamplingParams(max_tokens=8)
    await proxy.generate("a", "d", "a/0", array.array("i", [20, 21]), sp)
    assert "a" in worker.prefixes
    proxy.release("a")
    await proxy.generate("b", "d", "b/0", array.array("i", [22]), sp)
    assert worker.requests[-1].release == ["a"]
    assert "a" not in worker.prefixes and "b" in worker.prefixes


def _gen(tid: str, prefix_len: int, new: list[int]) -> m.Generate:
    return m.Generate(request_id=f"{tid}/{prefix_len}", new_token_ids=tb.pack_i32(new),
                      sampling=m.SamplingParams(max_tokens=1), trajectory_id=tid,
                      prefix_len=prefix_len)


def test_prefix_store_is_lru_bounded_and_drops_failed_turns() -> None:
    store = PrefixStore(max_tokens=100)
    for tid in "abc":
        store.keep(tid, tb.pack_i32(range(30)), tb.pack_i32(range(10)))
    assert "a" not in store and store.num_tokens == 80 and store.evictions == 1
    # using b makes c the least recently used one
    store.keep("b", store.take_prompt(_gen("b", 40, [1, 2])), tb.pack_i32([3]))
    store.keep("d", tb.pack_i32(range(40)), b"")
    assert "c" not in store and store.held_tokens("b") == 43 and store.num_tokens == 83
    store.keep("huge", tb.pack_i32(range(101)), b"")  # longer than the bound: not kept
    assert "huge" not in store and store.num_tokens <= 100
    # a turn that is taken and never kept (aborted, failed) leaves nothing behind
    store.take_prompt(_gen("d", 40, [5]))
    assert "d" not in store and store.num_tokens == 43


def test_prefix_store_rejects_unknown_and_malformed_prefixes() -> None:
    store = PrefixStore()
    with pytest.raises(RemoteError) as info:
        store.take_prompt(_gen("t", 5, [1]))
    assert info.value.code == "prefix_unknown" and "resend" in info.value.message
    store.keep("t", tb.pack_i32([1, 2, 3]), b"")
    with pytest.raises(RemoteError) as info:  # holds 3, told 2: never guess
        store.take_prompt(_gen("t", 2, [9]))
    assert info.value.code == "prefix_unknown" and store.misses == 2
    bad = [
        m.Generate(request_id="r", new_token_ids=b"\x01\x02", sampling=m.SamplingParams(
            max_tokens=1)),
        m.Generate(request_id="r", new_token_ids=b"", sampling=m.SamplingParams(max_tokens=1)),
        m.Generate(request_id="r", new_token_ids=b"", sampling=m.SamplingParams(max_tokens=1),
                   prefix_len=3),
    ]
    for msg in bad:
        with pytest.raises(RemoteError) as info:
            store.take_prompt(msg)
        assert info.value.code == "bad_request"


def test_prefix_store_is_bounded_by_entries_as_well_as_tokens() -> None:
    # One-token prefixes under many ids: the token bound alone would let 16 Mi entries pile up.
    store = PrefixStore(max_tokens=1 << 20, max_entries=100)
    for i in range(1000):
        store.keep(f"t{i}", tb.pack_i32([i]), b"")
    assert len(store) == 100 and store.num_tokens == 100 and store.evictions == 900
    assert "t999" in store and "t899" not in store  # least recently used went first
    with pytest.raises(ValueError, match="max_entries must be > 0"):
        PrefixStore(max_entries=0)


async def test_a_server_flooded_with_trajectory_ids_holds_a_bounded_store() -> None:
    from rollart.transport.rpc import RpcClient, RpcServer

    store = PrefixStore(max_entries=50)

    async def generate(msg: m.Generate, _frames) -> m.Ack:
        store.keep(msg.trajectory_id, store.take_prompt(msg), tb.pack_i32([7]))
        return m.Ack()

    server = RpcServer("tcp://127.0.0.1:0", {m.Generate: generate}, name="worker", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    try:
        async with RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials()) as client:
            params = m.SamplingParams(max_tokens=1)
            await asyncio.gather(*(client.call(m.Generate(
                request_id=f"r{i}", new_token_ids=tb.pack_i32([1, 2]), sampling=params,
                trajectory_id=f"flood-{i}"), timeout_s=60) for i in range(500)))
            assert len(store) == 50 and store.num_tokens == 150
            # An over-long trajectory id is refused by name; the server keeps serving.
            with pytest.raises(RemoteError) as info:
                await client.call(m.Generate(
                    request_id="long", new_token_ids=tb.pack_i32([1]), sampling=params,
                    trajectory_id="x" * 100_000), timeout_s=60)
            assert info.value.code == "bad_request" and "trajectory_id" in info.value.message
            await client.call(m.Generate(request_id="ok", new_token_ids=tb.pack_i32([1]),
                                         sampling=params, trajectory_id="g1/2"), timeout_s=60)
            assert "g1/2" in store and len(store) == 50
    finally:
        await server.close()
        serving.cancel()


def test_the_simulated_worker_resolves_delta_prompts_like_the_real_one() -> None:
    from rollart.sim.clock import run_virtual
    from rollart.sim.hardware import H800
    from rollart.sim.models import QWEN3_8B
    from rollart.sim.worker import SimInferenceWorker
    from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, const, observation

    table = DomainTable([DomainSpec("fixed", response_tokens=const(20))])
    prompt = array.array("i", SimTokenizer(table).encode(observation("fixed", 300, tag="a")))
    opening = len(prompt)

    async def main():
        w = SimInferenceWorker("w0", hardware=H800, model=QWEN3_8B, domains=table)
        proxy = LLMProxy({"p": ("h800", [w])}, {"d": "p"})
        sp = m.SamplingParams(max_tokens=64)
        first = await proxy.generate("a", "d", "a/t0", prompt, sp)
        prompt.frombytes(first.token_ids)
        prompt.extend([7] * 50)
        second = await proxy.generate("a", "d", "a/t1", prompt, sp)
        return w, proxy, first, second

    w, proxy, first, second = run_virtual(main)
    assert first.num_tokens == 20 == second.num_tokens  # the domain was read from the prefix
    assert second.num_prompt_tokens == len(prompt)
    assert proxy.num_prompt_tokens_sent == opening + 50  # turn 1 whole, turn 2 the 50 new
    assert w.prefixes.hits == 1 and w.prefixes.held_tokens("a") == len(prompt) + 20


async def test_a_reply_with_ragged_token_bytes_fails_the_trajectory_only() -> None:
    from rollart.controller.rollout.trajectory import TrajectoryFailed

    worker = FakeWorker("w1")
    real_generate = worker.generate

    async def short_logprobs(request, *, timeout_s=None):
        res = await real_generate(request, timeout_s=timeout_s)
        return msgspec.structs.replace(res, logprobs=res.logprobs[:-4])

    worker.generate = short_logprobs
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=2))
    (tid, *_) = buffer.try_start_group("g0")
    with pytest.raises(TrajectoryFailed) as info:
        await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    # A contract violation the proxy catches (counted towards the worker's quarantine).
    assert info.value.reason == "invalid_worker_output" and "8 of logprobs" in info.value.detail


async def test_a_trajectory_with_no_generated_token_fails_instead_of_reaching_the_trainer() -> None:
    from rollart.controller.rollout.trajectory import TrajectoryFailed

    # A worker answering "stop" with no token at all: a Sample without one generated token
    # would make TrainSample refuse the whole batch (a fatal training step).
    worker = FakeWorker("w1", respond=lambda req: "", add_eos=False)
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=1))
    (tid, *_) = buffer.try_start_group("g0")
    with pytest.raises(TrajectoryFailed) as info:
        await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert info.value.reason == "invalid_worker_output"
    assert "'stop' with no token" in info.value.detail
    with pytest.raises(ValueError, match="no generated token"):  # what the trainer would say
        to_train_samples([Sample(sample_id="s", group_key="g", token_ids=[1, 2], loss_mask=[0, 0],
                                 behaviour_logprobs=[0.0, 0.0], versions=[-1, -1], reward=1.0)])


def test_pack_i32_refuses_values_outside_int32_from_any_source() -> None:
    assert tb.view_i32(tb.pack_i32(np.array([0, 2**31 - 1], dtype=np.int64))).tolist() == [
        0, 2**31 - 1]
    for values in ([2**31], np.array([2**31, 5], dtype=np.int64),
                   np.array([-(2**31) - 1], dtype=np.int64)):
        with pytest.raises(OverflowError):
            tb.pack_i32(values)


def test_pack_i32_of_a_list_matches_array_and_keeps_its_errors() -> None:
    # Lists (a tokenizer's output) take a faster path than other sequences: same bytes, and
    # the same errors as array('i') for values it cannot hold.
    values = [0, 1, -5, 2**31 - 1, -(2**31), 151_642]
    assert tb.pack_i32(values) == array.array("i", values).tobytes()
    assert tb.pack_i32([]) == b""
    assert tb.pack_i32([True, np.int64(7)]) == array.array("i", [1, 7]).tobytes()
    with pytest.raises(OverflowError):
        tb.pack_i32([1, 2**31])
    with pytest.raises(TypeError):
        tb.pack_i32([1, 2.5])
