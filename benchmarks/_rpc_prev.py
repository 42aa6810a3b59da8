"""BASELINE for ``benchmarks.rpc_overhead`` only: the RPC client path as it was on ``main`` at
commit bdb946e, before this change (``rollart/transport/zmqloop.py`` whole, ``RpcClient`` from
``rollart/transport/rpc.py`` and ``EnvClient`` from ``rollart/envhost/client.py``), vendored
verbatim (module docstrings and the unused ``RpcServer`` left out) so the comparison survives the
merge. It speaks the same wire format as today's ``RpcServer``. Not used by rollart.
"""

# ruff: noqa
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from rollart.transport import messages as m
from rollart.transport.errors import (EnvError, PeerDeadError, RemoteError,
                                      RemoteTimeoutError)
from rollart.transport.security import Auth

log = logging.getLogger(__name__)

Buffers = Sequence[bytes | memoryview]

# ---------------------------------------------------------------- transport/zmqloop.py


Part = bytes | memoryview
#: (parts, number of RPC messages in them, error) -> True to keep the message queued and retry
#: it later, False to drop it.
SendErrorHandler = Callable[[Sequence[Part], int, zmq.ZMQError], bool]
#: (route parts (the ROUTER identity, or none), what is wrong) for a batch envelope whose blob
#: cannot be unpacked (from the broken entry on; the entries before it were delivered).
BadBatchHandler = Callable[[list[Part], str], None]

#: ZeroMQ messages (a batch counts once) received per wake-up before the pump yields to other
#: callbacks (it reschedules itself), so a flood of requests cannot starve the loop's timers.
RECV_BUDGET = 256

#: Bodies up to this size travel in batches (copied once into the blob); larger ones, and any
#: message with extra (tensor) frames, travel alone and zero-copy.
BATCH_BODY_BYTES = 64 * 1024
#: A batch closes at about this many bytes and the next one starts.
BATCH_BYTES = 1 << 20

#: Parts at least this large are sent zero-copy (pyzmq's own copy_threshold default); smaller
#: ones are copied, which is cheaper than the Frame object zero-copy needs.
_ZERO_COPY_BYTES = 64 * 1024

_LEN = struct.Struct(">I")
_ENTRY_HEAD = _LEN.size + 8  # body length + call id
#: Largest frame a batch envelope can be: a batch closes once it reaches ``BATCH_BYTES``, so
#: its last entry (header + a body of at most ``BATCH_BODY_BYTES``) ends below this. A
#: receiving socket's ``MAXMSGSIZE`` must not be smaller.
MAX_BATCH_FRAME_BYTES = BATCH_BYTES + _ENTRY_HEAD + BATCH_BODY_BYTES

# Plain ints: pyzmq's flag constants are enum members, and enum arithmetic per frame costs.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_MORE_NOBLOCK = _NOBLOCK | _SNDMORE
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)


class SocketPump:
    """Receives and sends the multipart messages of one socket on the running loop.

    Args:
        sock: a plain ``zmq.Socket`` (not ``zmq.asyncio``); the pump owns it from now on and
            closes it in ``close()``.
        on_message: called with each received message's parts: the first ``copy_parts`` parts
            as ``bytes``, later ones as zero-copy ``memoryview`` (tensor frames). It must not
            block; an exception it raises is logged and fails that message only.
        copy_parts: how many leading parts are small enough to copy (identity, call id, body).
        on_send_error: decides the fate of a message whose send raised ``ZMQError`` other than
            ``EAGAIN`` (a full pipe, which always keeps the message queued); default: log, drop.
        on_bad_batch: told of a batch envelope that is empty or whose entry is truncated (its
            declared body length runs past the blob), with a reason naming the entry and byte
            offset; default: log. A server answers it with an error reply.
        name: for logs.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        on_message: Callable[[list[Part]], None],
        *,
        copy_parts: int,
        on_send_error: SendErrorHandler | None = None,
        on_bad_batch: BadBatchHandler | None = None,
        name: str = "",
    ) -> None:
        self._sock = sock
        self._on_message = on_message
        self._copy_parts = copy_parts
        self._on_send_error = on_send_error or self._log_send_error
        self._on_bad_batch = on_bad_batch or self._log_bad_batch
        self.name = name
        self._loop = asyncio.get_running_loop()
        # ZeroMQ messages ready to send, each with the number of RPC messages it carries.
        self._out: deque[tuple[Sequence[Part], int]] = deque()
        # This tick's small messages per route (the ROUTER identity; None for a DEALER).
        self._batches: dict[Part | None, list[Sequence[Part]]] = {}
        self._scheduled = False
        self._closed = False
        self.receiving = True
        self._is_router = sock.socket_type == zmq.ROUTER
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._pump)
        # Messages may have arrived before the reader was registered: look once.
        self._schedule()

    def send(self, parts: Sequence[Part]) -> None:
        """Queue one message ``[route (ROUTER only), call id, body, *frames]``; it leaves in this
        loop tick's flush, never dropped for a full pipe (``EAGAIN`` keeps it queued until the
        socket can take it)."""
        if self._closed:
            return
        head = self._copy_parts
        if len(parts) == head and len(parts[head - 1]) <= BATCH_BODY_BYTES:
            route = parts[0] if head == 3 else None
            batch = self._batches.get(route)
            if batch is None:
                self._batches[route] = [parts]
            else:
                batch.append(parts)
        else:
            self._out.append((parts, 1))
        if not self._scheduled:
            self._schedule()

    @property
    def queued(self) -> int:
        """ZeroMQ messages waiting in the pump's own queue (not yet handed to ZeroMQ)."""
        return len(self._out) + len(self._batches)

    def _seal_batches(self) -> None:
        """Turn this tick's small messages into one ZeroMQ message per route."""
        out = self._out
        for route, batch in self._batches.items():
            if len(batch) == 1:
                out.append((batch[0], 1))
                continue
            prefix = [] if route is None else [route]
            chunks: list[Part] = []
            size = count = 0
            for parts in batch:
                body = parts[-1]
                chunks += (_LEN.pack(len(body)), parts[-2], body)
                size += _ENTRY_HEAD + len(body)
                count += 1
                if size >= BATCH_BYTES:
                    out.append(([*prefix, b"", b"".join(chunks)], count))
                    chunks, size, count = [], 0, 0
            if chunks:
                out.append(([*prefix, b"", b"".join(chunks)], count))
        self._batches.clear()

    def _schedule(self) -> None:
        self._scheduled = True
        self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self._sock
        try:
            while True:
                if self._batches:
                    self._seal_batches()
                progressed = self._flush() if self._out else False
                events = -1
                if self.receiving:
                    got, events = self._drain()
                    if got >= RECV_BUDGET:
                        # More may be waiting: let other callbacks run first, come back soon.
                        if not self._scheduled:
                            self._schedule()
                        return
                    progressed = progressed or got > 0
                # Reading EVENTS re-arms the edge-triggered descriptor: anything that changes
                # after this read wakes the reader; anything already pending is handled here.
                # The drain's last read is one (nothing touched the socket since).
                if events < 0:
                    events = sock.getsockopt(_EVENTS)
                if events & _POLLIN and self.receiving:
                    continue
                if events & _POLLOUT and self._out:
                    if progressed:
                        continue
                    # Writable, yet the last attempt got EAGAIN (a ROUTER reports writable when
                    # any one peer is): retry next tick rather than spin here.
                    if not self._scheduled:
                        self._schedule()
                return
        except zmq.ZMQError as exc:
            if self._closed or exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                return
            raise

    def _drain(self) -> tuple[int, int]:
        """Receive and handle up to ``RECV_BUDGET`` messages: (how many, the socket's EVENTS
        as last read, -1 if not read after the last receive)."""
        sock = self._sock
        handle = self._on_message
        ncopy = self._copy_parts
        n = 0
        events = -1
        while n < RECV_BUDGET:
            # Asking first costs less than the zmq.Again exception an empty recv raises.
            events = sock.getsockopt(_EVENTS)
            if not events & _POLLIN:
                break
            try:
                # A Frame's ``more`` costs less than getsockopt(RCVMORE), whose option enum
                # conversion costs ~1 us a call: the copied parts are read from Frames too.
                frame = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                events = -1
                break
            events = -1
            n += 1
            parts: list[Part] = [frame.bytes]
            # The remaining parts of a multipart message arrive with the first (atomic).
            while frame.more:
                frame = sock.recv(_NOBLOCK, copy=False)
                parts.append(frame.bytes if len(parts) < ncopy else frame.buffer)
            try:
                if len(parts) == ncopy and len(parts[-2]) == 0:
                    self._unbatch(parts)
                else:
                    handle(parts)
            except Exception:  # one bad message must not stop the pump
                log.exception("%s: handling a received message failed", self.name)
        return n, events

    def _unbatch(self, parts: list[Part]) -> None:
        handle = self._on_message
        prefix = parts[:-2]
        blob = parts[-1]
        pos, end = 0, len(blob)
        if end == 0:
            self._on_bad_batch(prefix, "empty batch envelope: the blob after the empty frame "
                               "holds no (length u32, call id u64, body) entry")
            return
        index = 0
        while pos < end:
            left = end - pos
            if left < _ENTRY_HEAD:
                self._on_bad_batch(prefix, f"truncated batch envelope: entry {index} at byte "
                                   f"{pos} has {left} bytes, less than its 12-byte header")
                return
            length = _LEN.unpack_from(blob, pos)[0]
            body_end = pos + _ENTRY_HEAD + length
            if body_end > end:
                self._on_bad_batch(prefix, f"truncated batch envelope: entry {index} at byte "
                                   f"{pos} declares a {length}-byte body but only "
                                   f"{left - _ENTRY_HEAD} bytes follow its header")
                return
            handle([*prefix, blob[pos + _LEN.size:pos + _ENTRY_HEAD],
                    blob[pos + _ENTRY_HEAD:body_end]])
            pos = body_end
            index += 1

    def _log_bad_batch(self, prefix: list[Part], reason: str) -> None:
        log.warning("%s: dropped the rest of a received batch: %s", self.name, reason)

    def _flush(self) -> bool:
        """Send queued messages; True if at least one left."""
        sock = self._sock
        out = self._out
        held: list[tuple[Sequence[Part], int]] = []
        sent = False
        while out:
            item = out.popleft()
            parts = item[0]
            last = len(parts) - 1
            try:
                # A pipe's high-water mark is checked on a message's first part only, so a
                # message is either refused whole (EAGAIN / EHOSTUNREACH here) or sent whole.
                for i in range(last):
                    part = parts[i]
                    sock.send(part, _MORE_NOBLOCK, copy=len(part) < _ZERO_COPY_BYTES)
                part = parts[last]
                sock.send(part, _NOBLOCK, copy=len(part) < _ZERO_COPY_BYTES)
                sent = True
            except zmq.Again:
                held.append(item)
                if not self._is_router:
                    break  # one pipe for every message: all the rest would block too
                # ROUTER: only this peer's pipe is full; others may still take theirs.
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    raise
                if self._on_send_error(parts, item[1], exc):
                    held.append(item)
        if held:
            out.extendleft(reversed(held))
        return sent

    def _log_send_error(self, parts: Sequence[Part], count: int, exc: zmq.ZMQError) -> bool:
        log.warning("%s: %d message(s) not sent: %s", self.name, count, exc)
        return False

    def close(self) -> None:
        """Stop reading, drop what is still queued and close the socket (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._out.clear()
        self._batches.clear()
        self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)

# ---------------------------------------------------------------- transport/rpc.py

_CALL_ID = struct.Struct(">Q")
_NO_CALL_ID = _CALL_ID.pack(0)
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(m.Request)
_reply_decoder = msgspec.msgpack.Decoder(m.Reply)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31

#: SNDHWM and RCVHWM of every RPC socket: 0 = no limit. ZeroMQ's answer at a high-water mark
#: is to drop (ROUTER) or to refuse (DEALER), and RPC wants neither: every message in flight
#: is a request some caller awaits or the reply to one, so their number is already bounded by
#: the callers' own concurrency (trajectories, weight buckets), and a second, smaller bound
#: here only turns load into lost replies (issue 11: 10k outstanding calls against the
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

    Must be created on a running event loop. Requests are never dropped: they queue (in the
    client, then in ZeroMQ) until the server takes them, however many are outstanding.
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
    ) -> None:
        self.address = address
        self.name = name or address
        self.default_timeout_s = default_timeout_s
        self._loop = asyncio.get_running_loop()
        self._sock = _socket(zmq.DEALER)
        auth.secure_client(self._sock)
        self._sock.connect(address)
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._dead: PeerDeadError | None = None
        self._last_heard = time.monotonic()
        self._hb_interval = heartbeat_interval_s
        self._liveness = liveness_timeout_s
        self._pump = SocketPump(self._sock, self._on_reply, copy_parts=2, name=self.name)
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
        fut: asyncio.Future = self._loop.create_future()
        self._pending[call_id] = fut
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        # A timer handle, not asyncio.wait_for: wait_for costs a task per call on Python 3.11.
        timer = self._loop.call_later(timeout, self._expire, fut, msg, timeout)
        try:
            self._pump.send([_CALL_ID.pack(call_id), _encoder.encode(msg), *buffers])
            reply, frames = await fut
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)
        if isinstance(reply, m.ErrorReply):
            raise RemoteError(reply.code, f"{self.name}: {reply.message}")
        return reply, frames

    def _expire(self, fut: asyncio.Future, msg: m.Msg, timeout: float) -> None:
        if not fut.done():
            fut.set_exception(RemoteTimeoutError(
                f"{self.name}: no reply to {type(msg).__name__} within {timeout:.3g} s"))

    def _on_reply(self, parts: list[Part]) -> None:
        self._last_heard = time.monotonic()
        if len(parts) < 2 or len(parts[0]) != _CALL_ID.size:
            log.warning("%s: dropped a malformed reply (%d frames)", self.name, len(parts))
            return
        (call_id,) = _CALL_ID.unpack(parts[0])
        try:
            reply = _reply_decoder.decode(parts[1])
        except msgspec.MsgspecError as exc:
            # ``bad_reply``, not ``bad_request``: the peer's answer is wrong, not our request
            reply = m.ErrorReply(code="bad_reply", message=f"undecodable reply: {exc}")
        if call_id == 0 and isinstance(reply, m.ErrorReply):
            log.warning("%s: unmatched error reply: %s", self.name, reply.message)
        fut = self._pending.get(call_id)
        if fut is not None and not fut.done():
            fut.set_result((reply, parts[2:]))

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
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        self._pump.close()

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------- envhost/client.py

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
        )

    @property
    def dead(self) -> bool:
        """True once the host was declared dead (or the client closed)."""
        return self._rpc.dead

    def mark_dead(self, reason: str) -> None:
        """Declare the host dead (e.g. its process exited): pending calls fail now."""
        self._rpc.mark_dead(reason)

    async def _call(self, msg: m.Msg, timeout_s: float | None, expect: type[m.Msg] = m.Ack) -> Any:
        try:
            reply, _frames = await self._rpc.call(msg, timeout_s=timeout_s)
        except RemoteTimeoutError:
            raise
        except RemoteError as exc:
            # The message already names the host (RpcClient prefixes it).
            raise EnvError(exc.code, exc.message) from None
        if not isinstance(reply, expect):
            raise EnvError(
                "internal",
                f"{self.name}: expected {expect.__name__} in reply to {type(msg).__name__}, "
                f"got {type(reply).__name__}",
            )
        return reply

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
        return await self._call(
            m.EnvOpen(env_name=env_name, seed=seed, options=dict(options or {})),
            timeout_s,
            m.EnvOpened,
        )

    async def step(
        self, session_id: str, action: str, *, timeout_s: float | None = None
    ) -> m.EnvStepResult:
        """Apply ``action`` (text) to a session. Raises ``EnvError`` (see the class docstring);
        after ``env_error`` / ``env_timeout`` the session is gone."""
        return await self._call(
            m.EnvStep(session_id=session_id, action=action), timeout_s, m.EnvStepResult
        )

    async def close_session(self, session_id: str, *, timeout_s: float | None = None) -> None:
        """Close a session and release its env. Closing a session that already failed or was
        closed is a no-op; an id the host never issued raises ``EnvError(not_found)``."""
        await self._call(m.EnvClose(session_id=session_id), timeout_s)

    async def stats(self, *, timeout_s: float | None = None) -> m.EnvHostStats:
        """The host's open sessions, steps and env failures."""
        return await self._call(m.GetEnvStats(), timeout_s, m.EnvHostStats)

    async def close(self) -> None:
        """Close the connection (not the host); later calls raise ``PeerDeadError``."""
        await self._rpc.close()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
