"""Per-token data as compact little-endian byte strings: the dtypes the wire messages use.

Every per-token field of a wire message (``Generate.new_token_ids``, ``GenerateResult.token_ids``
/ ``logprobs`` / ``versions``, ``TrainSample.token_ids`` / ``loss_mask`` / ``behaviour_logprobs``)
is ``bytes`` holding one fixed-size item per token, little-endian:

- token ids and policy versions: ``int32`` (``<i4``, 4 bytes per token);
- logprobs: ``float32`` (``<f4``), natural log (the trainer computes in float32 as well);
- loss masks: ``uint8`` (``u1``), values 0 / 1.

msgspec encodes ``bytes`` (and any contiguous ``memoryview``) as one msgpack ``bin``: a single
memcpy instead of one msgpack item per token, and decoding makes no Python object per token.
The helpers below pack Python sequences and view received bytes as numpy arrays (zero-copy,
read-only) or ``array.array`` (one memcpy). ``array.array`` uses the host's byte order, so the
module refuses to load on a big-endian host rather than silently mis-read the wire.
"""

from __future__ import annotations

import array
import contextlib
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("rollart's token wire format assumes a little-endian host")
if array.array("i").itemsize != 4 or array.array("f").itemsize != 4:  # pragma: no cover
    raise ImportError("rollart needs 4-byte C int and float for array.array('i') / ('f')")

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")

#: bytes per token of each per-token dtype
ITEMSIZE = {"i32": 4, "f32": 4, "u8": 1}


def _nbytes(buf: Any) -> int:
    return memoryview(buf).nbytes


def count(buf: Any, itemsize: int, what: str = "buffer") -> int:
    """Number of items of ``itemsize`` bytes in ``buf`` (bytes, memoryview, array, ndarray).

    Raises:
        ValueError: the byte length is not a multiple of ``itemsize`` (naming ``what``).
    """
    n = _nbytes(buf)
    if n % itemsize:
        raise ValueError(f"{what}: {n} bytes is not a whole number of {itemsize}-byte items")
    return n // itemsize


def pack_i32(values: Sequence[int] | Any) -> bytes:
    """``values`` (ints, an ``array('i')`` or an integer ndarray) as little-endian int32 bytes.

    Raises OverflowError for values outside int32."""
    if isinstance(values, array.array) and values.typecode == "i":
        return values.tobytes()
    if isinstance(values, np.ndarray):
        if values.dtype != I32 and values.size and (
                values.min() < -(1 << 31) or values.max() >= 1 << 31):
            # astype would wrap silently (a token id 2**31 would become -2**31)
            raise OverflowError(f"pack_i32: values in [{values.min()}, {values.max()}] are "
                                "outside int32")
        return values.astype(I32, copy=False).tobytes()
    if type(values) is list:
        # A tokenizer's output: struct converts a list's ints 2-4x faster than array does
        # (measured at 32k tokens), which matters for 32k-token prompts.
        with contextlib.suppress(struct.error):  # array below raises the proper error
            return struct.pack(f"<{len(values)}i", *values)
    return array.array("i", values).tobytes()


def pack_f32(values: Sequence[float] | Any) -> bytes:
    """``values`` as little-endian float32 bytes."""
    if isinstance(values, array.array) and values.typecode == "f":
        return values.tobytes()
    if isinstance(values, np.ndarray):
        return values.astype(F32, copy=False).tobytes()
    return array.array("f", values).tobytes()


def pack_u8(values: Sequence[int] | Any) -> bytes:
    """``values`` (ints in [0, 255], e.g. a 0/1 loss mask) as uint8 bytes."""
    if isinstance(values, np.ndarray):
        return values.astype(U8, copy=False).tobytes()
    return bytes(values)


def view_i32(buf: Any) -> np.ndarray:
    """Zero-copy read-only int32 view of ``buf``. Raises ValueError on a ragged length."""
    count(buf, 4, "int32 data")
    return np.frombuffer(buf, dtype=I32)


def view_f32(buf: Any) -> np.ndarray:
    """Zero-copy read-only float32 view of ``buf``. Raises ValueError on a ragged length."""
    count(buf, 4, "float32 data")
    return np.frombuffer(buf, dtype=F32)


def view_u8(buf: Any) -> np.ndarray:
    """Zero-copy read-only uint8 view of ``buf``."""
    return np.frombuffer(buf, dtype=U8)


def to_array(buf: Any, typecode: str) -> array.array:
    """A new ``array.array(typecode)`` holding the bytes of ``buf`` (one memcpy).

    ``typecode``: ``"i"`` (int32), ``"f"`` (float32) or ``"b"`` (int8, for 0/1 masks).
    Raises ValueError on a ragged length."""
    out = array.array(typecode)
    if _nbytes(buf) % out.itemsize:  # the message is only formatted when it is needed
        count(buf, out.itemsize, f"array('{typecode}') data")
    out.frombytes(buf)
    return out


#: Per-token data up to this many bytes (64 tokens of 4 bytes) are checked item by item in
#: Python: below it numpy's fixed cost per call (~1-3 us for ``frombuffer`` / ``min``) is more
#: than the whole loop (a turn's reply usually holds a few to a few hundred tokens).
SMALL_BYTES = 256
_NEG_INF = float("-inf")


def small_turn_problem(token_ids: bytes, logprobs: bytes, versions: bytes) -> str | None:
    """What is wrong with one generated turn's per-token data (equal lengths, a multiple of 4
    bytes, at most ``SMALL_BYTES`` each: the caller checked), worded as ``GenerateResult``'s
    numpy check words it: the first negative token id, else the first negative version, else
    the first logprob that is NaN, infinite or > 0; ``None`` if nothing is."""
    for what, buf in (("token id", token_ids), ("version", versions)):
        ints = memoryview(buf).cast("i")
        if min(ints) < 0:
            return f"negative {what} {next(x for x in ints if x < 0)}"
    for x in memoryview(logprobs).cast("f"):
        if not _NEG_INF < x <= 0.0:  # NaN fails both comparisons
            return f"logprob {x} of a generated token must be finite and <= 0"
    return None
