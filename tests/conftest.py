"""Fixtures for every test: the session's run key; the ``bench`` mark.

Tests marked ``bench`` (a benchmark end to end at its ``--quick``-like size, where a smaller
check of the same code path runs in the tests session) run only with ``pytest --bench``, which
``nox -s bench_measured`` passes; without it they are skipped, saying so.

``run_key`` (session, autouse): a CURVE key pair made once per test session
(``rollart.transport.security.create_key_file``), also exported as ``$ROLLART_KEY_FILE`` so
every service process a test starts (``rollart.envhost.host``, ``rollart.inference.worker``,
``rollart.trainer.service``, ``rollart.sim.serve``) serves with authentication on, as a real run
does; clients pass ``auth=run_key``.

A hard per-test backstop: pytest-timeout (``timeout`` in pyproject.toml) fails a test stuck in
Python, but once it has fired nothing guards the rest of that test (a teardown waiting on a
dead process, a call stuck in C that never returns to Python). ``faulthandler`` arms a C-level
watchdog for every test; past ``timeout + BACKSTOP_GRACE_S`` it prints every thread's stack and
ends the session, so a hang shows where it is in the log instead of using up CI's time.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator

import pytest

from rollart.transport.security import KEY_FILE_ENV, RunKey, create_key_file, load_key_file


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench", action="store_true", default=False,
                     help="also run the tests marked bench (nox -s bench_measured)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--bench"):
        return
    skip = pytest.mark.skip(reason="marked bench: runs in nox -s bench_measured (pytest --bench)")
    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(skip)


#: Seconds past pytest-timeout's limit before the backstop ends the session.
BACKSTOP_GRACE_S = 300.0
_backstop_fd: int | None = None


def pytest_configure(config: pytest.Config) -> None:
    # A copy taken now still reaches the terminal: while a test runs, pytest's capture points
    # descriptor 2 at a temporary file, which is lost when the backstop ends the process.
    global _backstop_fd
    _backstop_fd = os.dup(sys.__stderr__.fileno())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    limit = float(item.config.getini("timeout") or 0)
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        limit = float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    if limit > 0 and _backstop_fd is not None:
        faulthandler.dump_traceback_later(limit + BACKSTOP_GRACE_S, exit=True, file=_backstop_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def run_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunKey]:
    key = load_key_file(create_key_file(tmp_path_factory.mktemp("run") / "keys"))
    before = os.environ.get(KEY_FILE_ENV)
    os.environ[KEY_FILE_ENV] = str(key.path)
    yield key
    if before is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = before
