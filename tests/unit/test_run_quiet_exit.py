"""`rollart run` exits without nanobind's leak report: the controller freezes its start-up
objects (``gc.freeze``) and triton, imported with torch by transformers, reports every frozen
binding object still alive at exit unless they are unfrozen first."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

SCRIPT = """
import asyncio
import triton  # noqa: F401  (what transformers' torch import brings into the controller)
from rollart.launcher.run import _train

class FakeCluster:
    run_folder = None
    async def __aenter__(self): return self
    async def __aexit__(self, *exc): return False
    async def train(self, steps):
        return
        yield

class FakeProgress:
    def step(self, *a): pass
    def note(self, *a): pass

print("rc", asyncio.run(_train(FakeCluster(), 0, 1, FakeProgress())))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_run_loop_leaves_no_nanobind_leak_report() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "rc 0" in out.stdout, out.stderr
    assert "nanobind" not in out.stderr, out.stderr[:2000]
