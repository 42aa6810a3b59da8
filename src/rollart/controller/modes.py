"""The five rollout/training modes as data, and the turn barrier of ``sync`` mode.

All modes run the same controller code; a :class:`ModeSpec` switches these things:

==========  =========  ============  ================  =====================================
mode        overlap    turn barrier  staleness check   admission
==========  =========  ============  ================  =====================================
sync        no         yes           per turn (a=0)    one batch in flight
sync_plus   no         no            per turn (a=0)    one batch in flight
one_off     yes        no            at admission      one batch in flight, started per step
areal       yes        no            none (AReaL)      AReaL's capacity (eta + v + 1) x batch
rollart     yes        no            every turn        buffer bound (alpha + 1) x batch
==========  =========  ============  ================  =====================================

``overlap = False``: generation is paused while the trainer trains, and the new weights are
applied before it resumes (rollout, then train, then sync). ``overlap = True``: the paper's
protocol, get batch -> pause -> apply the newest weights -> resume -> train while rollout
continues. ``one_off`` keeps at most one batch of groups in flight beyond the one being trained,
so the rollout of step k+1 overlaps the training of step k and nothing more (batch level).

``staleness_control = "areal"`` (mode ``areal`` only): AReaL's policy, not rollart's bound.
Alpha only enters AReaL's admission capacity ``(eta + v + 1) * B - (accepted + running)``;
no sample is checked at a turn, at completion or at batch assembly, so samples that finish
stale are trained (``rollart.controller.buffer.core``, module docstring; the step metrics'
``staleness_max`` shows how stale).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "sync_plus", "one_off", "areal", "rollart"]


@dataclass(frozen=True)
class ModeSpec:
    """How a mode drives the shared controller (see the module table)."""

    name: Mode
    overlap: bool
    turn_barrier: bool
    check: Literal["per_turn", "admission"]
    #: limit groups in flight (running or completed, not consumed) to one batch's worth
    one_batch_in_flight: bool
    #: ``"bound"``: alpha bounds every trained sample; ``"areal"``: AReaL's admission capacity
    #: only, stale samples kept (``SampleBuffer(staleness_control=...)``)
    staleness_control: Literal["bound", "areal"] = "bound"


MODES: dict[str, ModeSpec] = {
    "sync": ModeSpec("sync", overlap=False, turn_barrier=True, check="per_turn",
                     one_batch_in_flight=True),
    "sync_plus": ModeSpec("sync_plus", overlap=False, turn_barrier=False, check="per_turn",
                          one_batch_in_flight=True),
    "one_off": ModeSpec("one_off", overlap=True, turn_barrier=False, check="admission",
                        one_batch_in_flight=True),
    "areal": ModeSpec("areal", overlap=True, turn_barrier=False, check="admission",
                      one_batch_in_flight=False, staleness_control="areal"),
    "rollart": ModeSpec("rollart", overlap=True, turn_barrier=False, check="per_turn",
                        one_batch_in_flight=False),
}


def mode_spec(mode: str) -> ModeSpec:
    """The spec of ``mode``. Raises ValueError for an unknown mode."""
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; modes: {sorted(MODES)}") from None


class TurnBarrier:
    """Batch-level rollout (``sync`` mode): every member waits for all members at each turn.

    Members ``join`` when their trajectory starts and ``leave`` when it ends (idempotent). A
    member calls ``wait`` before generating a turn; the waiters are released together when every
    current member is waiting, so a slow env step of one member holds back the whole batch,
    exactly the straggler effect trajectory-level rollout avoids. A member that leaves (finished,
    failed, cancelled) no longer holds the others back.
    """

    def __init__(self) -> None:
        self._members: set[str] = set()
        self._waiting: set[str] = set()
        self._release = asyncio.Event()
        #: number of times the waiters were released together (one per batched turn)
        self.rounds = 0

    @property
    def num_members(self) -> int:
        return len(self._members)

    def join(self, member: str) -> None:
        self._members.add(member)

    def leave(self, member: str) -> None:
        if member in self._members:
            self._members.discard(member)
            self._waiting.discard(member)
            self._maybe_release()

    def _maybe_release(self) -> None:
        if self._waiting and self._waiting >= self._members:
            self._waiting.clear()
            self._release.set()
            self._release = asyncio.Event()
            self.rounds += 1

    async def wait(self, member: str) -> None:
        """Wait until every member is waiting too. Raises KeyError for a non-member."""
        if member not in self._members:
            raise KeyError(f"{member!r} is not a member of the turn barrier")
        release = self._release
        self._waiting.add(member)
        self._maybe_release()
        if not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                self._waiting.discard(member)
                raise
