"""Process-tree helpers shared by the integration tests that check no process outlives a run."""

from __future__ import annotations

import os

from rollart.launcher.procs import proc_stat


def alive(pids: set[int]) -> set[int]:
    """The pids of ``pids`` that still run (zombies count as dead)."""
    out = set()
    for pid in pids:
        fields = proc_stat(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            out.add(pid)
    return out


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (not ``pid`` itself), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return alive(found)
