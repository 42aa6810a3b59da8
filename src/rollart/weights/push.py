"""Versioned weight broadcast from the trainer to inference workers (CPU / cross-cluster path).

After each optimizer step the trainer snapshots its parameters as version ``v`` and pushes them,
in CRC-checked buckets over ZeroMQ, to every registered inference worker in the background, so
training of the next step is not blocked (paper §6.3: push overlaps rollout). Workers only
*stage* buckets; the controller applies a version at its pause/resume point (§6.2), which is the
only part of the transfer exposed to rollout.

With ``[trainer] weight_delta`` off every push is the full parameter set; otherwise a worker
holding the previous version gets only what changed (``rollart.weights.sender.DeltaSender``
decides per worker; a worker that missed versions gets the latest in full, never a replay of
deltas).

Which workers may receive weights is decided by the trainer service (``rollart.trainer.access``);
the publisher pushes to the addresses it is given. A worker whose push fails because it is dead
(its client declared it so, at most ``liveness_timeout_s`` + one heartbeat after it went silent)
or took longer than ``push_timeout_s`` is marked unreachable, logged once, and skipped at once by
every later push (reported in ``failed``), so one dead peer never delays each later version;
registering it again (``set_workers`` without it, then with it) connects afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from rollart.weights.sender import DeltaSender

log = logging.getLogger(__name__)


class WeightSink(Protocol):
    """What the publisher needs from an inference worker client (InferenceClient fits)."""

    name: str

    @property
    def dead(self) -> bool: ...

    async def push_weights(self, version: int, named_tensors: Iterable[tuple[str, Any]], *,
                           bucket_bytes: int) -> None: ...

    async def close(self) -> None: ...


class PushReport(msgspec.Struct, kw_only=True):
    """Outcome of pushing one version to every registered worker.

    ``total_s``: wall seconds from the snapshot to the last worker's last bucket staged.
    ``num_bytes``: bytes of one full copy of the weights. ``failed``: worker -> error text.
    ``wire_bytes``: tensor / delta payload bytes sent, all workers together; ``delta_workers``:
    the workers that got a delta.
    """

    version: int
    total_s: float
    num_bytes: int
    workers: list[str]
    failed: dict[str, str] = {}
    wire_bytes: int = 0
    delta_workers: list[str] = []


def snapshot_parameters(model: Any) -> list[tuple[str, Any]]:
    """Detached CPU copies of the model's parameters, names as in the HF checkpoint.

    ``named_parameters()`` lists a tied parameter once, so a tied ``lm_head.weight`` (which
    shares memory with ``model.embed_tokens.weight``) is not sent twice.
    """
    return [(name, p.detach().to("cpu", copy=True)) for name, p in model.named_parameters()]


class WeightPublisher:
    """Pushes each new weight version to a set of workers, in the background.

    Args:
        connect: ``address -> WeightSink`` (e.g. ``lambda a: InferenceClient(a, name=a)``).
        bucket_bytes: target bucket size in bytes (the paper uses ~1 GB buckets).
        push_timeout_s: limit of pushing one version to one worker, seconds; a worker over it
            is marked unreachable.
        delta: full / delta choice per worker (``None``: always full).
    """

    def __init__(self, connect: Callable[[str], WeightSink], *, bucket_bytes: int,
                 push_timeout_s: float = 600.0, delta: DeltaSender | None = None) -> None:
        self._connect = connect
        self.delta = delta or DeltaSender("off", full_every=1, bucket_bytes=bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.push_timeout_s = push_timeout_s
        self._sinks: dict[str, WeightSink] = {}
        #: address -> why it was marked unreachable (later pushes skip it)
        self.unreachable: dict[str, str] = {}
        self._latest: tuple[int, list[tuple[str, Any]]] | None = None
        self._pushes: dict[int, asyncio.Task[PushReport]] = {}

    @property
    def latest_version(self) -> int | None:
        return None if self._latest is None else self._latest[0]

    async def set_workers(self, addresses: Iterable[str]) -> None:
        """Register the workers to push to (clients to removed workers are closed)."""
        wanted = list(dict.fromkeys(addresses))
        for addr in list(self._sinks):
            if addr not in wanted:
                self.delta.forget(addr)
                await self._sinks.pop(addr).close()
                self.unreachable.pop(addr, None)
        for addr in wanted:
            if addr not in self._sinks:
                self._sinks[addr] = self._connect(addr)

    def publish(self, version: int, named_tensors: list[tuple[str, Any]]) -> None:
        """Start pushing ``version`` to every registered worker; returns immediately.

        Raises:
            ValueError: ``version`` is not newer than the latest published one.
        """
        if self._latest is not None and version <= self._latest[0]:
            raise ValueError(f"version {version} is not newer than {self._latest[0]}")
        self._latest = (version, named_tensors)
        self.delta.remember(version, named_tensors)
        self._pushes[version] = asyncio.create_task(
            self._push(version, named_tensors, list(self._sinks))
        )
        # Older reports are no longer awaited by anyone once a newer version exists.
        for v in [v for v in self._pushes if v < version - 1]:
            self._pushes.pop(v)

    async def wait(self, version: int, timeout_s: float | None = None) -> PushReport:
        """Await the background push of ``version``.

        Raises:
            KeyError: ``version`` was never published (or is long superseded).
            TimeoutError: not finished within ``timeout_s``.
        """
        task = self._pushes[version]
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def ensure_staged(self, version: int, addresses: Iterable[str]) -> PushReport:
        """Await the push of ``version``, then push it to those of ``addresses`` that push did
        not include (registered after the step, or a resumed run's workers); one report of both,
        ``total_s`` their sum. The publisher alone knows which workers got which version.

        Raises:
            KeyError: ``version`` was never published (or is long superseded).
            LookupError: a worker needs ``version`` pushed but it is no longer the latest.
        """
        report = await self.wait(version)
        missing = [a for a in dict.fromkeys(addresses) if a not in report.workers]
        if not missing:
            return report
        if self.latest_version != version:
            raise LookupError(f"version {version} is superseded by {self.latest_version}: it "
                              f"cannot be pushed to {missing}")
        extra = await self.push_latest(missing)
        if extra.version != version:  # a newer step was published meanwhile
            raise LookupError(f"version {version} was superseded by {extra.version} while "
                              f"pushing it to {missing}")
        return PushReport(version=version, total_s=report.total_s + extra.total_s,
                          num_bytes=report.num_bytes, workers=[*report.workers, *missing],
                          failed={**report.failed, **extra.failed})

    async def push_latest(self, addresses: Iterable[str]) -> PushReport:
        """Bring the given workers to the latest version (e.g. after they missed one).

        Raises:
            RuntimeError: nothing published yet.
        """
        if self._latest is None:
            raise RuntimeError("no weight version published yet")
        await self.set_workers([*self._sinks, *addresses])
        version, tensors = self._latest
        return await self._push(version, tensors, list(addresses))

    async def _push(self, version: int, tensors: list[tuple[str, Any]],
                    addresses: list[str]) -> PushReport:
        start = time.perf_counter()
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)

        async def one(addr: str) -> tuple[int, bool]:
            if addr in self.unreachable:
                raise ConnectionError(f"skipped: {self.unreachable[addr]}")
            sink = self._sinks[addr]
            try:
                return await asyncio.wait_for(
                    self.delta.push(addr, sink, version, tensors), self.push_timeout_s)
            except TimeoutError:
                self._mark(addr, version, f"push exceeded push_timeout_s={self.push_timeout_s:g}")
                raise
            except Exception as exc:
                if sink.dead:
                    self._mark(addr, version, f"declared dead: {exc}")
                raise

        results = await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True)
        failed = {a: repr(r) for a, r in zip(addresses, results, strict=True)
                  if isinstance(r, BaseException)}
        for addr, err in failed.items():
            log.warning("weight push of version %d to %s failed: %s", version, addr, err)
        sent = [r for r in results if isinstance(r, tuple)]
        return PushReport(version=version, total_s=time.perf_counter() - start,
                          num_bytes=num_bytes, workers=addresses, failed=failed,
                          wire_bytes=sum(n for n, _ in sent),
                          delta_workers=[a for a, r in zip(addresses, results, strict=True)
                                         if isinstance(r, tuple) and r[1]])

    def _mark(self, addr: str, version: int, why: str) -> None:
        self.unreachable[addr] = f"worker {addr} unreachable since version {version} ({why})"
        log.warning("%s; later versions skip it until it is registered again",
                    self.unreachable[addr])

    async def close(self) -> None:
        for task in self._pushes.values():
            task.cancel()
        await asyncio.gather(*self._pushes.values(), return_exceptions=True)
        for sink in self._sinks.values():
            await sink.close()
        self._sinks.clear()
