"""Weight buckets on the wire: tensors as raw ZeroMQ frames, bucketing, CRC32 checksums. No pickle.

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
    buf = raw.numpy().data.cast("B")
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


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` bytes (a tensor larger
    than that gets a bucket of its own). Only sizes are read: nothing is copied, so a GPU model
    is moved to host memory one bucket at a time when the buckets are encoded.

    The one bucketing rule of the ZeroMQ weight path (the collective path packs its buffers
    inside vLLM's NCCL engine).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def encode_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[TensorMeta], list[memoryview], str]:
    """One bucket's wire form: ``(metas, frames, crc32_hex of the frames)``, frames in
    ``metas`` order (tensors copied to contiguous host memory where needed)."""
    metas: list[TensorMeta] = []
    frames: list[memoryview] = []
    for name, tensor in bucket:
        meta, frame = tensor_to_frame(name, tensor)
        metas.append(meta)
        frames.append(frame)
    return metas, frames, crc32_hex(frames)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[TensorMeta], list[memoryview]]]:
    """``plan_buckets`` then encode each bucket lazily: yields ``(metas, frames)`` per bucket.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    for bucket in plan_buckets(named_tensors, bucket_bytes):
        metas, frames, _ = encode_bucket(bucket)
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
