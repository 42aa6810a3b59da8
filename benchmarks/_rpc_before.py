"""BASELINE for ``benchmarks.rpc_floor`` only: ``rollart/transport/rpc.py`` as it was before
issue 11 (pyzmq's asyncio layer, default high-water marks, ROUTER_MANDATORY off), vendored
verbatim from ``main`` at commit b80fd0d so the comparison survives the merge. Not used by rollart.

Request/reply RPC over ZeroMQ ROUTER (server) / DEALER (client), matched by call id.

A server handles each request in its own task, so one slow request never delays another; a
request it cannot decode, of an unknown kind, or over ``max_message_bytes`` gets an
``ErrorReply`` naming the problem and the server keeps serving. A client awaits each reply with
a timeout, and a heartbeat task turns a silent peer into ``PeerDeadError`` for every pending and
later call instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError

log = logging.getLogger(__name__)

Buffers = Sequence[bytes | memoryview]
HandlerResult = m.Msg | tuple[m.Msg, Buffers]
Handler = Callable[[Any, list[memoryview]], Awaitable[HandlerResult]]

_CALL_ID = struct.Struct(">Q")
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(m.Request)
_reply_decoder = msgspec.msgpack.Decoder(m.Reply)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31


def _resolve_bind(address: str) -> str:
    # ZeroMQ spells "any free port" as ':*'; accept the more familiar ':0'.
    return address[:-2] + ":*" if address.endswith(":0") else address


class RpcServer:
    """ROUTER socket dispatching decoded requests to ``handlers`` by message type.

    Args:
        address: ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:5555`` (``:0`` = free port).
        handlers: message type -> ``async handler(msg, frames) -> reply`` where ``frames`` are the
            request's extra (tensor) frames and ``reply`` is a Struct or ``(Struct, buffers)``.
            A handler raising ``RemoteError`` replies with its code; any other exception replies
            ``internal`` (logged) — the server keeps serving either way.
        name: service name for ``Pong`` and logs.
        max_message_bytes: total bytes of one request (all frames) above which it is refused.
    """

    def __init__(
        self,
        address: str,
        handlers: dict[type, Handler],
        *,
        name: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.name = name
        self._handlers = dict(handlers)
        self._handlers.setdefault(m.Ping, self._ping)
        self._max_bytes = max_message_bytes
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(_resolve_bind(address))
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: set[asyncio.Task] = set()
        self._send_lock = asyncio.Lock()
        self._closed = asyncio.Event()

    async def _ping(self, _msg: m.Ping, _frames: list[memoryview]) -> m.Pong:
        return m.Pong(service=self.name, pid=os.getpid())

    async def serve_forever(self) -> None:
        """Receive and dispatch requests until ``close()``."""
        try:
            while not self._closed.is_set():
                try:
                    frames = await self._sock.recv_multipart(copy=False)
                except (zmq.ContextTerminated, zmq.ZMQError):
                    if self._closed.is_set():
                        return
                    raise
                task = asyncio.create_task(self._dispatch(frames))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            pass

    async def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        call_id_frame = frames[1].bytes if len(frames) > 1 else b""
        reply, buffers = await self._handle(frames, call_id_frame)
        if len(call_id_frame) != _CALL_ID.size:
            # Nothing to match a reply with; the error still tells the peer what was wrong.
            call_id_frame = _CALL_ID.pack(0)
        out = [identity, call_id_frame, _encoder.encode(reply), *buffers]
        async with self._send_lock:
            if self._closed.is_set():
                return
            try:
                await self._sock.send_multipart(out, copy=False)
            except zmq.ZMQError as exc:
                log.warning("%s: reply to a gone peer dropped: %s", self.name, exc)

    async def _handle(self, frames: list[zmq.Frame], call_id: bytes) -> tuple[m.Msg, Buffers]:
        if len(call_id) != _CALL_ID.size or len(frames) < 3:
            return m.ErrorReply(
                code="bad_request",
                message="expected frames [call id (8 bytes), msgpack body, *tensor frames]",
            ), ()
        size = sum(len(f.buffer) for f in frames[1:])
        if size > self._max_bytes:
            return m.ErrorReply(
                code="too_large",
                message=f"message of {size} bytes exceeds max_message_bytes={self._max_bytes}",
            ), ()
        try:
            msg = _request_decoder.decode(frames[2].buffer)
        except msgspec.ValidationError as exc:
            code = "unknown_kind" if str(exc).endswith("`$.kind`") else "bad_request"
            return m.ErrorReply(code=code, message=f"invalid request: {exc}"), ()
        except msgspec.DecodeError as exc:
            return m.ErrorReply(code="bad_request", message=f"undecodable body: {exc}"), ()
        handler = self._handlers.get(type(msg))
        if handler is None:
            return m.ErrorReply(
                code="unknown_kind",
                message=f"{self.name} does not handle {type(msg).__name__}",
            ), ()
        try:
            result = await handler(msg, [f.buffer for f in frames[3:]])
        except RemoteError as exc:
            return m.ErrorReply(code=exc.code, message=exc.message), ()
        except Exception as exc:  # a handler bug fails this request only
            log.exception("%s: handler for %s failed", self.name, type(msg).__name__)
            return m.ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}"), ()
        if isinstance(result, tuple):
            return result
        return result, ()

    async def close(self) -> None:
        """Stop receiving, cancel in-flight handlers and close the socket."""
        self._closed.set()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(linger=0)


class RpcClient:
    """DEALER socket issuing calls to one server; replies matched by call id.

    Args:
        address: the server's ZeroMQ endpoint.
        name: peer name used in error messages.
        default_timeout_s: timeout of a call that gives none.
        heartbeat_interval_s: seconds between ``Ping`` probes; ``0`` disables heartbeats.
        liveness_timeout_s: a peer silent for this long (no reply of any kind, pings included)
            is declared dead: pending and later calls raise ``PeerDeadError``.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str = "",
        default_timeout_s: float = 60.0,
        heartbeat_interval_s: float = 2.0,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self.name = name or address
        self.default_timeout_s = default_timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._dead: PeerDeadError | None = None
        self._last_heard = time.monotonic()
        self._hb_interval = heartbeat_interval_s
        self._liveness = liveness_timeout_s
        self._send_lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read_loop())
        self._heartbeat = (
            asyncio.create_task(self._heartbeat_loop()) if heartbeat_interval_s > 0 else None
        )

    @property
    def dead(self) -> bool:
        return self._dead is not None

    async def call(
        self, msg: m.Msg, *, buffers: Buffers = (), timeout_s: float | None = None
    ) -> tuple[m.Msg, list[memoryview]]:
        """Send ``msg`` (plus raw ``buffers``) and await the reply.

        Returns:
            ``(reply, frames)``: the decoded reply Struct and its extra frames.
        Raises:
            RemoteError: the server replied ``ErrorReply`` (per item; the server keeps serving).
            RemoteTimeoutError: no reply within ``timeout_s`` (the request is forgotten).
            PeerDeadError: the peer is dead (missed heartbeats) or the client was closed.
        """
        if self._dead is not None:
            raise self._dead
        call_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            async with self._send_lock:
                await self._sock.send_multipart(
                    [_CALL_ID.pack(call_id), _encoder.encode(msg), *buffers], copy=False
                )
            try:
                reply, frames = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise RemoteTimeoutError(
                    f"{self.name}: no reply to {type(msg).__name__} within {timeout:.3g} s"
                ) from None
        finally:
            self._pending.pop(call_id, None)
        if isinstance(reply, m.ErrorReply):
            raise RemoteError(reply.code, f"{self.name}: {reply.message}")
        return reply, frames

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self._last_heard = time.monotonic()
            if len(frames) < 2 or len(frames[0].bytes) != _CALL_ID.size:
                log.warning("%s: dropped a malformed reply (%d frames)", self.name, len(frames))
                continue
            (call_id,) = _CALL_ID.unpack(frames[0].bytes)
            fut = self._pending.get(call_id)
            try:
                reply = _reply_decoder.decode(frames[1].buffer)
            except msgspec.MsgspecError as exc:
                reply = m.ErrorReply(code="bad_request", message=f"undecodable reply: {exc}")
            if call_id == 0 and isinstance(reply, m.ErrorReply):
                log.warning("%s: unmatched error reply: %s", self.name, reply.message)
            if fut is not None and not fut.done():
                fut.set_result((reply, [f.buffer for f in frames[2:]]))

    async def _heartbeat_loop(self) -> None:
        while self._dead is None:
            await asyncio.sleep(self._hb_interval)
            with contextlib.suppress(RemoteError, PeerDeadError):
                # Any reply refreshes _last_heard; the ping only guarantees there is traffic.
                await self.call(m.Ping(), timeout_s=self._liveness)
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self._liveness and self._dead is None:
                self._fail_all(
                    PeerDeadError(f"{self.name} ({self.address}) silent for {silent_s:.1f} s")
                )

    def _fail_all(self, exc: PeerDeadError) -> None:
        self._dead = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def mark_dead(self, reason: str) -> None:
        """Declare the peer dead (e.g. its process exited): pending calls fail now."""
        if self._dead is None:
            self._fail_all(PeerDeadError(f"{self.name} ({self.address}): {reason}"))

    async def close(self) -> None:
        """Fail pending calls, stop background tasks and close the socket."""
        self.mark_dead("client closed")
        tasks = [t for t in (self._reader, self._heartbeat) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close(linger=0)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
