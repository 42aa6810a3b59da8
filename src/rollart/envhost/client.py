"""Client of one env host (``rollart serve-env``), used by the controller's trajectories."""

from __future__ import annotations

from asyncio import CancelledError
from typing import Any, TypeVar

from rollart.transport import messages as m
from rollart.transport.errors import EnvError
from rollart.transport.rpc import RpcClient
from rollart.transport.security import Auth

R = TypeVar("R", bound=m.Msg)


class EnvClient:
    """Async client of one env host.

    Args:
        address: the host's ZeroMQ endpoint (its ``--ready-file`` content).
        auth: the run's key (``rollart.transport.security.RunKey``) or ``INSECURE``, as the
            host was started with (else it never answers).
        name: peer name used in errors and logs.
        default_timeout_s: timeout of a call that gives none (seconds); keep it above the host's
            ``step_timeout_s`` plus any injected latency so the host's typed ``env_timeout``
            arrives before the client gives up.
        heartbeat_interval_s, liveness_timeout_s: see ``RpcClient``; a host silent for
            ``liveness_timeout_s`` is declared dead.

    Errors: a per-session failure raises ``EnvError`` with ``code`` ``env_error`` (the env
    raised), ``env_timeout`` (the env step exceeded the host's timeout), ``not_found`` (unknown
    env name / session, or a session already failed or closed), ``bad_request`` (bad options, a
    step on a session already stepping, host full). No reply in time raises
    ``RemoteTimeoutError``; a dead host raises ``PeerDeadError`` for this and every later call.
    Must be constructed inside a running event loop.
    """

    def __init__(
        self,
        address: str,
        *,
        auth: Auth,
        name: str = "",
        default_timeout_s: float = 120.0,
        heartbeat_interval_s: float = 2.0,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self.name = name or address
        self.address = address
        self._rpc = RpcClient(
            address,
            auth=auth,
            name=self.name,
            default_timeout_s=default_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
            liveness_timeout_s=liveness_timeout_s,
            error_type=EnvError,
        )

    @property
    def dead(self) -> bool:
        """True once the host was declared dead (or the client closed)."""
        return self._rpc.dead

    def mark_dead(self, reason: str) -> None:
        """Declare the host dead (e.g. its process exited): pending calls fail now."""
        self._rpc.mark_dead(reason)

    def _expect(self, msg: m.Msg, reply: m.Msg, expect: type[R]) -> R:
        if not isinstance(reply, expect):
            raise EnvError(
                "internal",
                f"{self.name}: expected {expect.__name__} in reply to {type(msg).__name__}, "
                f"got {type(reply).__name__}",
            )
        return reply

    # ``step``, the call of every turn, awaits the RPC future itself (no helper coroutine per
    # call: every coroutine layer is one more GC-tracked object alive for the whole call,
    # measured at 10k trajectories); the rarer calls go through ``RpcClient.call``. ``error_type=EnvError`` makes
    # the RPC client raise the typed error directly. A cancelled call is forgotten at once
    # (``RpcClient.forget``): the host still finishes the step and its reply is ignored.

    async def open(
        self,
        env_name: str,
        seed: int,
        options: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> m.EnvOpened:
        """Open a session of ``env_name`` reset with ``seed``; returns its id and first
        observation. ``options`` are the env's construction options (e.g. a reasoning-gym
        dataset config); unknown keys are a ``bad_request``."""
        msg = m.EnvOpen(env_name=env_name, seed=seed, options=dict(options or {}))
        reply, _ = await self._rpc.call(msg, timeout_s=timeout_s)
        return self._expect(msg, reply, m.EnvOpened)

    async def step(
        self, session_id: str, action: str, *, timeout_s: float | None = None
    ) -> m.EnvStepResult:
        """Apply ``action`` (text) to a session. Raises ``EnvError`` (see the class docstring);
        after ``env_error`` / ``env_timeout`` the session is gone, and so it is after a step
        that ended the episode (terminated or truncated: the reply says ``closed``)."""
        msg = m.EnvStep(session_id=session_id, action=action)
        call_id, fut = self._rpc.submit_call(msg, timeout_s=timeout_s)
        try:
            reply, _ = await fut
        except CancelledError:
            self._rpc.forget(call_id)
            raise
        finally:
            del fut  # see RpcClient.call: an error is then freed without the cycle collector
        return self._expect(msg, reply, m.EnvStepResult)

    async def close_session(self, session_id: str, *, timeout_s: float | None = None) -> None:
        """Close a session and release its env. Closing a session that already failed or was
        closed is a no-op; an id the host never issued raises ``EnvError(not_found)``."""
        msg = m.EnvClose(session_id=session_id)
        reply, _ = await self._rpc.call(msg, timeout_s=timeout_s)
        self._expect(msg, reply, m.Ack)

    async def stats(self, *, timeout_s: float | None = None) -> m.EnvHostStats:
        """The host's open sessions, steps and env failures."""
        msg = m.GetEnvStats()
        reply, _ = await self._rpc.call(msg, timeout_s=timeout_s)
        return self._expect(msg, reply, m.EnvHostStats)

    async def close(self) -> None:
        """Close the connection (not the host); later calls raise ``PeerDeadError``."""
        await self._rpc.close()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
