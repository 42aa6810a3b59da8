"""Every message that crosses a process boundary in rollart, as msgspec Structs.

Wire format (ZeroMQ multipart, ROUTER/DEALER):

    frame 0: call id, 8 bytes big-endian unsigned (matches a reply to its request)
    frame 1: msgpack of one ``Request`` (or, in a reply, one ``Reply``) Struct, tagged by class
             name in the ``kind`` field
    frame 2..: raw tensor bytes, one frame per ``TensorMeta`` listed in the message (no pickle)

Small messages (no tensor frames, body <= 64 KiB) that one side queues for the same peer in one
event-loop tick leave as one ZeroMQ message, a batch envelope: ``[b"", blob]`` where ``blob``
repeats ``(body length u32 big-endian, call id 8 bytes, body)``; the empty frame where the
8-byte call id would be marks it. ``rollart.transport.zmqloop`` packs and unpacks it; a server
answers an envelope it cannot unpack (empty, an entry's length past the blob, extra frames) with
a ``bad_request`` naming the entry and byte offset under call id 0, after serving the entries
before it.

A request whose frames cannot be decoded gets an ``ErrorReply`` naming the problem; the server
keeps serving. Structs are ``forbid_unknown_fields`` so a peer of another version fails loudly.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from rollart.transport import tokenbytes as tb

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
#: a trajectory id as inference workers key their held prefixes by it: bounded, because a worker
#: holds up to ``PrefixStore.max_entries`` of them (the controller's are like ``g12/345``)
TrajectoryId = Annotated[str, msgspec.Meta(max_length=256)]

#: Error codes carried by ``ErrorReply.code``. Per-item codes: the peer keeps serving.
ErrorCode = Literal[
    "bad_request",  # frames or fields could not be decoded / failed validation
    "bad_reply",  # client side: the peer's reply could not be decoded / failed validation
    "unknown_kind",  # a message kind this service does not handle
    "too_large",  # message over the service's max_message_bytes
    "not_found",  # unknown request id, session id, env name, ...
    "forbidden",  # refused by an access rule (unregistered worker, path outside a root, ...)
    "env_error",  # the environment raised
    "env_timeout",  # the environment step exceeded its timeout
    "invalid_action",  # the env rejected the model's action (model-caused; session stays open)
    "stale_version",  # a weight version older than (or equal to) the current one
    "checksum_mismatch",  # a weight bucket's bytes do not match its checksum
    "incomplete_version",  # apply requested before every bucket of the version arrived
    "engine_error",  # the inference engine rejected this request
    "prefix_unknown",  # Generate named a trajectory prefix the worker does not hold: resend all
    "internal",  # an unexpected exception in the handler (message has the repr)
    "timeout",  # client side: no reply within timeout_s
]


class Msg(
    msgspec.Struct, tag_field="kind", tag=True, forbid_unknown_fields=True, kw_only=True, gc=False
):
    """Base of every wire message; the class name is the ``kind`` tag.

    ``gc=False`` (inherited by every message): a decoded message cannot form a reference cycle,
    and at 10k trajectories the collector's scans of untracked-able structs were most of the
    controller's GC time.
    """


class TensorMeta(msgspec.Struct, forbid_unknown_fields=True, array_like=True, gc=False):
    """Describes one raw tensor frame.

    ``dtype`` is a torch dtype name without the prefix (``"bfloat16"``, ``"float32"``); ``shape``
    is the tensor shape; ``nbytes`` the frame's exact byte length.
    """

    name: str
    dtype: str
    shape: list[int]
    nbytes: NonNegInt


# ----------------------------------------------------------------------------------------------
# Common
# ----------------------------------------------------------------------------------------------


class Ping(Msg):
    """Liveness probe; every service answers with ``Pong``."""


class Pong(Msg):
    service: str
    pid: int


class Ack(Msg):
    """Generic success reply for requests that return nothing else."""

    detail: str = ""


#: ``ErrorReply.fault``: how a failed request's cause bears on its peer. ``"transient"``: the
#: peer is healthy and the same request may succeed later (an engine paused for a weight update,
#: overloaded, a request it aborted): retry it after a pause, hold nothing against the peer;
#: ``"fatal"``: the peer's own fault (bad output, a crashed engine); ``""``: not classified (a
#: peer that predates the field, or an error that is the request's own, e.g. ``bad_request``).
FAULTS = ("", "transient", "fatal")


class ErrorReply(Msg, omit_defaults=True):
    """A request failed for this item only; ``message`` names what was wrong, ``fault`` (one
    of ``FAULTS``; omitted on the wire when ``""``, so a peer that predates it still decodes
    such replies) how its cause bears on the peer."""

    code: str
    message: str
    fault: str = ""


# ----------------------------------------------------------------------------------------------
# Inference worker
# ----------------------------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """Sampling parameters; mirror vLLM's names. ``max_tokens`` counts generated tokens."""

    max_tokens: PosInt
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    #: also return the prompt's per-token logprobs (``GenerateResult.prompt_logprobs``)
    prompt_logprobs: bool = False
    #: keep generating past eos tokens (``stop_token_ids`` still stop): fixed-length outputs
    #: for benchmarks and tests
    ignore_eos: bool = False


class WorkerStats(Msg):
    """Load and version of one inference worker, attached to replies.

    ``num_running`` / ``num_waiting``: requests this worker is generating / holding back.
    ``version``: policy version whose weights the engine serves now.
    """

    worker: str
    num_running: NonNegInt
    num_waiting: NonNegInt
    version: NonNegInt
    paused: bool = False
    num_generated_tokens: NonNegInt = 0
    #: requests that ended aborted (``Abort`` or ``Pause(abort)``) since the worker started.
    num_aborted: NonNegInt = 0
    #: engine ranks (tensor x pipeline parallel) that join a collective weight transfer.
    num_ranks: PosInt = 1
    #: how this worker receives weights: ``zmq`` (staged buckets), ``nccl`` or ``gloo``.
    weight_transfer: Literal["zmq", "nccl", "gloo"] = "zmq"
    #: share of the engine's KV cache in use, in [0, 1]; ``None``: not reported.
    kv_cache_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    #: tokens the engine's KV cache holds when full (vLLM: ``num_gpu_blocks x block_size``);
    #: ``None``: not reported.
    kv_capacity_tokens: NonNegInt | None = None
    #: tokens per block of the engine's KV cache (vLLM: ``block_size``): a sequence holds
    #: its KV in whole blocks; ``None``: not reported.
    kv_block_tokens: PosInt | None = None


class Generate(Msg):
    """Generate one continuation of a prompt, sent as a delta on a prefix the worker holds.

    The prompt is the first ``prefix_len`` tokens the worker holds for ``trajectory_id``
    followed by ``new_token_ids`` (int32 little-endian bytes, see ``rollart.transport.tokenbytes``).
    After the turn the worker holds that prompt plus the generated tokens, so a trajectory's next
    turn sends only the tokens that came after them (its observation). ``trajectory_id=""``
    (one-off requests): nothing is held and ``prefix_len`` must be 0.

    A worker that does not hold exactly ``prefix_len`` tokens for ``trajectory_id`` (never saw
    it, restarted, evicted it) fails the item with code ``prefix_unknown``: the caller resends the
    whole prompt with ``prefix_len=0``. ``release``: trajectory ids whose prefixes the worker may
    drop now (they finished), piggybacked here to save a message per trajectory.
    """

    request_id: str
    new_token_ids: bytes
    sampling: SamplingParams
    trajectory_id: TrajectoryId = ""
    prefix_len: NonNegInt = 0
    release: list[TrajectoryId] = []
    #: name of a vLLM tool parser (``hermes``, ...): the worker decodes the generated ids and
    #: parses tool calls from the text (``GenerateResult.tool_calls``); "" = no parsing
    tool_parser: Annotated[str, msgspec.Meta(max_length=64)] = ""

    @property
    def num_new_tokens(self) -> int:
        """Tokens in ``new_token_ids`` (its byte length / 4)."""
        return memoryview(self.new_token_ids).nbytes // 4


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """One tool call a vLLM tool parser found in generated text: the function ``name`` and its
    ``arguments`` as a JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str


#: why generation of a turn ended: an eos / stop token, ``max_tokens``, or an abort
FinishReason = Literal["stop", "length", "abort"]


class GenerateResult(Msg):
    """The engine's continuation.

    ``token_ids`` (int32), ``logprobs`` (float32) and ``versions`` (int32) are little-endian
    bytes of ``num_tokens`` items each (``rollart.transport.tokenbytes`` views them as arrays):
    ``logprobs[i]`` is the behaviour logprob (natural log, under the distribution actually
    sampled) of ``token_ids[i]``; ``versions[i]`` is the policy version that produced it.
    ``finish_reason``: ``"stop"`` (eos / stop token), ``"length"`` (hit ``max_tokens`` or the
    model's context), ``"abort"`` (aborted: the tokens so far are returned).
    ``num_prompt_tokens``: the whole prompt's length (held prefix + new tokens).
    ``prompt_logprobs``: when requested, one entry per prompt token (``None`` for the first);
    opt-in diagnostics, so a plain list.

    Raises ``ValueError`` (a ``bad_reply`` where decoded) on ragged or unequal per-token
    lengths, a negative token id or version, or a logprob that is NaN, infinite or > 0.
    """

    request_id: str
    token_ids: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: FinishReason
    num_prompt_tokens: NonNegInt
    stats: WorkerStats
    prompt_logprobs: list[float | None] | None = None
    #: only when ``Generate.tool_parser`` was set: the tool calls vLLM's parser found in the
    #: generated text (empty: none) and the message content outside them (``None``: none)
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    #: prompt tokens the engine took from its prefix cache instead of computing them (vLLM's
    #: ``RequestOutput.num_cached_tokens``); ``None``: not reported, or an engine without a
    #: prefix cache.
    num_cached_tokens: NonNegInt | None = None

    def __post_init__(self) -> None:
        # Checked where the reply is decoded, so a broken worker fails that request only (the
        # client sees bad_request); a NaN or positive logprob reaching a batch would make the
        # importance ratio NaN / wrong for every sample of the step, and TrainSample refuses it
        # only once the batch is built (a failed step, not a failed trajectory).
        nt, nl, nv = len(self.token_ids), len(self.logprobs), len(self.versions)
        if nt % 4 or nl != nt or nv != nt:
            raise ValueError(f"request {self.request_id!r}: {nt} bytes of token_ids, {nl} of "
                             f"logprobs, {nv} of versions (4 per token each)")
        if 0 < nt <= tb.SMALL_BYTES:
            # A short turn: plain Python over the items beats numpy's per-call overhead.
            problem = tb.small_turn_problem(self.token_ids, self.logprobs, self.versions)
            if problem is not None:
                raise ValueError(f"request {self.request_id!r}: {problem}")
        elif nt:
            # Token ids and versions are never negative: a negative id would fail the
            # controller's detokenizer (and every later use), a negative version the sample.
            ints = np.frombuffer(self.token_ids + self.versions, dtype=tb.I32)
            if ints.min() < 0:
                k = int(np.argmax(ints < 0))
                what = "token id" if k < nt // 4 else "version"
                raise ValueError(f"request {self.request_id!r}: negative {what} {int(ints[k])}")
            lps = np.frombuffer(self.logprobs, dtype=tb.F32)
            # NaN fails the first comparison (max propagates it), -inf the second.
            if not (lps.max() <= 0.0 and lps.min() > -np.inf):
                bad = lps[~(np.isfinite(lps) & (lps <= 0.0))]
                raise ValueError(f"request {self.request_id!r}: logprob {float(bad[0])} of a "
                                 "generated token must be finite and <= 0")

    @property
    def num_tokens(self) -> int:
        """Generated tokens (``token_ids`` byte length / 4)."""
        return memoryview(self.token_ids).nbytes // 4


class Abort(Msg):
    """Abort one request; its pending ``Generate`` replies with ``finish_reason="abort"``."""

    request_id: str


class Pause(Msg):
    """Pause generation. ``keep``: in-flight requests wait, keeping their KV cache;
    ``abort``: in-flight requests are aborted and reply with what they produced."""

    mode: Literal["keep", "abort"] = "keep"


class Resume(Msg):
    """Resume generation after ``Pause``."""


class GetStats(Msg):
    """Ask a worker for its ``WorkerStats``."""


class WeightBucket(Msg):
    """One bucket of a weight version; tensor bytes follow as frames, in ``tensors`` order.

    ``checksum``: CRC32 (``zlib.crc32``) over the concatenated tensor frames, as 8 hex digits.
    Buckets are staged; nothing is applied until ``ApplyWeights`` for the same ``version``.
    ``keep_as_base``: deltas (``WeightDelta``) will follow: keep this version after it is
    applied, as the base they are rebuilt on.
    """

    version: PosInt
    bucket_index: NonNegInt
    num_buckets: PosInt
    tensors: list[TensorMeta]
    checksum: str
    keep_as_base: bool = False


class ApplyWeights(Msg):
    """Apply staged version ``version`` (every bucket must have arrived).

    The reply (``WeightsApplied``) comes only after the engine serves the new weights. Versions
    not newer than the current one are rejected with ``stale_version``.
    ``reprefill``: recompute the KV cache of in-flight requests under the new weights (the
    paper's sync protocol, §6.2) instead of keeping KV computed by the old ones.
    """

    version: PosInt
    reprefill: bool = False


class WeightsApplied(Msg):
    version: NonNegInt
    apply_time_s: float
    stats: WorkerStats


class WeightDelta(Msg):
    """One bucket of ``version`` encoded against the worker's copy of ``base_version``
    (``rollart.weights.delta``); one frame follows: the ``encoding``'s zstd payload.

    ``tensors``: the rebuilt tensors (names, wire dtype, shapes, byte sizes), whose bytes the
    base holds under the same names; ``checksum``: CRC32 of the *rebuilt* bucket, as
    ``WeightBucket``'s. Bucket indices and tensor names match a full push of the version, so
    full and delta buckets of one version can be mixed. The reply is ``Ack`` (staged as a full
    bucket would be) or ``NeedFullVersion`` (the worker does not hold ``base_version``).
    """

    version: PosInt
    base_version: NonNegInt
    bucket_index: NonNegInt
    num_buckets: PosInt
    tensors: list[TensorMeta]
    checksum: str
    encoding: Literal["xor", "sparse"]


class NeedFullVersion(Msg):
    """Reply to ``WeightDelta``: this worker cannot rebuild ``version`` from ``base_version``
    (it never held that base, or discarded it); send the version in full (``WeightBucket``)."""

    version: NonNegInt
    base_version: NonNegInt
    reason: str


class WeightTransferInit(Msg):
    """Join the trainer's collective weight-transfer group (workers started with
    ``--weight-transfer nccl|gloo``). The reply comes once every rank has joined: the trainer
    opens group rank 0 concurrently.

    ``rank_offset``: group rank of this worker's first engine rank (the trainer is rank 0).
    ``world_size``: trainer + every engine rank of every worker. ``timeout_s``: rendezvous and
    per-broadcast limit (gloo). ``packed*``: vLLM's NCCL packing (buffer bytes, buffers in flight).
    ``nonce``: the group's fresh 32-byte nonce; every rank proves the run key with it before
    any weight is sent (``rollart.weights.membership``).
    """

    master_address: Annotated[str, msgspec.Meta(min_length=1)]
    nonce: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    rank_offset: PosInt
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    packed: bool = True
    packed_buffer_size_bytes: PosInt = 1 << 30
    packed_num_buffers: PosInt = 2


class WeightTransferStart(Msg):
    """Begin receiving a version over the group; the worker must be paused."""


class WeightTransferUpdate(Msg):
    """Receive and load the tensors the trainer now broadcasts, in this order.

    ``dtype_names``: torch dtype names without prefix; ``shapes``: full (unsharded) shapes.
    The reply comes once every tensor is loaded. A failure part-way is fatal for the worker
    (its model holds a mix of versions).
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[NonNegInt]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names / dtype_names / shapes lengths differ: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


class WeightTransferFinish(Msg):
    """End the update: the model now holds ``version``; ``ApplyWeights(version)`` then only
    relabels tokens and drops stale prefix-cache blocks (no reload)."""

    version: PosInt


class WeightTransferShutdown(Msg):
    """Leave the group (the trainer re-forms it when the worker set changes)."""


# ----------------------------------------------------------------------------------------------
# Environment host
# ----------------------------------------------------------------------------------------------


class EnvOpen(Msg):
    """Open a session of env ``env_name`` (e.g. ``"game:GuessTheNumber-v0-easy"``,
    ``"rg:basic_arithmetic"``, ``"py:pkg.mod:Class"``) reset with ``seed``."""

    env_name: str
    seed: int
    options: dict[str, Any] = {}


class EnvOpened(Msg):
    """First observation (text) of a new session, and the env's info."""

    session_id: str
    observation: str
    info: dict[str, Any] = {}


class EnvStep(Msg):
    session_id: str
    action: str


class EnvStepResult(Msg):
    """Gymnasium-style step result. ``reward`` is the env's own per-step reward (float).

    ``closed``: the host has closed the session after this step, because the episode ended
    (``terminated`` or ``truncated``): the caller need not send ``EnvClose`` (one RPC per
    trajectory saved), and one it sends anyway is acknowledged as already closed. False when
    the episode goes on, or when the client closed the session during this step. As every
    wire message, it is decoded strictly: the processes of a run run one rollart version."""

    session_id: str
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = {}
    closed: bool = False


class EnvClose(Msg):
    session_id: str


class EnvHostStats(Msg):
    host: str
    num_sessions: NonNegInt
    num_steps: NonNegInt
    num_errors: NonNegInt


class GetEnvStats(Msg):
    """Ask an env host for its ``EnvHostStats``."""


# ----------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------


class TrainSample(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """One trajectory's tokens as the trainer consumes them.

    Fields are little-endian bytes (``rollart.transport.tokenbytes``): ``token_ids`` int32,
    ``num_tokens`` items, the full sequence (prompt, generated tokens, environment turns);
    ``loss_mask`` uint8, ``num_tokens`` items, 1 where token t was generated by the policy, 0
    elsewhere (and at t = 0, which has no prefix); ``behaviour_logprobs`` float32, the inference
    engine's logprob of each generated token, in order: ``num_loss_tokens`` items (one per 1
    of ``loss_mask``). A per-token ``behaviour_logprobs`` (``num_tokens`` items, 0.0 where not
    generated: older senders, hand-built batches) is accepted as well; :meth:`full_logprobs`
    reads either form per token. ``behaviour_versions`` int32, one per generated token in order
    (``num_loss_tokens`` items), the policy version that generated it, or empty (unknown: older
    senders, hand-built batches); the trainer's engine/trainer agreement reports the tokens
    generated under the weights it recomputes with apart (``SampleAgreement.current_*``), so
    a policy that moved within the staleness bound need not read as an engine that
    disagrees.
    ``advantage`` is the trajectory's (GRPO) advantage. ``domain``: the task domain of the
    trajectory (the trainer's per-domain metrics, e.g. policy entropy, group by it; empty:
    unknown, counted in the batch's totals only). Any contiguous buffer
    (``memoryview``, ``array.array``) of those dtypes may be passed when constructing;
    :meth:`from_lists` packs Python lists. Validation is vectorised (numpy).

    Raises:
        ValueError: naming the sample and what is wrong (ragged or unequal lengths, mask values
            not 0/1, ``loss_mask[0]``, no generated token, negative ids, non-finite advantage,
            a generated token's logprob not finite or > 0, ``behaviour_versions`` not one per
            generated token or negative).
    """

    token_ids: bytes
    loss_mask: bytes
    behaviour_logprobs: bytes
    advantage: float
    sample_id: str
    behaviour_versions: bytes = b""
    domain: str = ""

    @classmethod
    def from_lists(cls, *, token_ids, loss_mask, behaviour_logprobs, advantage: float,
                   sample_id: str, behaviour_versions=None, domain: str = "") -> TrainSample:
        """Build from Python sequences (tests, tools): packs them into the wire dtypes."""
        return cls(token_ids=tb.pack_i32(token_ids), loss_mask=tb.pack_u8(loss_mask),
                   behaviour_logprobs=tb.pack_f32(behaviour_logprobs), advantage=advantage,
                   sample_id=sample_id,
                   behaviour_versions=(b"" if behaviour_versions is None
                                       else tb.pack_i32(behaviour_versions)),
                   domain=domain)

    def __post_init__(self) -> None:
        sid = self.sample_id
        try:
            ids = tb.view_i32(self.token_ids)
            mask = tb.view_u8(self.loss_mask)
            lps = tb.view_f32(self.behaviour_logprobs)
        except ValueError as exc:
            raise ValueError(f"sample {sid!r}: {exc}") from None
        n = ids.size
        if n < 2:
            raise ValueError(f"sample {sid!r}: needs at least 2 tokens, got {n}")
        if mask.size != n:
            raise ValueError(
                f"sample {sid!r}: token_ids/loss_mask lengths {n}/{mask.size} differ")
        # One pass: the largest mask value and where it first occurs (0: nothing generated;
        # 1: the first generated token, so the counts skip the prompt before it).
        first = int(mask.argmax())
        top = int(mask[first])
        if top > 1:
            raise ValueError(f"sample {sid!r}: loss_mask values must be 0 or 1")
        if mask[0]:
            raise ValueError(f"sample {sid!r}: loss_mask[0] must be 0 (no prefix)")
        if not top:
            raise ValueError(f"sample {sid!r}: no generated token in loss_mask")
        num_gen = int(np.count_nonzero(mask[first:]))
        if lps.size == num_gen:
            gen = lps
        elif lps.size == n:
            gen = lps[first:][mask[first:].view(np.bool_)]
        else:
            raise ValueError(
                f"sample {sid!r}: behaviour_logprobs has {lps.size} items: expected one per "
                f"generated token ({num_gen}) or one per token ({n})")
        if ids.min() < 0:
            raise ValueError(f"sample {sid!r}: negative token id")
        if not math.isfinite(self.advantage):
            raise ValueError(f"sample {sid!r}: advantage {self.advantage} not finite")
        if gen.size <= tb.SMALL_BYTES // 4:  # a few tokens: plain Python beats three ufunc calls
            bad_lp = next((x for x in gen.tolist() if not -math.inf < x <= 0.0), None)
        else:
            bad = ~(np.isfinite(gen) & (gen <= 0.0))
            bad_lp = float(gen[bad][0]) if bad.any() else None
        if bad_lp is not None:  # NaN fails both comparisons above
            raise ValueError(
                f"sample {sid!r}: behaviour logprob {bad_lp} of a generated token "
                "must be finite and <= 0"
            )
        if self.behaviour_versions:
            try:
                vs = tb.view_i32(self.behaviour_versions)
            except ValueError as exc:
                raise ValueError(f"sample {sid!r}: behaviour_versions: {exc}") from None
            if vs.size != num_gen:
                raise ValueError(
                    f"sample {sid!r}: behaviour_versions has {vs.size} items: expected one per "
                    f"generated token ({num_gen})")
            if int(vs.min()) < 0:
                raise ValueError(f"sample {sid!r}: negative behaviour version {int(vs.min())}")

    def full_logprobs(self) -> np.ndarray:
        """float32 [num_tokens]: each generated token's behaviour logprob at its position, 0.0
        elsewhere, from either form of ``behaviour_logprobs`` (a new array)."""
        lps = tb.view_f32(self.behaviour_logprobs)
        generated = tb.view_u8(self.loss_mask).view(np.bool_)
        if lps.size == generated.size:  # the per-token form: whatever it holds off the mask
            return np.where(generated, lps, np.float32(0.0))
        out = np.zeros(generated.size, dtype=np.float32)
        out[generated] = lps
        return out

    def generated_at(self, version: int) -> np.ndarray | None:
        """bool [num_tokens]: the generated tokens whose behaviour version is ``version``;
        ``None`` when the sample carries no ``behaviour_versions`` (unknown)."""
        if not self.behaviour_versions:
            return None
        generated = tb.view_u8(self.loss_mask).view(np.bool_)
        out = np.zeros(generated.size, dtype=np.bool_)
        out[generated] = tb.view_i32(self.behaviour_versions) == version
        return out

    @property
    def num_tokens(self) -> int:
        return memoryview(self.token_ids).nbytes // 4

    @property
    def num_loss_tokens(self) -> int:
        """Tokens with loss mask 1 (generated by the policy)."""
        return int(np.count_nonzero(np.frombuffer(self.loss_mask, dtype=np.uint8)))


class TrainBatch(Msg):
    """Train one step on ``samples`` (advantages already computed by the controller).

    ``version``: the trainer's version the sender expects it to hold (the update makes
    ``version + 1``); a batch for any other version is refused (``stale_version``), so a batch
    sent twice or after a trainer restart is never trained on the wrong weights."""

    version: NonNegInt
    samples: list[TrainSample]


class SampleAgreement(msgspec.Struct, forbid_unknown_fields=True, array_like=True, gc=False):
    """Engine/trainer agreement on one sample's generated tokens, from the trainer's recompute
    under the weights before the update, version V (``w_t = exp(logp_trainer_t -
    logp_behaviour_t)``).

    Over all its generated tokens: ``logprob_mismatch``, mean ``|log w_t|`` (nats per token);
    ``iw_max``, max ``w_t``; ``iw_capped_fraction``, the fraction with ``w_t`` over the
    trainer's ``iw_cap`` (0.0 without a cap). A token generated under an older version (up to
    alpha behind) differs by the policy's own change too, so ``current_tokens`` counts the
    tokens generated under version V (from ``TrainSample.behaviour_versions``; 0 without
    them) and the ``current_*`` fields are the same three figures over those tokens alone
    (0.0 over none): the engine's agreement with the trainer, without the policy's change.
    """

    logprob_mismatch: float
    iw_max: float
    iw_capped_fraction: float
    current_tokens: int = 0
    current_logprob_mismatch: float = 0.0
    current_iw_max: float = 0.0
    current_iw_capped_fraction: float = 0.0


class TrainResult(Msg):
    """The optimizer step is done; ``version`` (= updates applied) is being pushed to workers.

    ``agreement``: one entry per sample trained on, in batch order (empty from a trainer that
    does not report it). ``dropped``: sample_id -> why, samples of the batch the trainer could
    not train on (the others were trained). ``step``: the trainer's index of this step
    (0-based; equals ``version - 1`` unless a checkpoint says otherwise)."""

    step: NonNegInt
    version: NonNegInt
    metrics: dict[str, float]
    train_time_s: float
    agreement: list[SampleAgreement] = []
    dropped: dict[str, str] = {}


class RegisterWorkers(Msg):
    """The run's inference worker addresses, sent once by the controller: the only workers the
    trainer will ever send weights to (``rollart.trainer.access``), and its push set from now
    on. A later ``RegisterWorkers`` naming another address is refused (``forbidden``)."""

    addresses: Annotated[list[str], msgspec.Meta(min_length=1)]


class SetWorkers(Msg):
    """Registered worker addresses the trainer pushes each new version to (a dead one left
    out); an unregistered address is refused (``forbidden``)."""

    addresses: list[str]


class WaitPublished(Msg):
    """ZeroMQ weight transfer only: reply (``Published``) once ``version`` is staged on every
    worker its background push went to and on each of ``addresses`` (registered workers; the
    trainer pushes its latest version to those its step's push did not include: a worker
    registered later, a resumed run's workers). ``version`` must then be the trainer's latest
    (else ``not_found``). A collective trainer refuses it (``bad_request``: ``BroadcastVersion``)."""

    version: PosInt
    addresses: list[str] = []


class BroadcastVersion(Msg):
    """Collective weight transfer (``nccl`` / ``gloo``) only: broadcast the trainer's current
    weights as ``version`` (must be its current version, else ``not_found``) into every
    registered worker's model now; the workers must be paused. Reply ``Published`` once every
    worker loaded it. A ZeroMQ trainer refuses it (``bad_request``: ``WaitPublished``)."""

    version: PosInt


class PublishLatest(Msg):
    """Push the latest version to ``addresses`` now (registered workers that missed versions;
    an unregistered address is refused, ``forbidden``)."""

    addresses: list[str]


class Published(Msg):
    """``num_bytes``: one full copy of the version in the wire dtype. ``wire_bytes``: tensor
    and delta payload bytes actually sent, all workers together (``[trainer] weight_delta``).
    ``delta_workers``: workers that received the version as a delta (the rest got it in full).
    """

    version: NonNegInt
    total_s: float
    num_bytes: NonNegInt
    failed: dict[str, str] = {}
    wire_bytes: NonNegInt = 0
    delta_workers: list[str] = []


class SaveCheckpoint(Msg):
    """Save model + optimizer (DCP) and trainer state under directory ``path``, relative to the
    trainer's checkpoint directory (``step_000042``); an absolute path or one resolving outside
    it is refused (``forbidden``). ``CheckpointSaved.path`` is the resolved directory."""

    path: str


class CheckpointSaved(Msg):
    path: str
    version: NonNegInt
    save_time_s: float


class GetTrainerState(Msg):
    """Ask the trainer for its ``TrainerStatus``."""


class TrainerStatus(Msg):
    """``weight_transfer``: ``zmq`` pushes each version in the background right after its step;
    ``nccl`` / ``gloo`` broadcast it when asked (``BroadcastVersion``), with the workers paused."""

    version: NonNegInt
    step: NonNegInt
    num_parameters: NonNegInt
    weight_transfer: Literal["zmq", "nccl", "gloo"] = "zmq"


# ----------------------------------------------------------------------------------------------
# Reward service (HTTP JSON bodies, not ZeroMQ; see rollart.reward.protocol for status codes)
# ----------------------------------------------------------------------------------------------


class RewardRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/reward/{name}``."""

    prompt: str
    response: str
    reference: Any = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class RewardResponse(msgspec.Struct):
    """Successful reply: ``reward`` is finite; ``details`` is function-specific."""

    reward: float
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorResponse(msgspec.Struct):
    """Any non-200 reply."""

    error: str


# ----------------------------------------------------------------------------------------------
# Unions decoded by services and clients
# ----------------------------------------------------------------------------------------------

Request = (
    Ping
    | Generate
    | Abort
    | Pause
    | Resume
    | GetStats
    | WeightBucket
    | WeightDelta
    | ApplyWeights
    | WeightTransferInit
    | WeightTransferStart
    | WeightTransferUpdate
    | WeightTransferFinish
    | WeightTransferShutdown
    | EnvOpen
    | EnvStep
    | EnvClose
    | GetEnvStats
    | TrainBatch
    | RegisterWorkers
    | SetWorkers
    | WaitPublished
    | BroadcastVersion
    | PublishLatest
    | SaveCheckpoint
    | GetTrainerState
)

Reply = (
    Pong
    | Ack
    | ErrorReply
    | WorkerStats
    | GenerateResult
    | WeightsApplied
    | NeedFullVersion
    | EnvOpened
    | EnvStepResult
    | EnvHostStats
    | TrainResult
    | Published
    | CheckpointSaved
    | TrainerStatus
)
