"""Membership proof of a collective weight-transfer group: only holders of the run key get weights.

The collective path forms its group over a TCP rendezvous (a torch ``TCPStore``: gloo's
``stateless_init_torch_distributed_process_group``, vLLM's NCCL ``StatelessProcessGroup``)
that authenticates nobody: any process reaching the trainer's rendezvous port while the group
forms could take a rank. So right after the group forms and before any weight crosses it,
every rank proves it holds the run's key, through the group itself:

1. The trainer (group rank 0) draws a fresh ``NONCE_BYTES`` nonce per group
   (``secrets.token_bytes``) and sends it to every worker inside ``WeightTransferInit``,
   over the CURVE-authenticated and encrypted RPC (``rollart.transport.security``).
2. Each side computes the proofs of all ``world_size`` ranks:
   ``proof(r) = HMAC-SHA256(K, nonce || r || world_size)`` (RFC 2104; ``r`` and
   ``world_size`` as 4-byte big-endian, the nonce has a fixed length, so the message is
   unambiguous), with ``K = HMAC-SHA256(curve_secret, LABEL)``: a key derived for this use
   only (HMAC as a PRF with a label, as HKDF-Expand, RFC 5869), never the CURVE secret itself.
3. Every rank contributes its own ``proof(r)`` to one ``all_gather`` of a ``[PROOF_BYTES]``
   uint8 tensor (the same collective on gloo and NCCL) and compares each gathered proof with
   the expected one in constant time (``hmac.compare_digest``). A rank seeing a mismatch drops
   the group and raises ``MembershipError`` naming the ranks: the trainer then never
   broadcasts, and a worker never loads weights from that group.

Because the gather runs over the communicator itself, the proof binds to the processes that
actually hold the ranks, not to whatever was written into the (unauthenticated) store; the
contributions are simultaneous, so an intruder cannot copy another rank's proof, and a proof
is bound to its nonce, rank and group size, so it cannot be replayed into another group.

In the worker, the group's ranks live in vLLM's engine processes, which never see the run key:
the worker's RPC process (which serves with the key) computes the ``world_size`` expected
proofs for this nonce and passes them with the init info; they are worth nothing for any other
nonce.

``INSECURE`` runs have no secret: ``K`` is then derived from an empty secret, so the proof
shows only that a rank received the nonce over the (unencrypted) RPC. That still refuses a
process that merely reaches the rendezvous port, but not one that can read the RPC traffic;
an insecure run is unauthenticated by choice (``check_insecure``).

Not covered: a rank that joins and then never contributes makes the gather wait (gloo: until
``timeout_s``; vLLM's NCCL group takes no timeout), a denial of service, never a leak.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any

import zmq.utils.z85

from rollart.transport.security import Auth, RunKey

log = logging.getLogger(__name__)

#: Length of the per-group nonce, bytes (256 bits: never repeats in practice).
NONCE_BYTES = 32
#: Length of one rank's proof, bytes (an HMAC-SHA256 digest).
PROOF_BYTES = 32
#: Context label of the membership key: this key proves group membership and nothing else.
LABEL = b"rollart/v1/weight-transfer-group-membership"


class MembershipError(RuntimeError):
    """A rank of the weight-transfer group did not prove it holds the run key."""


def membership_key(auth: Auth) -> bytes:
    """The run's membership key ``K`` (32 bytes), derived from the run's CURVE secret key.

    ``INSECURE``: derived from an empty secret (see the module docstring for what that means).
    """
    secret = zmq.utils.z85.decode(auth.secret) if isinstance(auth, RunKey) else b""
    return hmac.new(secret, LABEL, hashlib.sha256).digest()


def new_nonce() -> bytes:
    """A fresh random nonce of ``NONCE_BYTES`` bytes, one per group formation."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, nonce: bytes, rank: int, world_size: int) -> bytes:
    """``HMAC-SHA256(key, nonce || rank || world_size)``: ``PROOF_BYTES`` bytes.

    Raises:
        ValueError: ``nonce`` is not ``NONCE_BYTES`` long, or ``rank`` not in
            ``[0, world_size)``.
    """
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"membership nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    msg = nonce + rank.to_bytes(4, "big") + world_size.to_bytes(4, "big")
    return hmac.new(key, msg, hashlib.sha256).digest()


def expected_proofs(key: bytes, nonce: bytes, world_size: int) -> list[bytes]:
    """The proofs of ranks ``0 .. world_size - 1`` (index = group rank)."""
    return [proof(key, nonce, r, world_size) for r in range(world_size)]


def check_proofs(gathered: list[bytes], expected: list[bytes], *, refusing: str) -> None:
    """Compare every gathered proof with the expected one, in constant time each.

    Args:
        gathered: the proof each group rank contributed (index = group rank).
        expected: ``expected_proofs`` of the same nonce and group size.
        refusing: what this side refuses on a mismatch (ends the error message).
    Raises:
        MembershipError: a rank's proof is wrong, or the counts differ; the message names
            the ranks ("rank 3 of the weight-transfer group did not prove the run key: ...").
    """
    if len(gathered) != len(expected):
        raise MembershipError(f"the weight-transfer group has {len(gathered)} ranks, "
                              f"expected {len(expected)}: {refusing}")
    # Every rank is compared (no early exit), so the time taken says nothing about which.
    bad = [r for r, (got, want) in enumerate(zip(gathered, expected, strict=True))
           if not hmac.compare_digest(got, want)]
    if bad:
        who = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {bad}"
        raise MembershipError(f"{who} of the weight-transfer group did not prove the run "
                              f"key: {refusing}")


def _all_gather(group: Any, mine: bytes, world_size: int) -> list[bytes]:
    """Gather every rank's ``PROOF_BYTES`` over ``group``: a torch ``ProcessGroup`` (gloo,
    CPU tensors; waits at most the group's timeout) or vLLM's ``PyNcclCommunicator`` (tensors
    on its device)."""
    import torch

    cpu = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    if hasattr(group, "allgather"):  # torch.distributed ProcessGroup
        out = [torch.zeros(PROOF_BYTES, dtype=torch.uint8) for _ in range(world_size)]
        group.allgather([out], [cpu]).wait()
        return [bytes(t.tolist()) for t in out]
    # PyNcclCommunicator: a disabled one gathers nothing, so the zeros fail the check (closed).
    # One explicit stream: the input copy, the gather and the wait are ordered on it (vLLM's
    # own default stream differs from torch's on ROCm).
    stream = torch.cuda.current_stream(group.device)
    flat = torch.zeros(world_size * PROOF_BYTES, dtype=torch.uint8, device=group.device)
    group.all_gather(flat, cpu.to(group.device), stream=stream)
    stream.synchronize()
    rows = flat.cpu().view(world_size, PROOF_BYTES)
    return [bytes(row.tolist()) for row in rows]


def prove_membership(group: Any, rank: int, proofs: list[bytes], *, refusing: str) -> None:
    """Contribute this rank's proof to the group's all-gather and check every rank's.

    Every rank of the group must call this once, right after the group formed, before any
    weight is sent or received over it.

    Args:
        group: the formed group (torch ``ProcessGroup`` or ``PyNcclCommunicator``).
        rank: this process's group rank.
        proofs: ``expected_proofs`` for this group (``world_size = len(proofs)``).
        refusing: what this side refuses on a mismatch (ends the error message).
    Raises:
        MembershipError: some rank's proof is wrong (see ``check_proofs``). The caller must
            drop the group.
    """
    gathered = _all_gather(group, proofs[rank], len(proofs))
    check_proofs(gathered, proofs, refusing=refusing)
    log.info("weight-transfer group: all %d ranks proved the run key (rank %d)",
             len(proofs), rank)
