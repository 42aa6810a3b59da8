"""Delta codec for weight versions: ship only the elements that changed since a base version.

Both ends hold the base version's tensors in the *wire dtype* (``bfloat16`` / ``float16`` /
``float32``), bit for bit. A bucket of the new version is encoded against the same tensors of
the base, concatenated in bucket order:

- ``xor``: ``zstd(new_bytes XOR base_bytes)``. Unchanged elements are zero bytes, which zstd
  compresses to almost nothing; changed bf16 elements mostly differ in their low mantissa bits.
- ``sparse``: ``zstd(u32 count | u32 index gap * count | value * count)`` over elements of the
  bucket's element size: only the positions (as gaps from the previous changed element, which
  compress better than absolute indices) and new values of changed elements.

The decoder rebuilds the new bucket's bytes; the caller verifies them against the bucket's CRC32
(``rollart.weights.buckets.decode_bucket``) before anything is staged, so a wrong base or a
corrupted payload is refused, never applied. Decoding is a pure function of (base bytes,
payload): applying the same delta twice yields the same bytes (nothing is patched in place).

zstd (python-zstandard, the reference libzstd binding) at level 3: compression at several
hundred MB/s per core, decompression above 1 GB/s (python-zstandard's README, "Performance").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import zstandard

if TYPE_CHECKING:
    import torch

Encoding = Literal["xor", "sparse"]
#: config / wire spelling of the wire dtypes -> torch dtype names
WIRE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: zstd level: 3 is zstd's default speed / ratio trade-off (libzstd ``ZSTD_CLEVEL_DEFAULT``)
ZSTD_LEVEL = 3


class DeltaError(ValueError):
    """A delta payload cannot be decoded against the given base (wrong size, bad frame)."""


def to_wire(named_tensors: Sequence[tuple[str, torch.Tensor]], wire_dtype: str,
            ) -> list[tuple[str, torch.Tensor]]:
    """Cast floating-point tensors to the wire dtype (``"bf16"``, ``"fp16"``, ``"fp32"`` or
    ``"model"``: unchanged), contiguous on the CPU. Round-to-nearest-even (torch's cast).

    Raises:
        ValueError: unknown ``wire_dtype``; an ``fp16`` cast overflowing a finite value to inf
            (fp16's largest finite value is 65504), naming the tensor.
    """
    import torch

    if wire_dtype == "model":
        return [(n, t.detach().cpu().contiguous()) for n, t in named_tensors]
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}: expected one of "
                         f"{['model', *WIRE_DTYPES]}")
    dtype = getattr(torch, WIRE_DTYPES[wire_dtype])
    out = []
    for name, t in named_tensors:
        t = t.detach().cpu()
        if t.is_floating_point() and t.dtype != dtype:
            w = t.to(dtype).contiguous()
            if dtype == torch.float16 and not bool(torch.isfinite(w).eq(torch.isfinite(t)).all()):
                raise ValueError(f"tensor {name!r} overflows float16 (|x| > 65504): use "
                                 "weight_wire_dtype = \"bf16\" or \"fp32\"")
            out.append((name, w))
        else:
            out.append((name, t.contiguous()))
    return out


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a ``uint8`` numpy view (no copy for a contiguous CPU tensor)."""
    import torch

    t = t.detach().cpu().contiguous()
    return (t.reshape(-1) if t.dim() else t.reshape(1)).view(torch.uint8).numpy()


def concat(buffers: Sequence[np.ndarray | bytes | memoryview]) -> np.ndarray:
    """Concatenate byte buffers into one ``uint8`` array."""
    if not buffers:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in buffers])


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    n8 = a.size - a.size % 8  # 8-byte words: a quarter of the numpy ops of bytes
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])
    return out


#: bytes per element of the dtypes a bucket can carry (``TensorMeta.dtype`` names).
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
               "int16": 2, "uint8": 1, "int8": 1, "bool": 1}


def bucket_itemsize(dtypes: Sequence[str]) -> int:
    """The element size ``sparse`` compares in, for a bucket of tensors of ``dtypes``: their
    common size, or 1 (bytes) when they differ or one is not in ``DTYPE_SIZES``. Trainer and
    worker both call this, so they always agree."""
    sizes = {DTYPE_SIZES.get(d, 0) for d in dtypes}
    return sizes.pop() if len(sizes) == 1 and 0 not in sizes else 1


def _inflate(payload: bytes | memoryview, limit: int) -> bytes:
    """One zstd frame's bytes, refusing a frame that declares more than ``limit`` bytes (checked
    before any allocation: python-zstandard ignores ``max_output_size`` when the frame states
    its size), one that states no size, and trailing data after the frame."""
    size = zstandard.frame_content_size(payload)
    if size < 0:
        raise DeltaError("delta payload does not state its decoded size")
    if size > limit:
        raise DeltaError(f"delta payload declares {size} bytes, more than the {limit} a delta "
                         "of this base can have")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    raw = dobj.decompress(payload)
    if dobj.unused_data:
        raise DeltaError(f"{len(dobj.unused_data)} bytes of trailing data after the delta's "
                         "zstd frame")
    return raw


def _word(itemsize: int) -> np.dtype:
    return {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"),
            8: np.dtype("<u8")}[itemsize]


def encode(base: np.ndarray, new: np.ndarray, encoding: Encoding, itemsize: int) -> bytes:
    """Encode ``new`` against ``base`` (equal-length ``uint8`` arrays); returns the payload.

    ``itemsize``: element size in bytes (1, 2, 4 or 8; ``sparse`` compares whole elements).

    Raises:
        ValueError: lengths differ, length not a multiple of ``itemsize``, unknown encoding.
    """
    if base.size != new.size:
        raise ValueError(f"base has {base.size} bytes, new {new.size}")
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if encoding == "xor":
        return cctx.compress(_xor(base, new).data)
    if encoding != "sparse":
        raise ValueError(f"unknown delta encoding {encoding!r}")
    if new.size % itemsize:
        raise ValueError(f"{new.size} bytes is not a multiple of the element size {itemsize}")
    w = _word(itemsize)
    old_e, new_e = base.view(w), new.view(w)
    idx = np.flatnonzero(old_e != new_e).astype("<u4")
    if new_e.size >= 1 << 32:
        raise ValueError(f"sparse delta of {new_e.size} elements: indices exceed 32 bits "
                         "(use smaller weight buckets)")
    gaps = np.diff(idx, prepend=np.uint32(0)).astype("<u4")
    head = np.array([idx.size], dtype="<u4")
    return cctx.compress(head.tobytes() + gaps.tobytes() + new_e[idx].tobytes())


def decode(base: np.ndarray, payload: bytes | memoryview, encoding: Encoding,
           itemsize: int) -> np.ndarray:
    """Rebuild the new bytes from ``base`` (``uint8``) and an ``encode`` payload.

    Returns a new ``uint8`` array of ``base.size`` bytes (``base`` is not modified).

    Raises:
        DeltaError: the payload is not one zstd frame stating its size, declares or decodes
            to more than a delta of ``base`` can hold (checked before decompressing), or
            names an element outside the base.
    """
    try:
        if encoding == "xor":
            raw = _inflate(payload, base.size)
            if len(raw) != base.size:
                raise DeltaError(f"xor delta decodes to {len(raw)} bytes, base has {base.size}")
            return _xor(base, np.frombuffer(raw, dtype=np.uint8))
        if encoding != "sparse":
            raise DeltaError(f"unknown delta encoding {encoding!r}")
        n_el = base.size // itemsize
        # count + every element's index and value: the largest payload a valid delta has
        raw = _inflate(payload, 4 + n_el * (4 + itemsize))
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta payload is not a valid zstd frame: {exc}") from None
    if len(raw) < 4:
        raise DeltaError("sparse delta shorter than its 4-byte count")
    count = int(np.frombuffer(raw, dtype="<u4", count=1)[0])
    if len(raw) != 4 + count * (4 + itemsize):
        raise DeltaError(f"sparse delta of {count} elements has {len(raw)} bytes, expected "
                         f"{4 + count * (4 + itemsize)}")
    w = _word(itemsize)
    idx = np.cumsum(np.frombuffer(raw, dtype="<u4", count=count, offset=4), dtype=np.uint64)
    values = np.frombuffer(raw, dtype=w, count=count, offset=4 + 4 * count)
    if count and int(idx.max()) >= n_el:
        raise DeltaError(f"sparse delta names element {int(idx.max())} of {n_el}")
    out = base.copy()
    out.view(w)[idx] = values
    return out


def changed_fraction(base: np.ndarray, new: np.ndarray, itemsize: int) -> float:
    """Fraction of elements whose bit pattern differs (0.0 for empty buffers)."""
    w = _word(itemsize)
    n = base.size // itemsize
    return float(np.count_nonzero(base.view(w) != new.view(w))) / n if n else 0.0
