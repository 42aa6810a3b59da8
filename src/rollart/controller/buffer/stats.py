"""The sample buffer's counters and their report, ``SampleBuffer.stats()``.

The counters themselves are plain ints and dicts on the ``SampleBuffer`` (its hot paths bump
them in place); this module names them and turns them, with one pass over the groups in
flight for the gauges, into a ``BufferStats``. What each counts is in
``rollart.controller.buffer.core``'s module docstring ("Waste and selection accounting").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from rollart.controller.buffer.records import LIVE
from rollart.controller.buffer.sample import BufferStats

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer

#: the buffer's plain event counters (``SampleBuffer._c``), each from 0
COUNTERS = (
    "started",
    "completed",
    "consumed",
    "batches",
    "retries",
    "restarted_stale",
    "replaced_stale",
    "cancelled",
    "groups_retired",
    "late_calls",
    "finished_members",
    "finished_len",
    "kept_members",
    "kept_len",
    "cancelled_len",
)


def buffer_stats(buf: SampleBuffer) -> BufferStats:
    """``SampleBuffer.stats()``: a copy of every counter and the gauges of this moment."""
    c = buf._c
    # One pass, no list per group: at 10k trajectories this runs on the loop every step.
    running = held = in_flight_tokens = 0
    for g in buf._groups.values():
        for t in g.slots:
            if t is not None and t.state in LIVE:
                running += 1
                in_flight_tokens += t.num_tokens
        for t in g.kept:
            in_flight_tokens += t.num_tokens
        for t in g.finished:
            in_flight_tokens += t.num_tokens
        held += len(g.kept) + len(g.finished)
    st = buf._last_staleness
    return BufferStats(
        version=buf._version,
        alpha=buf.alpha,
        batch_size=buf.batch_size,
        group_size=buf.group_size,
        redundancy=buf.redundancy,
        max_groups=buf.max_groups,
        groups_in_flight=len(buf._groups),
        running=running,
        held=held,
        in_flight=running + held,
        in_flight_bound=(buf.alpha + 1) * buf.batch_size
        + buf.redundancy * len(buf._groups),
        ready_samples=buf.ready_samples(),
        started=c["started"],
        completed=c["completed"],
        consumed=c["consumed"],
        batches=c["batches"],
        retries=c["retries"],
        failed=dict(buf._failed),
        restarted_stale=c["restarted_stale"],
        replaced_stale=c["replaced_stale"],
        dropped=dict(buf._dropped),
        cancelled=c["cancelled"],
        groups_retired=c["groups_retired"],
        groups_dropped=dict(buf._groups_dropped),
        wasted_tokens=dict(buf._wasted),
        late_calls=c["late_calls"],
        finished_members=c["finished_members"],
        finished_mean_len=c["finished_len"] / max(c["finished_members"], 1),
        kept_members=c["kept_members"],
        kept_mean_len=c["kept_len"] / max(c["kept_members"], 1),
        cancelled_mean_len=c["cancelled_len"] / max(c["cancelled"], 1),
        last_batch_max_staleness=max(st, default=0),
        last_batch_mean_staleness=sum(st) / len(st) if st else 0.0,
        generated_tokens=buf._generated,
        trained_tokens=buf._trained_tokens,
        in_flight_tokens=in_flight_tokens,
        domains={k: msgspec.structs.replace(v, wasted_tokens=dict(v.wasted_tokens))
                 for k, v in sorted(buf._domains.items())},
    )
