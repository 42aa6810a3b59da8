"""Fixtures for every test: the session's run key; the ``bench`` mark.

Tests marked ``bench`` (a benchmark end to end at its ``--quick``-like size, where a smaller
check of the same code path runs in the tests session) run only with ``pytest --bench``, which
``nox -s bench_measured`` passes; without it they are skipped, saying so.

``run_key`` (session, autouse): a CURVE key pair made once per test session
(``rollart.transport.security.create_key_file``), also exported as ``$ROLLART_KEY_FILE`` so
every service process a test starts (``rollart.envhost.host``, ``rollart.inference.worker``,
``rollart.trainer.service``, ``rollart.sim.serve``) serves with authentication on, as a real run
does; clients pass ``auth=run_key``.
"""

from __future__ import annotations

import os
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
