"""One plain (non-asyncio) ZeroMQ socket driven by an asyncio event loop, in bulk.

pyzmq's ``zmq.asyncio`` layer costs a future, a poller registration and enum arithmetic per
``recv_multipart`` / ``send_multipart``: ~100 us per RPC on the dev machine. A
``SocketPump`` instead registers the socket's notification file descriptor with
``loop.add_reader`` and, each time it fires, receives every waiting message with ``NOBLOCK`` (up
to ``RECV_BUDGET``, then yields the loop) and hands each to a plain callback; outgoing messages go
to a queue flushed once per loop tick (one ``call_soon`` however many messages were queued in the
tick). Works on any loop with ``add_reader`` (tested on uvloop and the default selector loop).

Small messages (no extra frames, body up to ``BATCH_BODY_BYTES``) queued in one tick for the same
peer leave as ONE ZeroMQ message, a batch envelope: ``[route?, b"", blob]`` where ``blob`` repeats
``(body length u32 big-endian, call id 8 bytes, body)``; a lone message keeps its plain form
``[route?, call id, body, *frames]`` (the empty frame where the 8-byte call id would be is what
marks a batch). Each ZeroMQ message sent from the loop thread can wake ZeroMQ's I/O thread, and
on a busy machine each wake-up is a context switch: one message per peer per tick pays it once
for the whole tick, as the physical floor's one ``write`` per tick does. The receiving pump
unpacks batches, so ``on_message`` always sees plain messages.

The ZeroMQ file descriptor is edge-triggered and signals only that the socket's state *may*
have changed: after every batch of sends and receives the pump reads ``zmq.EVENTS`` (which also
re-arms the descriptor) and goes round again while input is waiting, so a message that arrived
during a send is never left unread with no wake-up to come (the classic hang with this API).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq
from zmq.backend import zmq_poll

log = logging.getLogger(__name__)

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
#: ones are copied, which is cheaper than the Frame object zero-copy needs. Kept by measurement
#: (``benchmarks.rpc_overhead``, part ``send``, dev machine 2026-12-01): a zero-copy send's
#: ``Frame`` is released through pyzmq's garbage-collector thread (an inproc message and the
#: GIL per send), yet from 64 KiB up it costs the loop thread and the whole process no more
#: CPU per MB than copying the part into ZeroMQ (zero-copy / copy: 0.55x / 0.81x at 64 KiB,
#: 0.03x / 0.43x at 1 MiB: a batch envelope, already joined once, is not worth a second copy).
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
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_POLLINOUT = _POLLIN | _POLLOUT


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
        #: ``time.monotonic()`` when a message was last received (read once per wake-up that
        #: received any, not per message); the pump's creation time before the first.
        self.last_received = time.monotonic()
        self._is_router = sock.socket_type == zmq.ROUTER
        self._fd = int(sock.getsockopt(zmq.FD))  # typed int | bytes: FD is an int option
        # The socket's EVENTS are read with a zero-timeout ``zmq_poll`` on it (which reads
        # ZMQ_EVENTS inside libzmq, re-arming the descriptor the same way): pyzmq's
        # ``getsockopt`` converts the option to its enum on every call, which cost ~1.5 us
        # more per read on the dev machine (``benchmarks.rpc_overhead``'s ``events`` rows).
        self._poll_items = [(sock, _POLLINOUT)]
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
                    ready = zmq_poll(self._poll_items, 0)
                    events = ready[0][1] if ready else 0
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
            if not self._gone(exc):
                raise

    def drain_now(self) -> int:
        """Receive and handle every message waiting now, without the pump's per-wake-up
        budget: a client calls it before expiring deadlines, so a reply that arrived is not
        timed out because the loop was late to read it. Returns how many were received."""
        if self._closed or not self.receiving:
            return 0
        total = 0
        try:
            while True:
                got, _ = self._drain()
                total += got
                if got < RECV_BUDGET:
                    return total
        except zmq.ZMQError as exc:
            if not self._gone(exc):
                raise
            return total

    def _gone(self, exc: zmq.ZMQError) -> bool:
        """The socket was closed under a send or receive (the pump's close, the context's end):
        nothing more to do, not an error."""
        return self._closed or exc.errno in (zmq.ETERM, zmq.ENOTSOCK)

    def _drain(self) -> tuple[int, int]:
        """Receive and handle up to ``RECV_BUDGET`` messages: (how many, the socket's EVENTS
        as last read, -1 if not read after the last receive)."""
        sock = self._sock
        handle = self._on_message
        ncopy = self._copy_parts
        items = self._poll_items
        n = 0
        events = -1
        while n < RECV_BUDGET:
            # Asking first costs less than the zmq.Again exception an empty recv raises.
            ready = zmq_poll(items, 0)
            events = ready[0][1] if ready else 0
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
        if n:
            self.last_received = time.monotonic()
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
