"""The membership proof of a collective weight-transfer group (``rollart.weights.membership``).

The proof logic in isolation, then the all-gather it runs over a real gloo group (one thread per
rank, in-memory store): the same function serves the NCCL group, which needs a GPU.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from rollart.transport.security import INSECURE, create_key_file, load_key_file
from rollart.weights import membership as mb
from rollart.weights.membership import (
    NONCE_BYTES,
    MembershipError,
    check_proofs,
    expected_proofs,
    membership_key,
    new_nonce,
    proof,
    prove_membership,
)

REFUSING = "refusing to broadcast"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[bytes, bytes]:
    """Membership keys of two different runs."""
    d = tmp_path_factory.mktemp("membership-keys")
    a = load_key_file(create_key_file(Path(d) / "a"))
    b = load_key_file(create_key_file(Path(d) / "b"))
    return membership_key(a), membership_key(b)


def test_membership_key_is_derived_per_run_and_is_not_the_curve_secret(tmp_path):
    import zmq.utils.z85

    run = load_key_file(create_key_file(tmp_path / "k"))
    key = membership_key(run)
    raw = zmq.utils.z85.decode(run.secret)
    assert len(key) == 32 and key != raw
    assert key == hmac.new(raw, mb.LABEL, hashlib.sha256).digest()
    assert key == membership_key(load_key_file(run.path))  # same file, same key
    other = membership_key(load_key_file(create_key_file(tmp_path / "k2")))
    assert other != key
    # INSECURE: a key from no secret; it still differs from any run's key.
    assert membership_key(INSECURE) == hmac.new(b"", mb.LABEL, hashlib.sha256).digest()
    assert membership_key(INSECURE) not in (key, other)


def test_good_proofs_are_accepted(keys):
    nonce = new_nonce()
    want = expected_proofs(keys[0], nonce, 4)
    assert len(want) == 4 and len(set(want)) == 4
    assert all(len(p) == mb.PROOF_BYTES for p in want)
    check_proofs(list(want), want, refusing=REFUSING)  # no error


@pytest.mark.parametrize("bad", ["key", "nonce", "rank", "world_size", "garbage"])
def test_a_wrong_proof_is_refused_naming_the_rank(keys, bad):
    good, other = keys
    nonce = new_nonce()
    want = expected_proofs(good, nonce, 4)
    forged = {
        "key": proof(other, nonce, 3, 4),
        "nonce": proof(good, new_nonce(), 3, 4),
        "rank": want[2],  # another rank's valid proof, replayed
        "world_size": proof(good, nonce, 3, 5),
        "garbage": bytes(32),
    }[bad]
    got = [*want[:3], forged]
    with pytest.raises(MembershipError, match=r"^rank 3 of the weight-transfer group did not "
                                              r"prove the run key: refusing to broadcast$"):
        check_proofs(got, want, refusing=REFUSING)


def test_several_bad_ranks_and_a_wrong_count_are_named(keys):
    nonce = new_nonce()
    want = expected_proofs(keys[0], nonce, 4)
    with pytest.raises(MembershipError, match=r"ranks \[1, 3\] of"):
        check_proofs([want[0], bytes(32), want[2], b"x" * 32], want, refusing=REFUSING)
    with pytest.raises(MembershipError, match="has 3 ranks, expected 4"):
        check_proofs(want[:3], want, refusing=REFUSING)


def test_every_rank_is_compared_in_constant_time(keys, monkeypatch):
    calls = []
    compare = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(mb.hmac, "compare_digest", recording)
    want = expected_proofs(keys[0], new_nonce(), 4)
    with pytest.raises(MembershipError):
        check_proofs([bytes(32), *want[1:]], want, refusing=REFUSING)
    # All four through compare_digest, even after the first mismatch (no early exit).
    assert calls == [(bytes(32), want[0]), *zip(want[1:], want[1:], strict=True)]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=f"must be {NONCE_BYTES} bytes"):
        proof(b"k" * 32, b"short", 0, 2)
    with pytest.raises(ValueError, match="outside a group of 2"):
        proof(b"k" * 32, new_nonce(), 2, 2)
    assert new_nonce() != new_nonce()


def _gloo_group_run(world_size: int, proofs_of: list[list[bytes]]) -> list[BaseException | None]:
    """Run ``prove_membership`` on each rank of a real gloo group (one thread per rank);
    rank ``r`` contributes ``proofs_of[r][r]`` and checks against ``proofs_of[r]``."""
    import torch.distributed as dist

    store = dist.HashStore()
    results: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=60))
            prove_membership(group, rank, proofs_of[rank], refusing=f"rank {rank} refuses")
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_proof_over_a_real_gloo_group_passes_when_every_rank_holds_the_key(keys):
    want = expected_proofs(keys[0], new_nonce(), 3)
    assert _gloo_group_run(3, [want] * 3) == [None, None, None]


def test_a_rank_with_another_key_is_refused_by_every_other_rank(keys):
    nonce = new_nonce()
    want = expected_proofs(keys[0], nonce, 3)
    intruder = expected_proofs(keys[1], nonce, 3)  # knows the nonce, not the run key
    results = _gloo_group_run(3, [want, intruder, want])
    for rank in (0, 2):
        assert isinstance(results[rank], MembershipError)
        assert str(results[rank]) == (f"rank 1 of the weight-transfer group did not prove the "
                                      f"run key: rank {rank} refuses")


class FakeTransferEngine:
    """Records the init requests ``InferenceWorker.transfer_init`` hands to vLLM."""

    def __init__(self) -> None:
        self.inits: list[dict] = []

    async def init_weight_transfer_engine(self, request) -> None:
        self.inits.append(request.init_info)


def _worker(key: bytes | None, num_ranks: int = 1):
    from rollart.inference.engine import SchedulerCounts
    from rollart.inference.worker import InferenceWorker

    return InferenceWorker(FakeTransferEngine(), name="w0", version=0, stager=None,
                           counts=SchedulerCounts(), weight_transfer="gloo",
                           num_ranks=num_ranks, membership_key=key)


def _init(nonce: bytes, rank_offset: int = 1, world_size: int = 3):
    from rollart.transport import messages as m

    return m.WeightTransferInit(master_address="127.0.0.1", master_port=1234, nonce=nonce,
                                rank_offset=rank_offset, world_size=world_size)


async def test_the_worker_hands_its_engine_the_proofs_of_its_key_and_the_nonce(keys):
    worker = _worker(keys[0])
    nonce = new_nonce()
    await worker.transfer_init(_init(nonce), ())
    (info,) = worker.engine.inits
    assert info["membership_proofs"] == [p.hex() for p in expected_proofs(keys[0], nonce, 3)]
    assert info["rank_offset"] == 1 and info["world_size"] == 3


async def test_a_worker_without_a_key_or_with_ranks_outside_the_group_joins_nothing(keys):
    from rollart.transport.errors import RemoteError

    with pytest.raises(RemoteError, match="no run key") as info:
        await _worker(None).transfer_init(_init(new_nonce()), ())
    assert info.value.code == "bad_request"
    worker = _worker(keys[0], num_ranks=2)
    with pytest.raises(RemoteError, match=r"ranks 2..3 do not fit a group of 3"):
        await worker.transfer_init(_init(new_nonce(), rank_offset=2), ())
    assert worker.engine.inits == []


def test_a_nonce_of_the_wrong_length_is_refused_on_the_wire():
    import msgspec

    from rollart.transport import messages as m

    with pytest.raises(msgspec.ValidationError, match="nonce"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(_init(b"short")), type=m.WeightTransferInit)
