"""The sample buffer's checkpoint layout, pinned: a checkpoint written by an earlier rollart
must restore, so the layout may change only with a new format number. Format 2 changed only
the held samples' own fields (behaviour logprobs and versions per generated token), so its
layout is format 1's with the new number.

``GOLDEN`` is what the buffer wrote for :func:`history` before it was split into modules
(``rollart.controller.buffer.snapshot``). The held sample's own fields are the ``Sample``'s
format (``rollart.controller.buffer.sample``, tested there), so the layout checks compare a sample by
its id and reward only.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from rollart.controller.buffer.core import Sample, SampleBuffer
from rollart.transport.errors import ConfigError

GOLDEN: dict[str, Any] = {
    "format": 1,
    "config": {
        "alpha": 1,
        "batch_size": 2,
        "group_size": 2,
        "redundancy": 1,
        "selection": "first",
        "check": "per_turn",
        "on_stale": "restart",
        "max_attempts": 3,
        "fresh_start": False,
        "abort_stale": False,
        "staleness_control": "bound"
    },
    "version": 3,
    "next_seq": 4,
    "groups": [
        {
            "key": "g0",
            "domain": "math",
            "alpha": 2,
            "selected": False,
            "closing": False,
            "slots": [
                {
                    "attempt": 1,
                    "state": "held",
                    "kept": True,
                    "min_version": 3,
                    "sample": {
                        "sample_id": "g0/0",
                        "group_key": "g0",
                        "token_ids": "BwAAAAgAAAAJAAAA",
                        "loss_mask": "AAEB",
                        "behaviour_logprobs": "AAAAAAAAAL8AAIC+",
                        "versions": "/////wMAAAADAAAA",
                        "reward": 1.0,
                        "domain": "default",
                        "num_turns": 1,
                        "finish_reason": "stop",
                        "metadata": {},
                        "turn_workers": []
                    }
                },
                {
                    "attempt": 1,
                    "state": "running",
                    "kept": False,
                    "min_version": None,
                    "sample": None
                },
                {
                    "attempt": 2,
                    "state": "running",
                    "kept": False,
                    "min_version": None,
                    "sample": None
                }
            ]
        }
    ]
}


def history() -> SampleBuffer:
    """One group of 2 + 1 redundant members at version 3 (its own alpha 2): one completed and
    kept, one running, one failed once and retried."""
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, redundancy=1, initial_version=3)
    a, _, c = buf.try_start_group("g0", "math", alpha=2)
    assert buf.begin_turn(a, 3) == "continue"
    buf.record_tokens(a, [3, 3])
    buf.complete(a, Sample(sample_id=a, group_key="g0", token_ids=[7, 8, 9], loss_mask=[0, 1, 1],
                           behaviour_logprobs=[0.0, -0.5, -0.25], versions=[-1, 3, 3],
                           reward=1.0))
    assert buf.fail(c, "env_error") == "g0/3"
    return buf


def layout(snap: dict[str, Any]) -> dict[str, Any]:
    """``snap`` with each held sample reduced to its id and reward."""
    out = copy.deepcopy(snap)
    for g in out["groups"]:
        for slot in g["slots"]:
            if slot is not None and slot["sample"] is not None:
                slot["sample"] = {k: slot["sample"][k] for k in ("sample_id", "reward")}
    return out


def format_2(snap: dict[str, Any], running_tokens: int) -> dict[str, Any]:
    """Format 1's ``layout`` as format 2 writes it: the number, and each running slot's
    generated tokens (``running_tokens`` each)."""
    out = {**layout(snap), "format": 2}
    for g in out["groups"]:
        for slot in g["slots"]:
            if slot is not None and slot["state"] == "running":
                slot["num_tokens"] = running_tokens
    return out


def test_a_snapshot_has_the_format_2_layout() -> None:
    snap = history().snapshot()
    assert snap["format"] == 2
    assert layout(snap) == format_2(GOLDEN, 0)  # the running slots generated nothing yet
    (held,) = [s["sample"] for g in snap["groups"] for s in g["slots"]
               if s is not None and s["sample"] is not None]
    # per generated token: the held sample generated two
    assert msgspec.convert(held, Sample).behaviour_logprobs.tolist() == [-0.5, -0.25]


def test_an_unknown_format_is_refused_by_its_number() -> None:
    with pytest.raises(ConfigError, match=r"unknown snapshot format 3 .*formats \[1, 2\]"):
        SampleBuffer.restore({**copy.deepcopy(GOLDEN), "format": 3})


def test_a_format_1_checkpoint_restores_its_held_sample_and_restarts_its_running_slots() -> None:
    buf = SampleBuffer.restore(copy.deepcopy(GOLDEN))
    assert buf.version == 3
    assert buf.held_sample_ids() == {"g0/0"}
    assert buf.drain_restarts() == ["g0/4", "g0/5"]  # fresh ids from next_seq, one per slot
    assert (buf.stats().held, buf.stats().running) == (1, 2)
    want = format_2(GOLDEN, 0)  # what this rollart writes
    want["next_seq"] = 6
    # The slot that had failed keeps its attempt count; the group its domain and alpha.
    assert layout(buf.snapshot()) == want
