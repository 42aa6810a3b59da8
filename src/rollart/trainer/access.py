"""What a trainer client may make the trainer do with the policy: where weights go, where
checkpoints are written.

- Weights go only to the run's workers. The controller registers them once
  (``RegisterWorkers``), or the trainer is started with them (``--worker``); after that the set
  is closed: ``SetWorkers`` chooses among registered workers (a dead one removed, brought back),
  ``PublishLatest`` pushes only to registered ones, and neither can add an address. Before this,
  ``PublishLatest`` to an address of the caller's choosing delivered the whole model there and
  the trainer kept pushing every later version to it.
- Checkpoints go only under the trainer's checkpoint root (``--checkpoint-dir``): a client names
  a checkpoint relative to it (``step_000042``); an absolute path, a ``..`` part or a symlink
  leading outside the root is refused.

Refusals are ``RemoteError`` with code ``forbidden``, naming the address or path and the rule;
the trainer keeps serving.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from rollart.transport.errors import RemoteError, RollartError


class CheckpointPathError(RollartError, ValueError):
    """A checkpoint name that does not resolve inside the checkpoint root (or no root set)."""


def forbidden(message: str) -> RemoteError:
    """The per-request error a refused trainer request replies with (code ``forbidden``)."""
    return RemoteError("forbidden", message)


class WorkerRegistry:
    """The inference workers this run's trainer may send weights to.

    Args:
        addresses: workers given at trainer start (``--worker``); ``None``: the first
            ``register`` call (the controller's ``RegisterWorkers``) fixes them.
    """

    def __init__(self, addresses: Iterable[str] | None = None) -> None:
        self._registered: list[str] | None = (
            list(dict.fromkeys(addresses)) if addresses is not None else None)

    @property
    def registered(self) -> list[str]:
        """Registered addresses, in registration order ([] before registration)."""
        return list(self._registered or [])

    def register(self, addresses: Iterable[str]) -> None:
        """Register the run's workers; once only. Repeating it with registered addresses is
        accepted (a restarted controller of the same run), any new address is refused.

        Raises:
            RemoteError: (``forbidden``) the set is already closed and ``addresses`` names
                others; (``bad_request``) no address.
        """
        wanted = list(dict.fromkeys(addresses))
        if not wanted:
            raise RemoteError("bad_request", "RegisterWorkers names no worker address")
        if self._registered is None:
            self._registered = wanted
            return
        new = [a for a in wanted if a not in self._registered]
        if new:
            raise forbidden(
                f"RegisterWorkers: workers {new} refused: this run's workers are already "
                f"registered ({self._registered}); the set is closed after the first "
                "registration")

    def check(self, addresses: Iterable[str], what: str) -> None:
        """Refuse unless every address in ``addresses`` is registered.

        Raises:
            RemoteError: (``forbidden``) naming the unregistered addresses and the rule.
        """
        addresses = list(addresses)
        if self._registered is None:
            if addresses:
                raise forbidden(
                    f"{what}: address(es) {addresses} refused: no workers are registered for "
                    "this run yet (the controller registers them once, with RegisterWorkers, "
                    "or the trainer is started with --worker)")
            return
        unknown = [a for a in addresses if a not in self._registered]
        if unknown:
            raise forbidden(
                f"{what}: address(es) {unknown} refused: weights go only to the workers "
                f"registered for this run ({self._registered}); registration cannot be "
                "extended")


def resolve_checkpoint(root: Path | None, name: str) -> Path:
    """The directory checkpoint ``name`` is written to / read from: ``root / name``, resolved.

    ``name`` is relative (``step_000042`` or ``a/b``); symlinks are followed before the check,
    so a link inside the root pointing outside it is refused too.

    Raises:
        CheckpointPathError: no root (the trainer was started without ``--checkpoint-dir``), an
            empty or absolute name, a ``..`` part, or a path resolving outside ``root`` (or to
            the root itself).
    """
    if root is None:
        raise CheckpointPathError(
            f"checkpoint {name!r} refused: this trainer has no checkpoint directory (start it "
            "with --checkpoint-dir DIR)")
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or os.path.isabs(name) or "\\" in name:
        raise CheckpointPathError(
            f"checkpoint {name!r} refused: name a checkpoint relative to the checkpoint "
            f"directory {root} (e.g. step_000042), not an absolute path")
    if ".." in pure.parts:
        raise CheckpointPathError(
            f"checkpoint {name!r} refused: '..' may not appear in a checkpoint name")
    real_root = root.resolve()
    target = (real_root / name).resolve()
    if target == real_root or not target.is_relative_to(real_root):
        raise CheckpointPathError(
            f"checkpoint {name!r} refused: it resolves to {target}, outside the checkpoint "
            f"directory {real_root} (symlinks are followed)")
    return target
