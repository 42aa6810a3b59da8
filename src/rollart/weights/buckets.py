"""Tensors as raw ZeroMQ frames: bucketing, (de)serialisation and checksums. No pickle.

Torch is imported lazily so that processes which never touch tensors (the controller) do not
pay for it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from rollart.transport.errors import RemoteError
from rollart.transport.messages import TensorMeta

if TYPE_CHECKING:
    import torch


def crc32_hex(buffers: Iterable[bytes | memoryview]) -> str:
    """CRC32 over the concatenation of ``buffers``, as 8 lowercase hex digits.

    CRC32 rather than a cryptographic hash: it detects transport corruption and runs at memory
    speed (``zlib`` releases the GIL on large buffers), which matters for tens of GB of weights.
    """
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def tensor_to_frame(name: str, tensor: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    """Return the metadata and a zero-copy byte view of a (CPU) tensor.

    Non-contiguous or non-CPU tensors are copied to contiguous CPU memory first.
    """
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    raw = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    buf = memoryview(raw.numpy()).cast("B")
    dtype = str(t.dtype).removeprefix("torch.")
    return TensorMeta(name=name, dtype=dtype, shape=list(t.shape), nbytes=buf.nbytes), buf


def frame_to_tensor(meta: TensorMeta, buf: bytes | memoryview) -> torch.Tensor:
    """Rebuild a tensor from its metadata and frame bytes (copied, so the frame can be freed).

    Raises:
        RemoteError(code="bad_request"): unknown dtype or byte length not matching the shape.
    """
    import torch

    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise RemoteError("bad_request", f"tensor {meta.name!r}: unknown dtype {meta.dtype!r}")
    view = memoryview(buf).cast("B")
    numel = 1
    for d in meta.shape:
        numel *= d
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if view.nbytes != meta.nbytes or view.nbytes != expected:
        raise RemoteError(
            "bad_request",
            f"tensor {meta.name!r}: {view.nbytes} bytes, expected {expected} for "
            f"shape {meta.shape} {meta.dtype} (meta says {meta.nbytes})",
        )
    if numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[TensorMeta], list[memoryview]]]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Yields ``(metas, frames)`` per bucket, frames in ``metas`` order.
    """
    metas: list[TensorMeta] = []
    frames: list[memoryview] = []
    size = 0
    for name, tensor in named_tensors:
        meta, buf = tensor_to_frame(name, tensor)
        if metas and size + meta.nbytes > bucket_bytes:
            yield metas, frames
            metas, frames, size = [], [], 0
        metas.append(meta)
        frames.append(buf)
        size += meta.nbytes
    if metas:
        yield metas, frames


def decode_bucket(
    metas: Sequence[TensorMeta], frames: Sequence[bytes | memoryview], checksum: str
) -> list[tuple[str, torch.Tensor]]:
    """Verify a bucket's checksum and rebuild its tensors.

    Raises:
        RemoteError(code="checksum_mismatch"): bytes do not match ``checksum``.
        RemoteError(code="bad_request"): frame count or a tensor's size does not match ``metas``.
    """
    if len(frames) != len(metas):
        raise RemoteError(
            "bad_request", f"bucket lists {len(metas)} tensors but carries {len(frames)} frames"
        )
    actual = crc32_hex(frames)
    if actual != checksum:
        raise RemoteError("checksum_mismatch", f"bucket crc32 {actual} != declared {checksum}")
    return [(meta.name, frame_to_tensor(meta, buf)) for meta, buf in zip(metas, frames, strict=True)]
