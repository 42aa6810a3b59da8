"""The GRPO groups the controller admitted and still holds: each one's domain and env seed.

Every member of a group runs the same task (one env seed) of the same domain; the admission
loop adds a group when the buffer starts it, the trajectory tasks look its domain and seed up
for every member (first attempts, retries, restarts), and the group is forgotten when the
sample buffer forgets it (consumed or retired, no member live), so the table holds only groups
in flight. Group keys are ``g0``, ``g1``, ... in admission order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from rollart.config import DomainConfig
from rollart.transport.errors import RollartError


class AdmittedGroup(NamedTuple):
    """One admitted group: its domain and the env seed its members share."""

    domain: DomainConfig
    seed: int


class AdmittedGroups(Mapping[str, AdmittedGroup]):
    """Group key -> :class:`AdmittedGroup`, for the groups in flight, and the count of groups
    ever admitted (which names the next one).

    Args:
        domains: the scenario's domains by name (a restored group must name one of them).
    """

    def __init__(self, domains: Mapping[str, DomainConfig]) -> None:
        self._domains = domains
        self._groups: dict[str, AdmittedGroup] = {}
        self._started = 0

    def __getitem__(self, key: str) -> AdmittedGroup:
        return self._groups[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def started(self) -> int:
        """Groups admitted since the run began (a resumed run counts the checkpoint's)."""
        return self._started

    @property
    def next_key(self) -> str:
        """The key the next admitted group gets."""
        return f"g{self._started}"

    def add(self, key: str, domain: DomainConfig, seed: int) -> None:
        """Record group ``key`` (:attr:`next_key`) as admitted with ``domain`` and ``seed``."""
        self._groups[key] = AdmittedGroup(domain, seed)
        self._started += 1

    def forget(self, key: str) -> None:
        """The buffer forgot group ``key``; unknown keys are ignored."""
        self._groups.pop(key, None)

    def snapshot(self, keys: set[str]) -> dict[str, Any]:
        """The checkpoint's part: ``groups`` (key -> ``[domain name, seed]``, for ``keys``,
        the groups the buffer's snapshot holds) and ``group_seq`` (:attr:`started`)."""
        return {"groups": {k: [self._groups[k].domain.name, self._groups[k].seed]
                           for k in sorted(keys)},
                "group_seq": self._started}

    def restore(self, groups: Mapping[str, list[Any]], group_seq: int) -> None:
        """Continue from a :meth:`snapshot`'s ``groups`` and ``group_seq``.

        Raises:
            RollartError: a group of a domain the scenario lacks.
        """
        for key, (domain, seed) in groups.items():
            if domain not in self._domains:
                raise RollartError(f"controller snapshot: group {key!r} of unknown domain "
                                   f"{domain!r}")
            self._groups[key] = AdmittedGroup(self._domains[domain], seed)
        self._started = group_seq
