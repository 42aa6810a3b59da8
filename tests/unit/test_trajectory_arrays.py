"""A trajectory's per-token arrays start from the prompt with headroom, so the turns' appends
do not reallocate (and copy) the prompt's array; reply fields are read as int32 in place."""

from __future__ import annotations

import array

import pytest

from rollart.controller.buffer.sample import spread_generated
from rollart.controller.rollout.trajectory import _as_i32, _filled


def test_filled_holds_n_copies_and_room_for_the_turns() -> None:
    n = 16_384
    for item in (array.array("b", [0]), array.array("f", [0.0]), array.array("i", [-1])):
        out = _filled(item, n)
        assert len(out) == n and out.typecode == item.typecode
        assert set(out) == {item[0]}
        address = out.buffer_info()[0]
        for _ in range(n // 16 // 8):  # the turns' appends, 8 items at a time
            out.frombytes(bytes(8 * out.itemsize))
        assert out.buffer_info()[0] == address  # appended in place: no copy of the prompt
    assert len(_filled(array.array("i", [3]), 0)) == 0


def test_as_i32_reads_bytes_and_typed_buffers_in_place() -> None:
    raw = array.array("i", [5, -1, 7]).tobytes()
    assert _as_i32(raw).tolist() == [5, -1, 7]
    assert _as_i32(memoryview(array.array("i", [1, 2]))).tolist() == [1, 2]
    assert _as_i32(b"").tolist() == []


def test_spread_generated_puts_the_generated_tokens_values_in_place() -> None:
    mask = array.array("b", [0, 0, 1, 1, 0, 0, 1])
    lps = array.array("f", [-0.5, -0.25, -1.0]).tobytes()
    versions = bytearray(array.array("i", [3, 3, 4]).tobytes())
    full_lps, full_versions = spread_generated(mask, lps, versions)
    assert full_lps.typecode == "f" and full_versions.typecode == "i"
    assert full_lps.tolist() == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert full_versions.tolist() == [-1, -1, 3, 3, -1, -1, 4]
    with pytest.raises(ValueError, match="3 generated tokens in the loss mask but 2 logprobs"):
        spread_generated(mask, lps[:8], versions)
    # no generated token (the trajectory refuses such a sample, but the helper is total)
    assert spread_generated(array.array("b", [0, 0]), b"", b"") == (
        array.array("f", [0.0, 0.0]), array.array("i", [-1, -1]))
    assert spread_generated(array.array("b"), b"", b"") == (array.array("f"), array.array("i"))
    with pytest.raises(ValueError, match="0 generated tokens"):
        spread_generated(array.array("b", [0]), b"\0\0\0\0", b"\0\0\0\0")
