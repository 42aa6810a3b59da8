"""Token prefixes an inference worker keeps per trajectory, so each turn sends only new tokens.

A trajectory's next prompt is its previous prompt, the tokens generated for it, then the
observation tokens; the worker keeps the first two (int32 little-endian bytes) under the
trajectory id, and ``Generate`` carries only the rest (``prefix_len`` + ``new_token_ids``).

Memory is bounded by ``max_tokens`` held tokens (4 bytes each) over all trajectories AND by
``max_entries`` trajectories (each entry costs ~200 bytes besides its tokens, and a peer may name
any number of trajectory ids, each holding as little as one token), least recently used evicted
first. An entry is taken out while its request runs and put back (prompt +
generated tokens) only when the request finishes normally, so an aborted, failed or cancelled
turn leaves nothing behind; ``Generate.release`` drops finished trajectories' entries. A request
whose ``prefix_len`` does not match what is held fails with ``prefix_unknown`` and the caller
resends the whole prompt: eviction, a worker restart and re-routing all take that path.

Used by the vLLM worker (``rollart.inference.worker``) and the simulated one (``rollart.sim``).
"""

from __future__ import annotations

from collections import OrderedDict

from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError

#: default bound on held prefix tokens per worker: 16 Mi tokens = 64 MiB (512 trajectories
#: at 32k-token contexts)
DEFAULT_MAX_PREFIX_TOKENS = 1 << 24
#: default bound on held trajectories per worker: 64 Ki entries (~13 MiB of bookkeeping with
#: 256-character ids), far above one worker's concurrent trajectories at a 10k-trajectory scale
DEFAULT_MAX_PREFIX_ENTRIES = 1 << 16


class PrefixStore:
    """Held token prefixes by trajectory id, LRU-bounded.

    Args:
        max_tokens: bound on the tokens held over all trajectories (> 0); one prefix longer
            than that is not kept at all.
        max_entries: bound on the trajectories held (> 0).

    Attributes:
        num_tokens: tokens held now. ``hits`` / ``misses`` / ``evictions``: counts of requests
        resolved from a held prefix, requests failed with ``prefix_unknown``, entries evicted.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_PREFIX_TOKENS,
                 max_entries: int = DEFAULT_MAX_PREFIX_ENTRIES) -> None:
        if max_tokens <= 0:
            raise ValueError(f"PrefixStore: max_tokens must be > 0, got {max_tokens}")
        if max_entries <= 0:
            raise ValueError(f"PrefixStore: max_entries must be > 0, got {max_entries}")
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._held: OrderedDict[str, bytes] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._held

    def held_tokens(self, trajectory_id: str) -> int:
        """Tokens held for ``trajectory_id`` (0 if none)."""
        return len(self._held.get(trajectory_id, b"")) // 4

    def drop(self, trajectory_id: str) -> None:
        """Forget ``trajectory_id``'s prefix (unknown ids are fine)."""
        buf = self._held.pop(trajectory_id, None)
        if buf is not None:
            self.num_tokens -= len(buf) // 4

    def take_prompt(self, msg: m.Generate) -> bytes:
        """The whole prompt of ``msg`` (int32 bytes): held prefix + ``new_token_ids``.

        First drops the ids in ``msg.release``. The trajectory's entry is removed (``keep``
        puts the grown one back).

        Raises:
            RemoteError: ``bad_request`` (ragged ``new_token_ids``, an empty prompt, or
                ``prefix_len`` without a ``trajectory_id``); ``prefix_unknown`` (this worker does
                not hold exactly ``prefix_len`` tokens of the trajectory).
        """
        for tid in msg.release:
            self.drop(tid)
        rid, tid = msg.request_id, msg.trajectory_id
        try:
            num_new = tb.count(msg.new_token_ids, 4, "new_token_ids")
        except ValueError as exc:
            raise RemoteError("bad_request", f"request {rid!r}: {exc}") from None
        if msg.prefix_len and not tid:
            raise RemoteError("bad_request", f"request {rid!r}: prefix_len {msg.prefix_len} "
                              "needs a trajectory_id")
        held = self._held.pop(tid, None) if tid else None
        if held is not None:
            self.num_tokens -= len(held) // 4
        if msg.prefix_len == 0:
            prompt = bytes(msg.new_token_ids)
        elif held is not None and len(held) == 4 * msg.prefix_len:
            self.hits += 1
            prompt = held + msg.new_token_ids
        else:
            self.misses += 1
            have = "none" if held is None else f"{len(held) // 4}"
            raise RemoteError(
                "prefix_unknown",
                f"request {rid!r}: trajectory {tid!r} prefix of {msg.prefix_len} tokens not "
                f"held here (holding {have}); resend the whole prompt",
            )
        if msg.prefix_len + num_new == 0:
            raise RemoteError("bad_request", f"request {rid!r}: the prompt is empty")
        return prompt

    def keep(self, trajectory_id: str, prompt: bytes, generated: bytes) -> None:
        """Hold ``prompt`` + ``generated`` (int32 bytes) as ``trajectory_id``'s prefix, evicting
        the least recently used prefixes beyond ``max_tokens`` or ``max_entries``. No-op for an
        empty id."""
        if not trajectory_id:
            return
        self.drop(trajectory_id)
        buf = prompt + generated
        n = len(buf) // 4
        if n > self.max_tokens:
            return
        while self.num_tokens + n > self.max_tokens or len(self._held) >= self.max_entries:
            _, old = self._held.popitem(last=False)
            self.num_tokens -= len(old) // 4
            self.evictions += 1
        self._held[trajectory_id] = buf
        self.num_tokens += n
