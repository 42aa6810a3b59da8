"""Client of the trainer process, used by the controller (``TrainerBackend`` fits it)."""

from __future__ import annotations

from collections.abc import Sequence

from rollart.transport import messages as m
from rollart.transport.rpc import RpcClient
from rollart.transport.security import Auth


class TrainerClient:
    """Typed calls to ``rollart serve-trainer``.

    Args:
        address: the trainer's ZMQ endpoint.
        auth: the run's key (``rollart.transport.security.RunKey``) or ``INSECURE``, as the
            trainer was started with (else it never answers).
        train_timeout_s: timeout of one ``train`` call (a step on a large batch can be slow).
        publish_timeout_s: timeout of ``wait_published`` / ``publish_latest`` (a collective
            broadcast includes the group's rendezvous and every worker's load).
    Raises (every method): ``RemoteError`` (per request), ``RemoteTimeoutError``,
        ``PeerDeadError`` (the trainer process is gone: fatal for the run).
    """

    def __init__(self, address: str, *, auth: Auth, train_timeout_s: float = 3600.0,
                 publish_timeout_s: float = 600.0, default_timeout_s: float = 600.0,
                 liveness_timeout_s: float = 60.0) -> None:
        self.name = "trainer"
        self.train_timeout_s = train_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self._rpc = RpcClient(address, auth=auth, name="trainer", default_timeout_s=default_timeout_s,
                              liveness_timeout_s=liveness_timeout_s)

    @property
    def dead(self) -> bool:
        return self._rpc.dead

    def mark_dead(self, reason: str) -> None:
        """Declare the trainer dead (its process exited): pending calls fail now."""
        self._rpc.mark_dead(reason)

    async def train(self, version: int, samples: Sequence[m.TrainSample]) -> m.TrainResult:
        """One optimizer step on ``samples`` from the trainer's ``version`` (``stale_version``
        if it holds another); returns once ``version + 1`` exists (being pushed)."""
        reply, _ = await self._rpc.call(m.TrainBatch(version=version, samples=list(samples)),
                                        timeout_s=self.train_timeout_s)
        assert isinstance(reply, m.TrainResult)
        return reply

    async def register_workers(self, addresses: Sequence[str]) -> None:
        """Register the run's workers (once): the only ones the trainer sends weights to.
        Raises ``RemoteError`` (``forbidden``) if others were registered already."""
        await self._rpc.call(m.RegisterWorkers(addresses=list(addresses)))

    async def set_workers(self, addresses: Sequence[str]) -> None:
        """Push to these registered workers from now on (``forbidden``: one is not)."""
        await self._rpc.call(m.SetWorkers(addresses=list(addresses)))

    async def wait_published(self, version: int, addresses: Sequence[str] = ()) -> m.Published:
        """ZeroMQ transfer: wait until ``version`` is staged where its push went and on
        ``addresses`` (the trainer pushes it to those it did not reach)."""
        reply, _ = await self._rpc.call(m.WaitPublished(version=version,
                                                        addresses=list(addresses)),
                                        timeout_s=self.publish_timeout_s)
        assert isinstance(reply, m.Published)
        return reply

    async def broadcast_version(self, version: int) -> m.Published:
        """Collective transfer: broadcast ``version`` into the (paused) workers' models now."""
        reply, _ = await self._rpc.call(m.BroadcastVersion(version=version),
                                        timeout_s=self.publish_timeout_s)
        assert isinstance(reply, m.Published)
        return reply

    async def publish_latest(self, addresses: Sequence[str]) -> m.Published:
        reply, _ = await self._rpc.call(m.PublishLatest(addresses=list(addresses)),
                                        timeout_s=self.publish_timeout_s)
        assert isinstance(reply, m.Published)
        return reply

    async def save_checkpoint(self, path: str) -> m.CheckpointSaved:
        """Save as ``path``, relative to the trainer's ``--checkpoint-dir`` (``step_000042``);
        the reply's ``path`` is the directory written. Raises ``RemoteError`` (``forbidden``)
        for an absolute path or one resolving outside that directory."""
        reply, _ = await self._rpc.call(m.SaveCheckpoint(path=path))
        assert isinstance(reply, m.CheckpointSaved)
        return reply

    async def status(self) -> m.TrainerStatus:
        reply, _ = await self._rpc.call(m.GetTrainerState())
        assert isinstance(reply, m.TrainerStatus)
        return reply

    async def close(self) -> None:
        await self._rpc.close()
