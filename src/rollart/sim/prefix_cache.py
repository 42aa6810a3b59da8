"""SIMULATED prefix cache of one engine: finished sequences whose KV stays in the engine's KV
pool until running requests need the room (vLLM's automatic prefix caching keeps freed blocks
as cache and evicts them least-recently-used).

Only token counts are kept. Sequences are int32 token bytes (``rollart.transport.tokenbytes``;
a list of ints is packed first). Entries are keyed by ``(head, length, digest)``: ``head``
hashes the first ``HEAD`` tokens' bytes, so a lookup hashes whole prefixes only for the few
entries that start like the prompt; hashing bytes, not tuples of ints, keeps a 32k-token
prefix's digest at tens of microseconds. Which entry a lookup returns (the longest cached
prefix) and the eviction order (LRU) do not depend on the hash values, barring a 64-bit
collision. Capacity is the caller's: ``evict_for`` frees entries until the running
requests' tokens plus the cache fit a pool of ``capacity`` tokens.
"""

from __future__ import annotations

import collections
from typing import Any

from rollart.transport import tokenbytes as tb

HEAD = 16
_HEAD_BYTES = 4 * HEAD

Key = tuple[int, int, int]


class PrefixCache:
    """LRU set of cached token sequences (SIMULATED; counts only).

    Attributes: ``tokens`` (tokens held), ``evicted_tokens`` (tokens evicted so far).
    """

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[Key, int] = collections.OrderedDict()
        self._heads: dict[int, set[Key]] = {}
        self.tokens = 0
        self.evicted_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def length(self, key: Key) -> int:
        """Tokens of entry ``key``. Raises ``KeyError`` if it is not cached."""
        return self._entries[key]

    def clear(self) -> None:
        self._entries.clear()
        self._heads.clear()
        self.tokens = 0

    def add(self, seq: bytes | list[int]) -> None:
        """Cache ``seq`` (int32 token bytes or a list of ids; or mark it recently used if it
        is cached already)."""
        raw = _as_bytes(seq)
        head = hash(raw[:_HEAD_BYTES])
        n = len(raw) // 4
        key = (head, n, hash(raw))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = n
        self._heads.setdefault(head, set()).add(key)
        self.tokens += n

    def drop(self, key: Key) -> None:
        """Remove ``key`` (its blocks now belong to a running request, or are freed)."""
        n = self._entries.pop(key)
        self._heads[key[0]].discard(key)
        if not self._heads[key[0]]:
            del self._heads[key[0]]
        self.tokens -= n

    def evict_for(self, running_tokens: float, capacity: int, keep: Key | None = None) -> bool:
        """Evict least-recently-used entries (never ``keep``) until ``running_tokens`` plus the
        cache fit ``capacity``; False when they cannot."""
        while running_tokens + self.tokens > capacity and self._entries:
            key = next(iter(self._entries))
            if key == keep:
                # ``lookup`` made ``keep`` the most recently used, so it is the last one left.
                break
            self.evicted_tokens += self._entries[key]
            self.drop(key)
        return running_tokens + self.tokens <= capacity

    def lookup(self, prompt: bytes | list[int]) -> Key | None:
        """The longest cached sequence that is a prefix of ``prompt`` (int32 token bytes or a
        list of ids; marked recently used)."""
        raw = _as_bytes(prompt)
        view = memoryview(raw)
        best = None
        for key in self._heads.get(hash(raw[:_HEAD_BYTES]), ()):
            _, length, digest = key
            # A read-only byte memoryview hashes as the bytes it shows, without a copy.
            if (best is None or length > best[1]) and 4 * length <= len(raw) \
                    and hash(view[:4 * length]) == digest:
                best = key
        if best is not None:
            self._entries.move_to_end(best)
        return best


def _as_bytes(seq: Any) -> bytes:
    return seq if isinstance(seq, bytes) else tb.pack_i32(seq)
