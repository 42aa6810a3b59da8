"""Old code for a before/after benchmark, read from a git ref instead of a vendored copy.

A benchmark that compares today's code with an earlier version of a few modules names them
with a ``Baseline`` (module name -> path in the repository) and a default ref; ``extract``
writes ``git show REF:PATH`` of each into a temporary package and returns a ``Checkout`` whose
``module(name)`` imports it. Imports between the extracted modules are pointed at the package
(``from rollart.transport.zmqloop import ...`` becomes ``from <package>.zmqloop import ...``);
every other import (``rollart.transport.messages``, ``errors``, ``security``) stays on this
tree, so the old code speaks today's wire format to today's peers, which is what the
benchmarks compare.

When the old code cannot be had (no ``git``, not a git checkout, a shallow clone without the
ref, a path the ref lacks, a module that no longer imports against this tree) ``extract``
raises ``BaselineUnavailable`` with the reason; the benchmarks print it and skip that
comparison only.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


class BaselineUnavailable(RuntimeError):
    """The baseline's code could not be read from git or imported; the message says why."""


class _NoGit(BaselineUnavailable):
    pass


@dataclass(frozen=True)
class Baseline:
    """Modules of an earlier version: ``modules`` maps a short name to a path in the
    repository (``src/rollart/...py``); ``ref`` is the commit measured when none is given."""

    ref: str
    modules: dict[str, str]
    #: what the ref is, for messages and the JSON's ``meta``
    what: str


def _dotted(path: str) -> str:
    """``src/rollart/transport/rpc.py`` -> ``rollart.transport.rpc``."""
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def _git(*args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False)
    except FileNotFoundError as e:
        raise _NoGit("git is not installed (it reads the baseline's code)") from e
    if proc.returncode != 0:
        raise BaselineUnavailable(
            f"git {' '.join(args)}: {proc.stderr.strip() or f'exit status {proc.returncode}'}")
    return proc.stdout


def resolve(ref: str) -> str:
    """The full commit id of ``ref``; ``BaselineUnavailable`` if git or the ref is missing
    (a shallow clone lacks old commits: ``git fetch --unshallow`` brings them)."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").strip()
    except _NoGit:
        raise
    except BaselineUnavailable as e:
        raise BaselineUnavailable(
            f"git ref {ref!r} is not a commit of the repository at {ROOT} (a shallow clone "
            f"lacks old commits: `git fetch --unshallow` brings them)") from e


@dataclass
class Checkout:
    """Extracted modules of one ref: ``directory`` goes on ``sys.path`` (here or in a child
    process, see ``add_to_path``), ``package`` is the importable package name."""

    ref: str
    commit: str
    directory: Path
    package: str

    def module(self, name: str) -> ModuleType:
        """Import the extracted module ``name`` (a key of the baseline's ``modules``)."""
        add_to_path(self.directory)
        try:
            return importlib.import_module(f"{self.package}.{name}")
        except Exception as e:  # an old module that no longer fits this tree
            raise BaselineUnavailable(
                f"{name} at {self.ref} does not import against this tree: "
                f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Remove the files and forget the imported modules."""
        for key in [k for k in sys.modules if k == self.package
                    or k.startswith(f"{self.package}.")]:
            del sys.modules[key]
        if str(self.directory) in sys.path:
            sys.path.remove(str(self.directory))
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Checkout:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def add_to_path(directory: Path) -> None:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


def extract(baseline: Baseline, ref: str | None = None) -> Checkout:
    """Write ``baseline``'s modules at ``ref`` (default ``baseline.ref``) into a new temporary
    package. Raises ``BaselineUnavailable`` (reason in the message) when git, the ref or a path
    is missing."""
    ref = ref or baseline.ref
    commit = resolve(ref)
    directory = Path(tempfile.mkdtemp(prefix="rollart-baseline-"))
    # unique per extraction: two checkouts of one commit may hold different modules
    package = f"rollart_at_{commit[:12]}_{directory.name.removeprefix('rollart-baseline-')}"
    try:
        (directory / package).mkdir()
        (directory / package / "__init__.py").write_text(
            f'"""{baseline.what}: modules of git {commit}."""\n')
        renames = {_dotted(path): f"{package}.{name}" for name, path in baseline.modules.items()}
        names = "|".join(map(re.escape, renames))
        pattern = re.compile(rf"^(\s*from\s+)({names})(\s+import\b)", re.MULTILINE)
        for name, path in baseline.modules.items():
            source = _git("show", f"{commit}:{path}")
            source = pattern.sub(lambda mt: mt[1] + renames[mt[2]] + mt[3], source)
            (directory / package / f"{name}.py").write_text(source)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return Checkout(ref=ref, commit=commit, directory=directory, package=package)
