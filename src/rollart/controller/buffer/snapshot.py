"""The sample buffer's checkpoint format: ``SampleBuffer.snapshot()`` and ``restore()``.

A snapshot is a JSON-able dict (``format`` 2): the buffer's config, its version, the next
trajectory sequence number, and every open group's slots with their held samples. Checkpoints
already written must keep restoring: the layout changes only with a new ``SNAPSHOT_FORMAT``
that ``restore`` tells apart. Format 2 holds each sample's behaviour logprobs and
versions for its generated tokens only, and each running slot's generated tokens
(``num_tokens``); format 1 held samples per token, and ``Sample`` reads both, so both restore.
Token accounting across a resume: a held sample's tokens are carried over as generated and
in flight; a running slot's (format 2) as generated and wasted, reason ``resume``. A rollart
that knows only format 1 refuses a format-2 checkpoint by its number instead of failing on a
sample's lengths.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollart.controller.buffer.groups import GroupTable
from rollart.controller.buffer.records import TrajState
from rollart.controller.buffer.sample import BufferStats, DomainCounts, Sample
from rollart.controller.buffer.stats import BufferCounters, bump
from rollart.transport.errors import ConfigError

SNAPSHOT_FORMAT = 2
#: formats ``restore`` reads (see the module docstring)
READABLE_FORMATS = (1, 2)
#: waste reason of the tokens of trajectories running at a checkpoint, restarted on resume
RESUME = "resume"


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)}


def _counts_minus(a: DomainCounts, b: DomainCounts) -> dict[str, Any]:
    return {f: (_minus(x, getattr(b, f)) if isinstance(x, dict) else x - getattr(b, f))
            for f in a.__struct_fields__ for x in [getattr(a, f)]}


def counts_since(now: BufferStats, last: BufferStats | None) -> dict[str, Any]:
    """What the token and per-domain counters gained since ``last`` (the buffer's counters at
    the last step's end, as its metrics reported them; ``None``: none yet), JSON-able: a
    checkpoint taken between steps records it, so the first step after a resume reports it
    (nothing generated, finished or wasted in between is lost from the run's totals)."""
    zero = DomainCounts()
    last_domains = last.domains if last is not None else {}
    return {
        "generated_tokens": now.generated_tokens - (last.generated_tokens if last else 0),
        "trained_tokens": now.trained_tokens - (last.trained_tokens if last else 0),
        "wasted_tokens": _minus(now.wasted_tokens, last.wasted_tokens if last else {}),
        "domains": {name: _counts_minus(d, last_domains.get(name, zero))
                    for name, d in now.domains.items()},
    }


def carried_over(stats: BufferStats, since: dict[str, Any] | None = None) -> BufferStats:
    """The baseline the first step after a resume takes its metrics' deltas from: a
    just-restored buffer's ``stats`` less its ``resume`` waste and less ``since`` (the
    checkpoint's :func:`counts_since`), so that step reports the tokens the restart threw away
    and what happened between the last step and the checkpoint. The run's totals
    (``rollart.launcher.progress``, sums of the steps' deltas) then add up across resumes."""
    since = since or {}
    gone = since.get("wasted_tokens", {})

    def wasted(w: dict[str, int], extra: dict[str, int]) -> dict[str, int]:
        out = {k: v - extra.get(k, 0) for k, v in w.items() if k != RESUME}
        for k, v in extra.items():
            if k not in w:
                out[k] = -v
        return out

    domains = {}
    moved_domains = since.get("domains", {})
    # A domain active between the last step and the checkpoint but without a group in the
    # restored buffer still carries its counts over (as negatives of a zero baseline).
    for name in sorted(stats.domains.keys() | moved_domains.keys()):
        d = stats.domains.get(name, DomainCounts())
        moved = moved_domains.get(name, {})
        fields: dict[str, Any] = {
            f: (wasted(getattr(d, f), moved.get(f, {})) if f == "wasted_tokens"
                else getattr(d, f) - moved.get(f, 0))
            for f in d.__struct_fields__}
        domains[name] = DomainCounts(**fields)
    return msgspec.structs.replace(
        stats, generated_tokens=stats.generated_tokens - since.get("generated_tokens", 0),
        trained_tokens=stats.trained_tokens - since.get("trained_tokens", 0),
        wasted_tokens=wasted(stats.wasted_tokens, gone), domains=domains)


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


def snapshot(config: dict[str, Any], version: int, table: GroupTable) -> dict[str, Any]:
    """``SampleBuffer.snapshot()`` (its docstring): the buffer's ``config`` (``CONFIG_KEYS``),
    ``version`` and every open group of ``table`` (admission order) with its slots (``None``:
    closed, or no longer wanted)."""
    groups = []
    for g in sorted(table.groups.values(), key=lambda g: g.seq):
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
                    if t is None or not g.wants(t)
                    else {
                        "attempt": t.attempt,
                        "state": "held" if t.state is TrajState.HELD else "running",
                        # a running slot's generated tokens so far: restarted on resume, so
                        # they are counted as wasted ("resume") then (format 2 on)
                        **({} if t.state is TrajState.HELD else {"num_tokens": t.num_tokens}),
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
        "config": config,
        "version": version,
        "next_seq": table.next_seq,
        "groups": groups,
    }


def check_format(snap: dict[str, Any]) -> None:
    """Raises ``ConfigError`` unless ``snap`` is of a format this rollart reads."""
    if snap.get("format") not in READABLE_FORMATS:
        raise ConfigError(
            f"SampleBuffer.restore: unknown snapshot format {snap.get('format')!r} (this "
            f"rollart reads formats {list(READABLE_FORMATS)})"
        )


def restore_groups(snap: dict[str, Any], table: GroupTable, counters: BufferCounters, *,
                   version: int, groups_per_batch: int, alpha: int) -> None:
    """Put the groups of ``snap`` back into a new buffer's ``table``: held samples as they
    were, each running slot as a fresh trajectory (listed in ``table.restarts``); ``version``
    is the restored buffer's, ``alpha`` its default bound. The caller re-checks staleness."""
    table.next_seq = snap["next_seq"]
    # Every version's batch was admitted before it was trained; the open groups come back.
    table.admitted = version * groups_per_batch + len(snap["groups"])
    for gs in snap["groups"]:
        g = table.add_group(gs["key"], gs.get("domain", "default"), gs.get("alpha", alpha),
                            len(gs["slots"]), selected=gs["selected"], closing=gs["closing"])
        d = counters.domain(g.domain)
        for i, ss in enumerate(gs["slots"]):
            if ss is None:
                continue
            if ss["state"] == "running":
                table.restarts.append(table.new_traj(g, i, ss["attempt"]).tid)
                # Generated before the checkpoint and lost with the restart: carried over as
                # generated and wasted ("resume"), so the run's token totals add up.
                lost = ss.get("num_tokens", 0)
                counters.generated_tokens += lost
                d.generated_tokens += lost
                bump(counters.wasted_tokens, RESUME, lost)
                bump(d.wasted_tokens, RESUME, lost)
                continue
            t = table.new_traj(g, i, ss["attempt"], tid=ss["sample"]["sample_id"])
            t.sample = msgspec.convert(ss["sample"], Sample)
            t.state, t.min_version = TrajState.HELD, ss["min_version"]
            # Carried over as generated (before this process) and in flight, so a batch that
            # trains it counts its tokens as trained.
            t.num_tokens, t.turns = t.sample.num_generated, t.sample.num_turns
            counters.generated(g.domain, t.num_tokens)
            (g.kept if ss["kept"] else g.finished).append(t)
        if len(g.kept) == g.size:
            table.ready[g.key] = g
