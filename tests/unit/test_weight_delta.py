"""Delta transfer without processes: codec, wire dtype, the trainer's base choice, and a worker's
stager rebuilding deltas (base checks, checksums, exactly-once apply)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollart.config import ConfigError, parse_scenario
from rollart.launcher.services import trainer_argv
from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.weights import delta
from rollart.weights.basestate import WorkerBases
from rollart.weights.buckets import crc32_hex, plan_buckets, tensor_to_frame
from rollart.weights.push import WeightPublisher
from rollart.weights.sender import DeltaSender, encode_version
from rollart.weights.staging import WeightStager

ENCODINGS = ["xor", "sparse"]


def weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(64, 32, generator=g)),
            ("layer.weight", torch.randn(32, 32, generator=g)),
            ("norm.weight", torch.ones(32))]


def step(named, frac: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Change about ``frac`` of each tensor's elements by a relative 1%."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in named:
        mask = torch.rand(t.shape, generator=g) < frac
        out.append((n, torch.where(mask, t * 1.01 + 1e-3, t)))
    return out


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("itemsize", [2, 4])
def test_codec_round_trip_is_bit_exact(encoding, itemsize):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 4099 * itemsize, dtype=np.uint8)
    new = base.copy()
    new[rng.choice(base.size, 50, replace=False)] ^= 0x5A
    payload = delta.encode(base, new, encoding, itemsize)
    assert len(payload) < base.size // 4
    out = delta.decode(base, payload, encoding, itemsize)
    assert np.array_equal(out, new)
    assert np.array_equal(delta.decode(base, payload, encoding, itemsize), new)  # pure
    assert not np.array_equal(base, new)  # base untouched by decoding


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_codec_refuses_a_payload_for_another_size_or_garbage(encoding):
    base = np.zeros(64, dtype=np.uint8)
    payload = delta.encode(base, base + 1, encoding, 2)
    with pytest.raises(delta.DeltaError):
        delta.decode(np.zeros(32, dtype=np.uint8), payload, encoding, 2)
    with pytest.raises(delta.DeltaError, match="zstd"):
        delta.decode(base, b"not a zstd frame", encoding, 2)


def test_to_wire_rounds_to_bf16_and_refuses_fp16_overflow():
    named = [("w", torch.tensor([1.0, 1.0 + 2**-10])), ("step", torch.tensor([3]))]
    wire = delta.to_wire(named, "bf16")
    assert wire[0][1].dtype == torch.bfloat16 and wire[1][1].dtype == torch.int64
    assert wire[0][1].tolist() == [1.0, 1.0]  # below bf16's 2**-8 step: rounds away
    assert delta.to_wire(named, "model")[0][1].dtype == torch.float32
    with pytest.raises(ValueError, match="'w' overflows float16"):
        delta.to_wire([("w", torch.tensor([1e6]))], "fp16")
    with pytest.raises(ValueError, match="unknown wire dtype"):
        delta.to_wire(named, "int4")


def test_base_choice_full_for_new_lagging_and_every_nth_version():
    s = DeltaSender("xor", full_every=4, bucket_bytes=1 << 20)
    s.remember(1, weights())
    assert s.base_for("a", 1) is None  # new worker: full
    s.done("a", 1)
    s.remember(2, weights(1))
    assert s.base_for("a", 2) == 1
    s.done("a", 2)
    s.remember(3, weights(2))
    s.remember(4, weights(3))
    assert s.base_for("a", 4) is None  # 4 % full_every == 0
    s.forget("a")  # its push failed: lagging, base unknown
    assert s.base_for("a", 5) is None
    assert DeltaSender("off", full_every=1, bucket_bytes=1).base_for("a", 3) is None
    with pytest.raises(ValueError, match="weight_delta"):
        DeltaSender("lz4", full_every=1, bucket_bytes=1)  # type: ignore[arg-type]


def test_trainer_keeps_only_the_bases_workers_hold():
    s = DeltaSender("xor", full_every=100, bucket_bytes=1 << 20)
    s.remember(1, weights(1))
    s.done("a", 1)
    for v in (2, 3, 4):
        s.remember(v, weights(v))
    assert sorted(s._versions) == [1, 4]  # a's base and the latest
    s.done("a", 4)
    assert sorted(s._versions) == [4]


class FakeWorkerSink:
    """A worker's staging half in-process: the real ``WeightStager`` + ``WorkerBases``; every
    message goes through msgspec encode / decode as on the wire."""

    def __init__(self, root, name="w") -> None:
        self.name, self.dead = name, False
        self.stager = WeightStager(root, None)
        self.bases = WorkerBases(self.stager)
        self.version = 0
        self.full_pushes = 0
        self.corrupt_next_payload = False

    async def push_weights(self, version, named_tensors, *, bucket_bytes, keep_as_base=False):
        self.full_pushes += 1
        buckets = plan_buckets(named_tensors, bucket_bytes)
        for i, b in enumerate(buckets):
            metas, frames = zip(*(tensor_to_frame(n, t) for n, t in b), strict=True)
            msg = m.WeightBucket(version=version, bucket_index=i, num_buckets=len(buckets),
                                 tensors=list(metas), checksum=crc32_hex(frames),
                                 keep_as_base=keep_as_base)
            self.bases.note_full_bucket(msg)
            await self.stager.stage(wire(msg), list(frames), self.version)

    async def push_weight_delta(self, msg, payload, *, timeout_s=None):
        if self.corrupt_next_payload:
            self.corrupt_next_payload = False
            payload = _flip_one_bit(payload, msg)
        return await self.bases.stage_delta(wire(msg), [memoryview(payload)], self.version)

    def apply(self, version: int) -> dict[str, torch.Tensor]:
        staged = self.stager.take(version, self.version)
        self.version = version
        out = {}
        for p in staged.paths():
            out.update(load_file(p))
        self.bases.after_apply(version)
        return out

    async def close(self):
        self.stager.close()


def _flip_one_bit(payload: bytes, msg: m.WeightDelta) -> bytes:
    """The same payload rebuilding one element differently (a well-formed but wrong delta)."""
    raw = bytearray(delta.zstandard.ZstdDecompressor().decompress(payload))
    raw[-1] ^= 0x01  # xor: last byte of the bucket; sparse: last value's last byte
    return delta.zstandard.ZstdCompressor().compress(bytes(raw))


def wire(msg):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=m.Request)


def bf16(named):
    return delta.to_wire(named, "bf16")


async def publish(pub, version, named):
    pub.publish(version, named)
    return await pub.wait(version, timeout_s=60)


@pytest.fixture
def setup(tmp_path):
    sinks: dict[str, FakeWorkerSink] = {}

    def connect(addr):
        sinks[addr] = FakeWorkerSink(tmp_path / addr, addr)
        return sinks[addr]

    def make(encoding="xor", full_every=100):
        return WeightPublisher(connect, bucket_bytes=4096, delta=DeltaSender(
            encoding, full_every=full_every, bucket_bytes=4096))
    return make, sinks


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_delta_round_trip_rebuilds_the_new_version_bit_exact(setup, encoding):
    make, sinks = setup
    pub = make(encoding)
    await pub.set_workers(["a"])
    v1, v2 = bf16(weights()), bf16(step(weights(), 0.01, 1))
    r1 = await publish(pub, 1, v1)
    assert r1.delta_workers == [] and r1.wire_bytes == r1.num_bytes  # new worker: full
    sinks["a"].apply(1)
    r2 = await publish(pub, 2, v2)
    assert r2.delta_workers == ["a"] and not r2.failed
    assert r2.wire_bytes < 0.2 * r2.num_bytes
    got = sinks["a"].apply(2)
    for name, t in v2:
        assert torch.equal(got[name], t), name
    assert sinks["a"].full_pushes == 1
    await pub.close()


async def test_delta_before_the_base_is_applied_uses_the_staged_base(setup):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    versions = [bf16(step(weights(), 0.02, s)) for s in range(3)]
    await publish(pub, 1, versions[0])
    r = await publish(pub, 2, versions[1])  # 1 staged, not applied: still a base
    assert r.delta_workers == ["a"]
    got = sinks["a"].apply(2)  # the controller skipped version 1
    assert all(torch.equal(got[n], t) for n, t in versions[1])
    await pub.close()


async def test_base_mismatch_is_refused_and_healed_by_a_full_version(setup, tmp_path):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    await publish(pub, 1, bf16(weights()))
    sinks["a"].apply(1)
    # The worker restarts at the same address: it holds no base any more.
    sinks["a"].stager.close()
    sinks["a"].stager = WeightStager(tmp_path / "restarted", None)
    sinks["a"].bases = WorkerBases(sinks["a"].stager)
    sinks["a"].version = 0
    v2 = bf16(step(weights(), 0.01, 2))
    reply = await sinks["a"].push_weight_delta(m.WeightDelta(
        version=2, base_version=1, bucket_index=0, num_buckets=1, tensors=[], checksum="0",
        encoding="xor"), b"")
    assert isinstance(reply, m.NeedFullVersion) and "not held" in reply.reason
    r2 = await publish(pub, 2, v2)
    assert r2.delta_workers == [] and not r2.failed and sinks["a"].full_pushes == 2
    got = sinks["a"].apply(2)
    assert all(torch.equal(got[n], t) for n, t in v2)
    r3 = await publish(pub, 3, bf16(step(weights(), 0.01, 3)))
    assert r3.delta_workers == ["a"]  # healed: deltas again
    await pub.close()


async def test_checksum_failure_stages_nothing_and_the_trainer_resends_in_full(setup):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    v1 = bf16(weights())
    await publish(pub, 1, v1)
    sinks["a"].apply(1)
    s = pub.delta
    v2 = bf16(step(weights(), 0.01, 4))
    s.remember(2, v2)
    enc = encode_version(v1, v2, "xor", 4096)
    msg = m.WeightDelta(version=2, base_version=1, bucket_index=0, num_buckets=len(enc),
                        tensors=enc[0].metas, checksum=enc[0].checksum, encoding="xor")
    with pytest.raises(RemoteError) as err:
        await sinks["a"].push_weight_delta(msg, _flip_one_bit(enc[0].payload, msg))
    assert err.value.code == "checksum_mismatch"
    assert 2 not in sinks["a"].stager.staged_versions()  # nothing of version 2 staged
    assert sinks["a"].version == 1
    # Through the publisher: a corrupted delta falls back to a full push of the version.
    sinks["a"].corrupt_next_payload = True
    pub2_report = await publish(pub, 2, v2)
    assert pub2_report.delta_workers == [] and not pub2_report.failed
    assert sinks["a"].full_pushes == 2
    got = sinks["a"].apply(2)
    assert all(torch.equal(got[n], t) for n, t in v2)
    await pub.close()


async def test_a_duplicate_delta_is_applied_exactly_once(setup):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    v1, v2 = bf16(weights()), bf16(step(weights(), 0.05, 5))
    await publish(pub, 1, v1)
    sinks["a"].apply(1)
    enc = encode_version(v1, v2, "xor", 1 << 20)
    assert len(enc) == 1
    msg = m.WeightDelta(version=2, base_version=1, bucket_index=0, num_buckets=1,
                        tensors=enc[0].metas, checksum=enc[0].checksum, encoding="xor")
    for _ in range(2):  # a retried / duplicated bucket rebuilds from the base, not in place
        assert isinstance(await sinks["a"].push_weight_delta(msg, enc[0].payload), m.Ack)
    got = sinks["a"].apply(2)
    assert all(torch.equal(got[n], t) for n, t in v2)
    with pytest.raises(RemoteError) as err:
        sinks["a"].apply(2)
    assert err.value.code == "stale_version"
    with pytest.raises(RemoteError) as err:  # and the delta itself is now stale
        await sinks["a"].push_weight_delta(msg, enc[0].payload)
    assert err.value.code == "stale_version"
    await pub.close()


async def test_a_lagging_worker_gets_the_latest_version_in_full(setup):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a", "b"])
    versions = {v: bf16(step(weights(), 0.01, v)) for v in range(1, 5)}
    await publish(pub, 1, versions[1])
    await pub.set_workers(["a"])  # b drops out for versions 2-3
    for v in (2, 3):
        r = await publish(pub, v, versions[v])
        assert r.delta_workers == ["a"]
    await pub.set_workers(["a", "b"])  # b is back: no known base
    r4 = await publish(pub, 4, versions[4])
    assert r4.delta_workers == ["a"] and not r4.failed
    got = sinks["b"].apply(4)
    assert all(torch.equal(got[n], t) for n, t in versions[4])
    await pub.close()


async def test_every_full_every_th_version_goes_in_full(setup):
    make, sinks = setup
    pub = make(full_every=3)
    await pub.set_workers(["a"])
    kinds = []
    for v in range(1, 7):
        r = await publish(pub, v, bf16(step(weights(), 0.01, v)))
        kinds.append(bool(r.delta_workers))
    assert kinds == [False, True, False, True, True, False]
    await pub.close()


async def test_without_deltas_a_worker_keeps_nothing_after_an_apply(setup):
    make, sinks = setup
    pub = make("off")
    await pub.set_workers(["a"])
    for v in (1, 2):
        r = await publish(pub, v, bf16(step(weights(), 0.01, v)))
        assert r.delta_workers == [] and r.wire_bytes == r.num_bytes
    sinks["a"].apply(2)
    assert sinks["a"].stager.staged_versions() == []  # as before delta transfer
    await pub.close()


async def test_with_deltas_the_applied_version_stays_as_the_base(setup):
    make, sinks = setup
    pub = make("xor")
    await pub.set_workers(["a"])
    await publish(pub, 1, bf16(weights()))
    await publish(pub, 2, bf16(step(weights(), 0.01, 2)))
    sinks["a"].apply(2)
    assert sinks["a"].stager.staged_versions() == [2]
    await pub.close()


MINIMAL = (Path(__file__).parents[1] / "minimal_scenario.toml").read_text()


@pytest.mark.parametrize(("trainer", "message"), [
    ('weight_delta = "xor"\nweight_transfer = "gloo"',
     'trainer.weight_delta: \'xor\' needs trainer.weight_transfer = "zmq"'),
    ('weight_delta = "zstd"', "trainer.weight_delta: Invalid enum value 'zstd'"),
    ('weight_wire_dtype = "int8"', "trainer.weight_wire_dtype: Invalid enum value 'int8'"),
    ("weight_full_every = 0", "trainer.weight_full_every: Expected `int` >= 1"),
])
def test_config_delta_fields_are_validated(trainer, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_scenario(MINIMAL.replace("[run]", f"[trainer]\n{trainer}\n[run]", 1), "x.toml")


def test_trainer_gets_the_delta_options_and_float32_masters_with_a_bf16_wire(tmp_path):
    sc = parse_scenario(MINIMAL.replace(
        "[run]", '[trainer]\nweight_delta = "sparse"\nweight_wire_dtype = "bf16"\n'
        "weight_full_every = 7\n[run]", 1))
    argv = trainer_argv(sc, tmp_path, None)
    opts = json.loads(argv[argv.index("--options") + 1])
    assert opts["weight_delta"] == "sparse" and opts["weight_wire_dtype"] == "bf16"
    assert opts["weight_full_every"] == 7 and opts["dtype"] == "float32"


def test_sparse_delta_naming_an_element_outside_the_base_is_refused():
    head = np.array([1], dtype="<u4").tobytes()
    payload = delta.zstandard.ZstdCompressor().compress(
        head + np.array([40], dtype="<u4").tobytes() + b"\x01\x00")
    with pytest.raises(delta.DeltaError, match="names element 40 of 8"):
        delta.decode(np.zeros(16, dtype=np.uint8), payload, "sparse", 2)


async def test_a_tensor_whose_shape_changed_goes_in_full(setup):
    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    await publish(pub, 1, bf16(weights()))
    grown = [(n, torch.cat([t, t]) if n == "norm.weight" else t) for n, t in bf16(weights())]
    r = await publish(pub, 2, grown)
    assert r.delta_workers == [] and not r.failed
    got = sinks["a"].apply(2)
    assert got["norm.weight"].shape == (64,)
    await pub.close()


def _rle_zeros_frame(total: int) -> bytes:
    """A tiny hand-built zstd frame that declares and expands to ``total`` zero bytes (RLE
    blocks of 128 KiB): the shape of a decompression bomb."""
    import struct

    out = bytearray(struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", total))
    block, n = 128 * 1024, total // (128 * 1024)
    for i in range(n):
        out += ((1 if i == n - 1 else 0) | (1 << 1) | (block << 3)).to_bytes(3, "little") + b"\0"
    return bytes(out)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_codec_refuses_a_frame_declaring_more_than_the_base_before_decompressing(encoding):
    import resource

    base = np.zeros(1000, dtype=np.uint8)
    bomb = _rle_zeros_frame(256 << 20)  # 256 MiB declared, ~8 KiB on the wire
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(delta.DeltaError, match="declares 268435456 bytes"):
        delta.decode(base, bomb, encoding, 2)
    # nothing near the declared size was allocated (ru_maxrss is in KiB on Linux)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10
    good = delta.encode(base, base + 1, encoding, 2)
    with pytest.raises(delta.DeltaError, match="trailing data"):
        delta.decode(base, good + good, encoding, 2)


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_a_bucket_mixing_dtypes_goes_as_a_delta_both_ways(setup, encoding):
    # to_wire leaves non-float tensors alone, so a bucket can hold bf16 beside int64 / fp32:
    # trainer and worker must agree on the element size the delta compares in.
    make, sinks = setup
    pub = make(encoding)
    await pub.set_workers(["a"])
    v1 = [("w", torch.zeros(64, dtype=torch.bfloat16)), ("n", torch.zeros(16, dtype=torch.float32)),
          ("i", torch.zeros(8, dtype=torch.int64))]
    v2 = [("w", torch.ones(64, dtype=torch.bfloat16)), ("n", torch.zeros(16, dtype=torch.float32)),
          ("i", torch.arange(8))]
    await publish(pub, 1, v1)
    sinks["a"].apply(1)
    r2 = await publish(pub, 2, v2)
    assert r2.delta_workers == ["a"] and not r2.failed
    got = sinks["a"].apply(2)
    assert all(torch.equal(got[n], t) for n, t in v2)
    await pub.close()


def test_bucket_itemsize_is_the_common_size_or_bytes():
    assert delta.bucket_itemsize(["bfloat16", "float16"]) == 2
    assert delta.bucket_itemsize(["float32"]) == 4
    assert delta.bucket_itemsize(["bfloat16", "float32"]) == 1
    assert delta.bucket_itemsize(["uint16"]) == 1  # unknown size: bytes, on both sides


async def test_a_worker_rebuilds_at_most_rebuild_slots_delta_buckets_at_once(setup, monkeypatch):
    import threading

    make, sinks = setup
    pub = make()
    await pub.set_workers(["a"])
    g = torch.Generator().manual_seed(0)
    six = [(f"t{i}", torch.randn(32, 32, generator=g)) for i in range(6)]  # 3 buckets of 4 KiB
    v1, v2 = bf16(six), bf16(step(six, 0.01, 1))
    await publish(pub, 1, v1)
    sinks["a"].apply(1)
    sent = []
    real_push = sinks["a"].push_weight_delta

    async def recording_push(msg, payload, **kw):
        sent.append((msg, bytes(payload)))
        return await real_push(msg, payload, **kw)

    sinks["a"].push_weight_delta = recording_push
    await publish(pub, 2, v2)
    assert len(sent) >= 3
    # The same buckets again, all at once, to a worker holding base 1 (as a trainer with
    # several buckets in flight sends them).
    real, cond = delta.decode, threading.Condition()
    state = {"active": 0, "peak": 0}

    def counting_decode(*args):
        with cond:
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
            cond.notify_all()
            # Hold the slot until every bucket is inside, or 2 s pass: without the bound all
            # of them get in; with it, never more than REBUILD_SLOTS.
            cond.wait_for(lambda: state["active"] >= len(sent), timeout=2.0)
        try:
            return real(*args)
        finally:
            with cond:
                state["active"] -= 1

    monkeypatch.setattr(delta, "decode", counting_decode)
    bases = sinks["a"].bases
    replies = await asyncio.gather(*(
        bases.stage_delta(wire(msgspec.structs.replace(msg, version=3)), [memoryview(p)], 1)
        for msg, p in sent), return_exceptions=True)
    assert state["peak"] == 2 == WorkerBases.REBUILD_SLOTS, (state, len(sent))
    assert all(isinstance(r, m.Ack) for r in replies), replies
    await pub.close()
