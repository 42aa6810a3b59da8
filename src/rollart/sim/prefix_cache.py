"""SIMULATED prefix cache of one engine: finished sequences whose KV stays in the engine's KV
pool until running requests need the room (vLLM's automatic prefix caching keeps freed blocks
as cache and evicts them least-recently-used).

Only token counts are kept. Entries are keyed by ``(head, length, digest)``: ``head`` hashes
the first ``HEAD`` tokens, so a lookup hashes whole prefixes only for the few entries that start
like the prompt. Capacity is the caller's: ``evict_for`` frees entries until the running
requests' tokens plus the cache fit a pool of ``capacity`` tokens.
"""

from __future__ import annotations

import collections

HEAD = 16

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

    def add(self, seq: list[int]) -> None:
        """Cache ``seq`` (or mark it recently used if it is cached already)."""
        head = hash(tuple(seq[:HEAD]))
        key = (head, len(seq), hash(tuple(seq)))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = len(seq)
        self._heads.setdefault(head, set()).add(key)
        self.tokens += len(seq)

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

    def lookup(self, prompt: list[int]) -> Key | None:
        """The longest cached sequence that is a prefix of ``prompt`` (marked recently used)."""
        best = None
        for key in self._heads.get(hash(tuple(prompt[:HEAD])), ()):
            _, length, digest = key
            if (best is None or length > best[1]) and length <= len(prompt) \
                    and hash(tuple(prompt[:length])) == digest:
                best = key
        if best is not None:
            self._entries.move_to_end(best)
        return best
