"""Request/reply RPC over ZeroMQ ROUTER (server) / DEALER (client), matched by call id.

A server handles each request in its own task, so one slow request never delays another; a
request it cannot decode, of an unknown kind, or over ``max_message_bytes`` gets an
``ErrorReply`` naming the problem and the server keeps serving. A client awaits each reply with
a timeout, and a heartbeat task turns a silent peer into ``PeerDeadError`` for every pending and
later call instead of a hang.

What an in-flight call keeps alive is one future (``RpcClient.submit``): its deadline sits in
the client's deadline wheel (``rollart.transport.deadlines``: 8 bytes, one loop timer per
client), its entry in the pending table is keyed by the call id's wire bytes, and an error reply
is raised through the future as the client's ``error_type``; at 10k+ calls in flight, each
further object per call is one more for the garbage collector to traverse. A call
leaves the pending table on its reply, its deadline, the peer's death, or ``forget``: a caller
awaiting ``submit_call``'s future forgets it when cancelled (``call`` and the env and inference
clients do), so a long run of cancelled calls (a redundant trajectory, an ``asyncio.timeout``)
holds nothing for them. (A ``Future`` subclass overriding ``cancel`` would do it for every
caller, but a Task awaiting anything but an exact ``Future`` takes its slow path: +0.9 us per
call on the dev VM, on a ~2.5 us bare future round trip; the ``except CancelledError`` costs
nothing until it fires.)

No message is dropped for load: sockets have no high-water mark (see ``_HWM``), a send that
finds a pipe full anyway stays queued (``SocketPump``), and the server's ROUTER is
``ROUTER_MANDATORY`` so the one reply that cannot be delivered, to a peer that is gone, is
logged and counted (``RpcServer.replies_to_gone_peers``) instead of vanishing. Both ends run
plain sockets from the event loop in bulk (``rollart.transport.zmqloop``), not ``zmq.asyncio``:
small messages to one peer in one loop tick travel as one ZeroMQ message (a batch envelope).

Every socket is given an ``auth`` (``rollart.transport.security``): the run's CURVE key, or
``INSECURE`` chosen explicitly. A server's ``MAXMSGSIZE`` (``max_frame_bytes``) is set before it
binds, so ZeroMQ drops a peer announcing a larger frame before buffering it; the total size
of a request (all frames) is checked after the read (``max_message_bytes``: a ``too_large``
reply).
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
from typing import Any, cast

import msgspec
import zmq

from rollart.transport import messages as m
from rollart.transport.deadlines import DeadlineWheel
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError
from rollart.transport.security import Auth
from rollart.transport.zmqloop import MAX_BATCH_FRAME_BYTES, Part, SocketPump

log = logging.getLogger(__name__)

Buffers = Sequence[bytes | memoryview]
HandlerResult = m.Msg | tuple[m.Msg, Buffers]
Handler = Callable[[Any, list[memoryview]], Awaitable[HandlerResult]]

_CALL_ID = struct.Struct(">Q")
_NO_CALL_ID = _CALL_ID.pack(0)
#: Timed-out calls an ``RpcClient`` remembers to count their late replies (8-byte ids: at
#: most ~1.5 MiB with the dict's overhead); older ones are forgotten first.
LATE_REPLY_MEMORY = 16_384
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(m.Request)
_reply_decoder = msgspec.msgpack.Decoder(m.Reply)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31

#: SNDHWM and RCVHWM of every RPC socket: 0 = no limit. ZeroMQ's answer at a high-water mark
#: is to drop (ROUTER) or to refuse (DEALER), and RPC wants neither: every message in flight
#: is a request some caller awaits or the reply to one, so their number is already bounded by
#: the callers' own concurrency (trajectories, weight buckets), and a second, smaller bound
#: here only turns load into lost replies (measured: 10k outstanding calls against the
#: default 1000). Memory is what those callers already hold: ~100 B of pipe per small message.
#: Tests set it to 2 to force full pipes and the EAGAIN path (not 1: a CURVE server whose
#: RCVHWM is 1 never delivers its first message, libzmq 4.3.5, measured).
_HWM = 0


def _resolve_bind(address: str) -> str:
    # ZeroMQ spells "any free port" as ':*'; accept the more familiar ':0'.
    return address[:-2] + ":*" if address.endswith(":0") else address


def _socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    return sock


class RpcServer:
    """ROUTER socket dispatching decoded requests to ``handlers`` by message type.

    Args:
        address: ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:5555`` (``:0`` = free port).
        handlers: message type -> ``async handler(msg, frames) -> reply`` where ``frames`` are the
            request's extra (tensor) frames and ``reply`` is a Struct or ``(Struct, buffers)``.
            A handler raising ``RemoteError`` replies with its code; any other exception replies
            ``internal`` (logged) — the server keeps serving either way.
        name: service name for ``Pong`` and logs.
        auth: the run's key (``RunKey``: only its holders are served) or ``INSECURE``.
        max_message_bytes: total bytes of one request (all frames) above which it is refused
            with a ``too_large`` reply.
        max_frame_bytes: the socket's ``MAXMSGSIZE``: a peer sending a larger frame is
            disconnected by ZeroMQ before the frame is buffered (no reply: its calls time out).
            Default ``max_message_bytes``; raised to at least ``MAX_BATCH_FRAME_BYTES`` so
            batch envelopes of small requests always fit.

    ``replies_to_gone_peers`` counts replies ZeroMQ refused because their client had
    disconnected (``EHOSTUNREACH``); each is logged. No other reply is ever dropped.
    """

    def __init__(
        self,
        address: str,
        handlers: dict[type, Handler],
        *,
        name: str,
        auth: Auth,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_frame_bytes: int | None = None,
    ) -> None:
        self.name = name
        self._handlers = dict(handlers)
        self._handlers.setdefault(m.Ping, self._ping)
        self._max_bytes = max_message_bytes
        self.max_frame_bytes = max(max_frame_bytes or max_message_bytes, MAX_BATCH_FRAME_BYTES)
        self.auth = auth
        self._sock = _socket(zmq.ROUTER)
        # Both before bind: no peer is ever read without them.
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        auth.secure_server(self._sock)
        # Without it a ROUTER silently drops a message it cannot route or whose pipe is full;
        # with it the send raises EHOSTUNREACH (peer gone: counted, logged) or EAGAIN (kept).
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(_resolve_bind(address))
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replies_to_gone_peers = 0
        self._pump: SocketPump | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()

    async def _ping(self, _msg: m.Ping, _frames: list[memoryview]) -> m.Pong:
        return m.Pong(service=self.name, pid=os.getpid())

    async def serve_forever(self) -> None:
        """Receive and dispatch requests until ``close()`` (or until cancelled: then stop
        receiving, while replies of requests already taken still go out)."""
        if self._closed.is_set():
            return
        if self._pump is None:
            self._loop = asyncio.get_running_loop()
            self._pump = SocketPump(self._sock, self._on_request, copy_parts=3,
                                    on_send_error=self._send_failed,
                                    on_bad_batch=self._bad_batch, name=self.name)
        self._pump.receiving = True
        try:
            await self._closed.wait()
        except asyncio.CancelledError:
            if self._pump is not None:
                self._pump.receiving = False

    def _on_request(self, parts: list[Part]) -> None:
        identity = parts[0]
        call_id = parts[1] if len(parts) > 1 else b""
        if len(call_id) != _CALL_ID.size:
            # Nothing to match a reply with; the error still tells the peer what was wrong.
            call_id = _NO_CALL_ID
        msg = self._decode(parts)
        if isinstance(msg, m.ErrorReply):
            self._send(identity, call_id, msg, ())
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._send(identity, call_id, m.ErrorReply(
                code="unknown_kind", message=f"{self.name} does not handle {type(msg).__name__}",
            ), ())
            return
        task = self._loop.create_task(self._run(handler, msg, parts, identity, call_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _bad_batch(self, prefix: list[Part], reason: str) -> None:
        # No call id to answer (the broken entry's may be garbage): call id 0 names the problem.
        if prefix:
            self._send(prefix[0], _NO_CALL_ID, m.ErrorReply(
                code="bad_request", message=f"{self.name}: {reason}"), ())

    def _decode(self, parts: list[Part]) -> Any:
        if len(parts) >= 2 and len(parts[1]) == 0:
            return m.ErrorReply(
                code="bad_request",
                message=f"a batch envelope is [empty frame, blob]: got {len(parts) - 1} frames "
                "after the identity",
            )
        if len(parts) < 3 or len(parts[1]) != _CALL_ID.size:
            return m.ErrorReply(
                code="bad_request",
                message="expected frames [call id (8 bytes), msgpack body, *tensor frames]",
            )
        size = len(parts[1]) + len(parts[2])
        if len(parts) > 3:
            size += sum(len(p) for p in parts[3:])
        if size > self._max_bytes:
            return m.ErrorReply(
                code="too_large",
                message=f"message of {size} bytes exceeds max_message_bytes={self._max_bytes}",
            )
        try:
            return _request_decoder.decode(parts[2])
        except msgspec.ValidationError as exc:
            code = "unknown_kind" if str(exc).endswith("`$.kind`") else "bad_request"
            return m.ErrorReply(code=code, message=f"invalid request: {exc}")
        except msgspec.DecodeError as exc:
            return m.ErrorReply(code="bad_request", message=f"undecodable body: {exc}")

    async def _run(self, handler: Handler, msg: Any, parts: list[Part], identity: Part,
                   call_id: Part) -> None:
        try:
            # Frames past the first three arrive uncopied (copy_parts=3): memoryviews.
            result = await handler(msg, cast("list[memoryview]", parts[3:]))
        except RemoteError as exc:
            result = m.ErrorReply(code=exc.code, message=exc.message, fault=exc.fault)
        except Exception as exc:  # a handler bug fails this request only
            log.exception("%s: handler for %s failed", self.name, type(msg).__name__)
            result = m.ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
        if isinstance(result, tuple):
            self._send(identity, call_id, result[0], result[1])
        else:
            self._send(identity, call_id, result, ())

    def _send(self, identity: Part, call_id: Part, reply: m.Msg, buffers: Buffers) -> None:
        if self._pump is None or self._closed.is_set():
            return
        try:
            body = _encoder.encode(reply)
        except (TypeError, msgspec.EncodeError) as exc:
            # A handler returned something that is not a wire message: fail this call only.
            log.error("%s: cannot encode reply %r: %s", self.name, reply, exc)
            body = _encoder.encode(m.ErrorReply(
                code="internal", message=f"{self.name}: unencodable reply: {exc}"))
            buffers = ()
        self._pump.send([identity, call_id, body, *buffers])

    def _send_failed(self, parts: Sequence[Part], count: int, exc: zmq.ZMQError) -> bool:
        if exc.errno == zmq.EHOSTUNREACH:
            self.replies_to_gone_peers += count
            log.warning("%s: %d reply(ies) to a gone peer dropped (it disconnected): %s",
                        self.name, count, exc)
        else:
            log.warning("%s: %d reply(ies) not sent: %s", self.name, count, exc)
        return False

    async def close(self) -> None:
        """Stop receiving, cancel in-flight handlers and close the socket."""
        self._closed.set()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pump is not None:
            self._pump.close()
        else:
            self._sock.close(linger=0)


class RpcClient:
    """DEALER socket issuing calls to one server; replies matched by call id.

    Args:
        address: the server's ZeroMQ endpoint.
        auth: the run's key (``RunKey``) or ``INSECURE``; it must match the server's: a client
            without the server's key gets no reply (its calls time out, the peer looks dead).
        name: peer name used in error messages.
        default_timeout_s: timeout of a call that gives none.
        heartbeat_interval_s: seconds between ``Ping`` probes; ``0`` disables heartbeats.
        liveness_timeout_s: a peer silent for this long (no reply of any kind, pings included)
            is declared dead: pending and later calls raise ``PeerDeadError``.
        error_type: the ``RemoteError`` subclass raised for an ``ErrorReply`` or an
            undecodable reply, built as ``error_type(code, message)`` (e.g. ``EnvError``), so
            a client wrapping this one needs no coroutine of its own to map errors.

    Must be created on a running event loop. Requests are never dropped: they queue (in the
    client, then in ZeroMQ) until the server takes them, however many are outstanding. A
    call's timeout fires no earlier than ``timeout_s`` and at most ``EXPIRY_GRANULARITY_S``
    (0.1 s) later (one deadline wheel per client instead of a loop timer per call).

    Counters (since creation): ``num_timeouts``, calls that ended in ``RemoteTimeoutError``;
    ``num_late_replies``, replies that arrived for one of those after its timeout (the reply
    was slow, not lost: e.g. a starved event loop read it too late). A timed-out call whose
    reply never comes is a lost reply: ``num_timeouts - num_late_replies`` once every late
    reply had time to arrive. The ids of the last ``LATE_REPLY_MEMORY`` timed-out calls are
    remembered to recognise their replies. A reply to a forgotten (cancelled) call is ignored,
    counted in neither.
    """

    def __init__(
        self,
        address: str,
        *,
        auth: Auth,
        name: str = "",
        default_timeout_s: float = 60.0,
        heartbeat_interval_s: float = 2.0,
        liveness_timeout_s: float = 10.0,
        error_type: type[RemoteError] = RemoteError,
    ) -> None:
        self.address = address
        self.name = name or address
        self.default_timeout_s = default_timeout_s
        self._loop = asyncio.get_running_loop()
        self._sock = _socket(zmq.DEALER)
        auth.secure_client(self._sock)
        self._sock.connect(address)
        self._error_type = error_type
        # Keyed by the call id's 8 wire bytes; an entry leaves on its reply, its deadline,
        # death of the peer, or ``forget``.
        self._pending: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.num_timeouts = 0
        self.num_late_replies = 0
        # call id -> None, oldest first: the timed-out calls whose replies may still come
        self._expired: dict[bytes, None] = {}
        self._dead: PeerDeadError | None = None
        self._hb_interval = heartbeat_interval_s
        self._liveness = liveness_timeout_s
        self._pump = SocketPump(self._sock, self._on_reply, copy_parts=2, name=self.name)
        # Replies already in the socket are read before any deadline fires: a starved loop
        # (a collection, a burst of trajectory starts) must not turn them into timeouts.
        self._deadlines = DeadlineWheel(self._loop, self._expire, self._pending,
                                        before_expiry=self._pump.drain_now)
        self._heartbeat = (
            asyncio.create_task(self._heartbeat_loop()) if heartbeat_interval_s > 0 else None
        )

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def submit(
        self, msg: m.Msg, *, buffers: Buffers = (), timeout_s: float | None = None
    ) -> asyncio.Future[tuple[m.Msg, list[memoryview]]]:
        """Send ``msg`` (plus raw ``buffers``) and return the future of its reply:
        ``submit_call`` without the call id. Cancelling this future leaves the call in the
        pending table until its reply or deadline; a caller that may be cancelled uses
        ``submit_call`` and ``forget``."""
        return self.submit_call(msg, buffers=buffers, timeout_s=timeout_s)[1]

    def submit_call(
        self, msg: m.Msg, *, buffers: Buffers = (), timeout_s: float | None = None
    ) -> tuple[bytes, asyncio.Future[tuple[m.Msg, list[memoryview]]]]:
        """Send ``msg`` (plus raw ``buffers``); return its call id and the future of its reply.

        The cheap form of ``call`` for hot paths: no coroutine and no timer per call (a
        caller awaiting it keeps only this future alive). The timeout is kept by a deadline
        wheel (``rollart.transport.deadlines``): the future fails no earlier than
        ``timeout_s`` seconds from now and at most ``EXPIRY_GRANULARITY_S`` (0.1 s) later.
        A caller whose await is cancelled calls ``forget(call_id)`` (its ``except
        CancelledError``: free on the path that is not cancelled), so the call leaves the
        pending table at once; its reply, if it still comes, is then ignored.

        Returns:
            ``(call_id, future)``: the call's 8-byte id, and a future of ``(reply, frames)``:
            the decoded reply Struct and its extra frames.
        Raises:
            PeerDeadError: at once, if the peer is already dead or the client closed.
            TypeError, msgspec.EncodeError: ``msg`` cannot be encoded (nothing was sent).
            ValueError: ``timeout_s`` is NaN (nothing was sent; ``inf`` never times out).
        The future raises:
            RemoteError (of the client's ``error_type``): the server replied ``ErrorReply``
                (its ``code``), or the reply could not be decoded (``bad_reply``).
            RemoteTimeoutError: no reply within ``timeout_s`` (the request is forgotten).
            PeerDeadError: the peer died (missed heartbeats) or the client was closed.
        """
        if self._dead is not None:
            raise self._dead
        body = _encoder.encode(msg)
        call_id = _CALL_ID.pack(next(self._ids))
        self._deadlines.add(call_id, type(msg).__name__,
                            self.default_timeout_s if timeout_s is None else timeout_s)
        fut: asyncio.Future = self._loop.create_future()
        self._pending[call_id] = fut
        self._pump.send([call_id, body, *buffers] if buffers else [call_id, body])
        return call_id, fut

    def forget(self, call_id: bytes) -> None:
        """Drop a call from the pending table now, cancelling its future if not yet done
        (an unknown or finished ``call_id`` is a no-op). Its reply, if it still comes, is
        ignored like any reply to an unknown id: neither a late reply (``num_late_replies``
        counts timed-out calls only, so ``num_timeouts - num_late_replies`` stays the count of
        lost replies) nor an error; its dead id leaves the deadline wheel at its next
        compaction or firing."""
        fut = self._pending.pop(call_id, None)
        if fut is not None:
            fut.cancel()

    async def call(
        self, msg: m.Msg, *, buffers: Buffers = (), timeout_s: float | None = None
    ) -> tuple[m.Msg, list[memoryview]]:
        """Send ``msg`` (plus raw ``buffers``) and await the reply (``submit`` as a coroutine;
        cancelling the awaiting task ``forget``s the call).

        Returns:
            ``(reply, frames)``: the decoded reply Struct and its extra frames.
        Raises:
            RemoteError: the server replied ``ErrorReply`` (per item; the server keeps serving).
            RemoteTimeoutError: no reply within ``timeout_s`` (at most
                ``EXPIRY_GRANULARITY_S`` later; the request is forgotten).
            PeerDeadError: the peer is dead (missed heartbeats) or the client was closed.
        """
        call_id, fut = self.submit_call(msg, buffers=buffers, timeout_s=timeout_s)
        try:
            return await fut
        except asyncio.CancelledError:
            self.forget(call_id)
            raise
        finally:
            # A failed future holds its exception, whose traceback holds this frame, which
            # holds the future: a reference cycle per error reply, left to the cycle
            # collector (at 10k trajectories, a worker that evicted prefixes made ~1 per turn
            # and 5-15k cyclic objects per collection). Without the future the error is freed
            # as soon as its handler drops it.
            del fut

    def _expire(self, call_id: bytes, kind: str, timeout: float) -> None:
        fut = self._pending.pop(call_id, None)
        if fut is not None and not fut.done():
            self.num_timeouts += 1
            expired = self._expired
            if len(expired) >= LATE_REPLY_MEMORY:
                del expired[next(iter(expired))]
            expired[call_id] = None
            fut.set_exception(RemoteTimeoutError(
                f"{self.name}: no reply to {kind} within {timeout:.3g} s"))

    def _on_reply(self, parts: list[Part]) -> None:
        # Call ids are the 8 wire bytes themselves: no unpacking to match a reply. The pump
        # copies the first two frames (copy_parts=2), so the id is bytes.
        fut = self._pending.pop(cast(bytes, parts[0]), None)
        if fut is None:
            self._unmatched(parts)
            return
        if fut.done():  # cancelled, and its caller did not ``forget`` it
            return
        if len(parts) < 2:
            fut.set_exception(self._error_type(
                "bad_reply", f"{self.name}: reply without a body (1 frame)"))
            return
        try:
            reply = _reply_decoder.decode(parts[1])
        except msgspec.MsgspecError as exc:
            # ``bad_reply``, not ``bad_request``: the peer's answer is wrong, not our request
            fut.set_exception(self._error_type("bad_reply",
                                               f"{self.name}: undecodable reply: {exc}"))
            return
        if type(reply) is m.ErrorReply:
            err = self._error_type(reply.code, f"{self.name}: {reply.message}")
            err.fault = reply.fault
            fut.set_exception(err)
        else:
            fut.set_result((reply, parts[2:]))

    def _unmatched(self, parts: list[Part]) -> None:
        """A reply no pending call waits for: late (timed out: counted), to a forgotten
        (cancelled) call (ignored), or malformed (logged)."""
        if len(parts) < 2 or len(parts[0]) != _CALL_ID.size:
            log.warning("%s: dropped a malformed reply (%d frames)", self.name, len(parts))
        elif parts[0] in self._expired:  # a timed-out call's reply: late, not lost
            del self._expired[parts[0]]
            self.num_late_replies += 1
        elif parts[0] == _NO_CALL_ID:
            with contextlib.suppress(msgspec.MsgspecError):
                reply = _reply_decoder.decode(parts[1])
                if isinstance(reply, m.ErrorReply):
                    log.warning("%s: unmatched error reply: %s", self.name, reply.message)

    async def _heartbeat_loop(self) -> None:
        while self._dead is None:
            await asyncio.sleep(self._hb_interval)
            with contextlib.suppress(RemoteError, PeerDeadError):
                # Any reply refreshes the pump's last_received; the ping only guarantees
                # there is traffic.
                await self.call(m.Ping(), timeout_s=self._liveness)
            silent_s = time.monotonic() - self._pump.last_received
            if silent_s > self._liveness and self._dead is None:
                self._fail_all(
                    PeerDeadError(f"{self.name} ({self.address}) silent for {silent_s:.1f} s")
                )

    def _fail_all(self, exc: PeerDeadError) -> None:
        self._dead = exc
        self._deadlines.close()
        # Emptied in place: the deadline wheel reads this very table.
        pending = list(self._pending.values())
        self._pending.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(exc)

    def mark_dead(self, reason: str) -> None:
        """Declare the peer dead (e.g. its process exited): pending calls fail now."""
        if self._dead is None:
            self._fail_all(PeerDeadError(f"{self.name} ({self.address}): {reason}"))

    async def close(self) -> None:
        """Fail pending calls, stop background tasks and close the socket."""
        self.mark_dead("client closed")
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        self._pump.close()

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
