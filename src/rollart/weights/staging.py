"""Staging of weight versions that arrive in buckets, before the engine applies them.

Each ``WeightBucket`` is checked (CRC32 via ``decode_bucket``; tensor names and shapes against the
served checkpoint's layout) and written as one safetensors file under a staging directory
(``/dev/shm`` by default, so the engine-core process reads it at memory speed without anything
being pickled). ``ApplyWeights`` then takes a complete version: every bucket index present and,
when the checkpoint layout is known, every checkpoint tensor present exactly once.

Torch and safetensors are imported lazily: the module is importable without them for tooling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.weights.buckets import decode_bucket

log = logging.getLogger(__name__)

#: name of the output projection that shares storage with the input embedding when tied
TIED_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class CheckpointLayout:
    """Tensor names and shapes of a Hugging Face safetensors checkpoint.

    ``shapes``: checkpoint tensor name -> shape. ``tied``: ``config.json`` says
    ``tie_word_embeddings`` (then ``lm_head.weight`` is accepted and dropped: it aliases the
    embedding, which must be sent under its own name).
    """

    shapes: dict[str, tuple[int, ...]]
    tied: bool

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> CheckpointLayout | None:
        """Read the layout from the safetensors headers in ``model_dir`` (no tensor data read).

        Returns ``None`` for a checkpoint without safetensors files (then names and shapes are
        not checked before the engine sees them).
        """
        from safetensors import safe_open

        root = Path(model_dir)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        tied = False
        config = root / "config.json"
        if config.is_file():
            tied = bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
        return cls(shapes=shapes, tied=tied)

    def expected_names(self) -> set[str]:
        """Names a complete version must carry (a tied ``lm_head.weight`` is optional)."""
        names = set(self.shapes)
        if self.tied:
            names.discard(TIED_LM_HEAD)
        return names

    def check(self, meta: m.TensorMeta) -> bool:
        """Check one incoming tensor; returns ``False`` when it is a tied alias to drop.

        Raises:
            RemoteError(code="bad_request"): unknown name or a shape differing from the checkpoint.
        """
        if self.tied and meta.name == TIED_LM_HEAD:
            return False
        shape = self.shapes.get(meta.name)
        if shape is None:
            raise RemoteError(
                "bad_request", f"tensor {meta.name!r} is not in the served checkpoint"
            )
        if tuple(meta.shape) != shape:
            raise RemoteError(
                "bad_request",
                f"tensor {meta.name!r} has shape {list(meta.shape)}, checkpoint has {list(shape)}",
            )
        return True


@dataclass
class StagedVersion:
    """Buckets of one version received so far: index -> (file, tensor names in it)."""

    version: int
    num_buckets: int
    directory: Path
    buckets: dict[int, tuple[Path, list[str]]] = field(default_factory=dict)

    def paths(self) -> list[str]:
        return [str(self.buckets[i][0]) for i in sorted(self.buckets)]

    def names(self) -> list[str]:
        return [n for i in sorted(self.buckets) for n in self.buckets[i][1]]


def default_stage_root() -> Path:
    """``/dev/shm`` when writable (RAM-backed, shared with the engine process), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class WeightStager:
    """Holds staged weight versions as safetensors files under a private directory.

    Args:
        root: parent directory; a private ``rollart-weights-*`` directory is created in it.
        layout: the served checkpoint's layout (names and shapes are checked when given).
    """

    def __init__(self, root: str | Path | None, layout: CheckpointLayout | None) -> None:
        base = Path(root) if root is not None else default_stage_root()
        base.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="rollart-weights-", dir=base))
        self.layout = layout
        self._versions: dict[int, StagedVersion] = {}

    async def stage(self, msg: m.WeightBucket, frames: Sequence[memoryview], current: int) -> int:
        """Verify and store one bucket of ``msg.version``; returns the bytes staged.

        Raises:
            RemoteError(code="stale_version"): ``msg.version <= current``.
            RemoteError(code="bad_request"): bucket index out of range, ``num_buckets`` differing
                from earlier buckets of the version, a tensor repeated across buckets, an
                unknown tensor name or shape, or frames not matching ``msg.tensors``.
            RemoteError(code="checksum_mismatch"): CRC32 mismatch; nothing is staged for it.
        """
        if msg.version <= current:
            raise RemoteError(
                "stale_version", f"bucket of version {msg.version}; serving version {current}"
            )
        if msg.bucket_index >= msg.num_buckets:
            raise RemoteError(
                "bad_request", f"bucket_index {msg.bucket_index} >= num_buckets {msg.num_buckets}"
            )
        staged = self._versions.get(msg.version)
        if staged is not None and staged.num_buckets != msg.num_buckets:
            raise RemoteError(
                "bad_request",
                f"version {msg.version}: num_buckets {msg.num_buckets} differs from "
                f"{staged.num_buckets} given by earlier buckets",
            )
        keep = [self.layout.check(t) if self.layout else True for t in msg.tensors]
        names = [t.name for t, k in zip(msg.tensors, keep, strict=True) if k]
        if len(set(names)) != len(names):
            raise RemoteError("bad_request", f"bucket {msg.bucket_index} repeats a tensor name")
        if staged is not None:
            others = {
                n for i, (_, ns) in staged.buckets.items() if i != msg.bucket_index for n in ns
            }
            if dup := others.intersection(names):
                raise RemoteError(
                    "bad_request", f"tensor {sorted(dup)[0]!r} already staged in another bucket"
                )
        version_dir = self.directory / f"v{msg.version}"
        path = version_dir / f"bucket-{msg.bucket_index:05d}.safetensors"
        # CRC and file writing run at memory speed over possibly GBs: keep the event loop free.
        await asyncio.to_thread(_write_bucket, msg, list(frames), keep, path)
        staged = self._versions.setdefault(
            msg.version, StagedVersion(msg.version, msg.num_buckets, version_dir)
        )
        staged.buckets[msg.bucket_index] = (path, names)
        return sum(t.nbytes for t in msg.tensors)

    def take(self, version: int, current: int) -> StagedVersion:
        """Return the complete staged ``version`` (still on disk until ``discard_up_to``).

        Raises:
            RemoteError(code="stale_version"): ``version <= current``.
            RemoteError(code="incomplete_version"): a bucket or a checkpoint tensor is missing
                (or no bucket of the version arrived at all).
        """
        if version <= current:
            raise RemoteError(
                "stale_version", f"version {version} is not newer than serving version {current}"
            )
        staged = self._versions.get(version)
        if staged is None:
            raise RemoteError("incomplete_version", f"no bucket of version {version} was staged")
        missing = sorted(set(range(staged.num_buckets)) - set(staged.buckets))
        if missing:
            raise RemoteError(
                "incomplete_version",
                f"version {version}: {len(missing)} of {staged.num_buckets} buckets missing "
                f"(first: {missing[0]})",
            )
        if self.layout is not None:
            absent = sorted(self.layout.expected_names() - set(staged.names()))
            if absent:
                raise RemoteError(
                    "incomplete_version",
                    f"version {version}: {len(absent)} checkpoint tensors missing "
                    f"(first: {absent[0]!r})",
                )
        return staged

    def discard_up_to(self, version: int) -> None:
        """Delete every staged version ``<= version`` (applied or superseded)."""
        for v in [v for v in self._versions if v <= version]:
            shutil.rmtree(self._versions.pop(v).directory, ignore_errors=True)

    def staged_versions(self) -> list[int]:
        return sorted(self._versions)

    def close(self) -> None:
        """Delete the staging directory and everything in it."""
        self._versions.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def _write_bucket(
    msg: m.WeightBucket, frames: list[memoryview], keep: list[bool], path: Path
) -> None:
    from safetensors.torch import save_file

    tensors = decode_bucket(msg.tensors, frames, msg.checksum)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write under a unique name then rename, so a retried bucket never exposes a torn file.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        save_file({n: t for (n, t), k in zip(tensors, keep, strict=True) if k}, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.debug("staged %s (%d tensors)", path, sum(keep))
