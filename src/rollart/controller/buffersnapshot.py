"""The sample buffer's checkpoint format: ``SampleBuffer.snapshot()`` and ``restore()``.

A snapshot is a JSON-able dict (``format`` 2): the buffer's config, its version, the next
trajectory sequence number, and every open group's slots with their held samples. Checkpoints
already written must keep restoring: the layout changes only with a new ``SNAPSHOT_FORMAT``
that ``restore`` tells apart. Format 2 (2026-12-02) holds each sample's behaviour logprobs and
versions for its generated tokens only; format 1 held them per token, and ``Sample`` reads
both, so both restore. A rollart that knows only format 1 refuses a format-2 checkpoint by its
number instead of failing on a sample's lengths.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from rollart.controller.buffergroups import new_traj, sweep_stale
from rollart.controller.bufferrecords import Group, TrajState
from rollart.controller.sample import Sample
from rollart.transport.errors import ConfigError

if TYPE_CHECKING:
    from rollart.controller.buffer import SampleBuffer

SNAPSHOT_FORMAT = 2
#: formats ``restore`` reads (see the module docstring)
READABLE_FORMATS = (1, 2)
#: the ``SampleBuffer`` settings a snapshot records (its ``config``), as keyword arguments
CONFIG_KEYS = (
    "alpha",
    "batch_size",
    "group_size",
    "redundancy",
    "selection",
    "check",
    "on_stale",
    "max_attempts",
    "fresh_start",
    "abort_stale",
    "staleness_control",
)


def snapshot(buf: SampleBuffer) -> dict[str, Any]:
    """``SampleBuffer.snapshot()`` (its docstring)."""
    groups = []
    for g in sorted(buf._groups.values(), key=lambda g: g.seq):
        if g.status != "open":
            continue
        groups.append(
            {
                "key": g.key,
                "domain": g.domain,
                "alpha": g.alpha,
                "selected": g.selected,
                "closing": g.closing,
                "slots": [
                    None
                    if t is None or not buf._slot_open(t)
                    else {
                        "attempt": t.attempt,
                        "state": "held" if t.state is TrajState.HELD else "running",
                        "kept": t in g.kept,
                        "min_version": t.min_version,
                        "sample": msgspec.to_builtins(t.sample)
                        if t.sample is not None
                        else None,
                    }
                    for t in g.slots
                ],
            }
        )
    return {
        "format": SNAPSHOT_FORMAT,
        "config": {k: getattr(buf, k) for k in CONFIG_KEYS},
        "version": buf._version,
        "next_seq": buf._next_seq,
        "groups": groups,
    }


def restore(
    cls: type[SampleBuffer],
    snap: dict[str, Any],
    *,
    rng: random.Random | None,
    on_drop: Callable[[str, str], None] | None,
    on_forget: Callable[[str], None] | None,
) -> SampleBuffer:
    """``SampleBuffer.restore()`` (its docstring): a ``cls`` built from ``snap``."""
    if snap.get("format") not in READABLE_FORMATS:
        raise ConfigError(
            f"SampleBuffer.restore: unknown snapshot format {snap.get('format')!r} (this "
            f"rollart reads formats {list(READABLE_FORMATS)})"
        )
    buf = cls(**snap["config"], initial_version=snap["version"], rng=rng, on_drop=on_drop,
              on_forget=on_forget)
    buf._next_seq = snap["next_seq"]
    # Every version's batch was admitted before it was trained; the open groups come back.
    buf._admitted_groups = (buf._version * (buf.batch_size // buf.group_size)
                            + len(snap["groups"]))
    for gs in snap["groups"]:
        g = Group(
            key=gs["key"],
            seq=buf._group_seq,
            slots=[None] * len(gs["slots"]),
            selected=gs["selected"],
            closing=gs["closing"],
            domain=gs.get("domain", "default"),
            alpha=gs.get("alpha", buf.alpha),
        )
        buf._group_seq += 1
        buf._groups[g.key] = g
        for i, ss in enumerate(gs["slots"]):
            if ss is None:
                continue
            if ss["state"] == "running":
                buf._restarts.append(new_traj(buf, g, i, ss["attempt"]).tid)
                continue
            t = new_traj(buf, g, i, ss["attempt"], tid=ss["sample"]["sample_id"])
            t.sample = msgspec.convert(ss["sample"], Sample)
            t.state, t.min_version = TrajState.HELD, ss["min_version"]
            (g.kept if ss["kept"] else g.finished).append(t)
        if len(g.kept) == buf.group_size:
            buf._ready[g.key] = g
    buf._fresh_bound = None
    sweep_stale(buf)
    return buf
