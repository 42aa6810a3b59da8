"""The controller's ports: the small interfaces it needs from the services it drives.

Real clients (``rollart.inference.client.InferenceClient``, ``rollart.envhost.client.EnvClient``,
``rollart.reward.client.RewardClient``, the trainer client) and the in-process simulated backends
of ``rollart.sim`` both satisfy them structurally; the controller never imports a concrete
service. Errors follow ``rollart.transport.errors``: ``RemoteError`` (and ``EnvError``,
``RemoteTimeoutError``) fail one item, ``PeerDeadError`` means the process is gone,
``RewardError`` fails one reward call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

from rollart.transport import messages as m

if TYPE_CHECKING:
    from rollart.controller.buffer.core import Sample


@runtime_checkable
class GenerationBackend(Protocol):
    """One inference worker (``InferenceClient`` or a simulated one).

    ``last_stats`` is the most recent ``WorkerStats`` seen (``None`` before any reply); ``dead``
    turns true once the worker is known to be gone (calls then raise ``PeerDeadError``);
    ``address`` is where the trainer sends it weights (a ZeroMQ endpoint; an in-process worker's
    unique name).
    """

    name: str
    address: str
    last_stats: m.WorkerStats | None

    @property
    def dead(self) -> bool: ...

    async def generate(
        self, request: m.Generate, *, timeout_s: float | None = None
    ) -> m.GenerateResult:
        """Generate; if the awaiting task is cancelled, the request is aborted on the worker."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self, mode: Literal["keep", "abort"] = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def apply_weights(self, version: int, *, reprefill: bool = False) -> m.WeightsApplied:
        """Apply the staged weights of ``version`` (pushed before by the trainer)."""
        ...

    async def stats(self) -> m.WorkerStats: ...


@runtime_checkable
class EnvBackend(Protocol):
    """One environment host (``EnvClient``, a simulated host, or in-process envs)."""

    name: str

    @property
    def dead(self) -> bool: ...

    async def open(
        self,
        env_name: str,
        seed: int,
        options: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> m.EnvOpened: ...

    async def step(
        self, session_id: str, action: str, *, timeout_s: float | None = None
    ) -> m.EnvStepResult: ...

    async def close_session(self, session_id: str) -> None: ...


class RewardOutcome(Protocol):
    """What a reward call returns (``rollart.reward.client.RewardResult`` fits). Read-only, so
    frozen results fit."""

    @property
    def reward(self) -> float: ...

    @property
    def details(self) -> dict[str, Any]: ...


@runtime_checkable
class RewardBackend(Protocol):
    """Scores one response (``RewardClient`` or local functions). Raises ``RewardError``."""

    async def score(
        self,
        name: str,
        prompt: str,
        response: str,
        reference: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> RewardOutcome: ...


class TrainResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Outcome of one training step: the trainer's new ``version`` (previous + 1) and scalar
    ``metrics`` (loss, grad norm, clip fraction, ... as the trainer names them); ``agreement``:
    per sample trained on, in batch order, the engine/trainer agreement (``m.SampleAgreement``;
    empty when the trainer does not report it); ``dropped``: sample_id -> why, samples the
    trainer could not train on (the rest of the batch was trained)."""

    version: int
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    agreement: list[m.SampleAgreement] = msgspec.field(default_factory=list)
    dropped: dict[str, str] = msgspec.field(default_factory=dict)


@runtime_checkable
class TrainerBackend(Protocol):
    """The trainer, as the controller coordinates it (paper §6.2).

    ``version`` is the number of updates applied so far (0 = initial weights, already loaded by
    the inference workers). One step: the controller takes a batch, has the workers apply the
    newest published version (pause -> ``apply_weights`` -> resume), then calls ``train``.
    The trainer owns its transfers (which workers got which version); the controller only asks
    ``push_weights(v, workers)``: "return once v is ready on these workers". Whether that needs
    the workers paused first is ``push_needs_pause``: false, the weights are staged (nothing is
    applied) and the controller runs it in the background, so the transfer overlaps rollout
    (§6.3); true, it writes into the serving models (collective broadcast) and the controller
    calls it only with every worker paused, right before the apply.
    """

    @property
    def version(self) -> int: ...

    @property
    def push_needs_pause(self) -> bool:
        """``push_weights`` writes into the serving models: pause every worker before it."""
        ...

    async def train(self, samples: Sequence[Sample]) -> TrainResult:
        """One update on ``samples`` (whole GRPO groups; advantages are the trainer's job).

        Returns ``TrainResult`` with ``version == self.version`` after the update (previous + 1).
        """
        ...

    async def set_workers(self, workers: Sequence[GenerationBackend]) -> None:
        """The workers later versions go to (called at start, before any ``train``)."""
        ...

    async def push_weights(self, version: int, workers: Sequence[GenerationBackend]) -> None:
        """Return once version ``version`` (must be ``self.version``) is ready on every live
        worker in ``workers``: staged for ``apply_weights``, or (``push_needs_pause``) loaded.
        A trainer that pushes by itself after each step only waits, bringing any worker its
        push did not reach to ``version``. Raises when it failed on a live worker."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer the controller uses (``PreTrainedTokenizerFast``
    fits): chat template rendering to text, encode without added specials, decode.

    ``encode`` may return a list or an integer ndarray. Optional: ``encode_i32(text) -> bytes``
    (the same ids as little-endian int32 bytes), which ``ChatTokens`` prefers when present (it
    skips one Python int per token: ``SimTokenizer`` has it)."""

    # Read-only in the protocol, so a tokenizer whose eos is a plain ``str`` / ``int``
    # attribute fits (a mutable protocol member would have to accept None).
    @property
    def eos_token(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
        **kwargs: Any,
    ) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...
