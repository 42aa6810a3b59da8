"""Process-tree helpers shared by the integration tests that check no process outlives a run."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def processes_mentioning(text: str) -> list[str]:
    """``"pid: cmdline"`` of every other process whose command line contains ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def assert_no_process_mentions(out: Path, timeout_s: float = 30.0) -> None:
    """No process names `out` (a run's children exit as the launcher returns: polled)."""
    deadline = time.monotonic() + timeout_s
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(out)) == []
