"""Local rewards and envs from the operator's own Python file, for ``rollart run`` and
``open_cluster`` alike.

A scenario's ``run.local_module = "task.py"`` names a Python file (relative paths are resolved
against the scenario file's directory; a ``Scenario`` built in code resolves them against
``scenario_dir`` or the working directory). ``rollart run`` and ``rollart.open_cluster`` import
it once in the controller's process, before any service starts, and register its module-level
dicts exactly as ``open_cluster(rewards=..., envs=...)`` would::

    # task.py
    class Echo:                      # the env contract: README "Your own envs, ..."
        def reset(self, seed): ...
        def step(self, action): ...

    def contains_reference(prompt, response, reference, metadata):
        return float(reference in response)

    REWARDS = {"contains_reference": contains_reference}   # domains with reward_url = "local"
    ENVS = {"script:echo": Echo}                           # domains with env = "script:echo"

The file's folder is put first on ``sys.path`` before it runs (as ``python task.py`` would
do), so it can import the modules beside it (``from helpers import ...``).

A driver script can import the same file and pass ``REWARDS`` / ``ENVS`` itself; a name given
both ways is refused (which one would run would be a guess).

Security: the file is chosen by the scenario, the operator's own configuration (like
``reward.modules`` or the env host's ``--allow-env`` list), never by a client of any service:
no request can name code to import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from rollart.config import Scenario
from rollart.transport.errors import ConfigError

FIELD = "run.local_module"

# One import per file and process: ``rollart run`` checks the names before any service starts
# and ``open_cluster`` registers them; importing twice would run the file's top level twice.
_LOADED: dict[Path, ModuleType] = {}


@dataclass(frozen=True)
class LocalRegistrations:
    """What ``run.local_module`` registers: reward functions by reward name, env factories by
    env name (empty when the scenario names no module); ``path``: the file, resolved."""

    rewards: dict[str, Callable[..., Any]] = field(default_factory=dict)
    envs: dict[str, Callable[..., Any]] = field(default_factory=dict)
    path: Path | None = None


def module_path(scenario: Scenario, scenario_dir: str | Path | None = None) -> Path | None:
    """The absolute path ``run.local_module`` names (``None``: none), relative paths taken
    from ``scenario_dir`` (default: the working directory)."""
    name = scenario.run.local_module
    if name is None:
        return None
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = Path(scenario_dir or Path.cwd()) / path
    return path.resolve()


def _import(path: Path, source: str) -> ModuleType:
    if path in _LOADED:
        return _LOADED[path]
    if not path.is_file():
        raise ConfigError(f"{source}: {FIELD}: {path} is not a file")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    name = f"_rollart_local_{path.stem if path.stem.isidentifier() else 'module'}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{source}: {FIELD}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as any import is (dataclasses and pickling look it up).
    sys.modules[name] = module
    # Its own folder first on sys.path, as `python task.py` has it: the file imports the
    # modules beside it (at its top or later, inside a function), not ones of the cwd.
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit() in the module: a named error too
        del sys.modules[name]
        if added:
            sys.path.remove(folder)
        raise ConfigError(f"{source}: {FIELD}: importing {path} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    _LOADED[path] = module
    return module


def _table(module: ModuleType, attr: str, path: Path, source: str) -> dict[str, Callable]:
    table = getattr(module, attr, None)
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {FIELD}: {path}: {attr} must be a dict of name -> "
                          f"callable, got {type(table).__name__}")
    for key, value in table.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{source}: {FIELD}: {path}: {attr} key {key!r} is not a "
                              "non-empty str")
        if not callable(value):
            raise ConfigError(f"{source}: {FIELD}: {path}: {attr}[{key!r}] is not callable "
                              f"({type(value).__name__})")
    return dict(table)


def load(scenario: Scenario, scenario_dir: str | Path | None = None,
         source: str = "<scenario>") -> LocalRegistrations:
    """Import ``run.local_module`` (once per process) and return its ``REWARDS`` / ``ENVS``.

    Raises:
        ConfigError: the file is missing or fails to import (the exception named), a table is
            not a dict of non-empty str -> callable, or the file defines neither table.
    """
    path = module_path(scenario, scenario_dir)
    if path is None:
        return LocalRegistrations()
    module = _import(path, source)
    rewards = _table(module, "REWARDS", path, source)
    envs = _table(module, "ENVS", path, source)
    if not rewards and not envs:
        raise ConfigError(f"{source}: {FIELD}: {path} defines no REWARDS or ENVS dict (name -> "
                          "reward function / env factory)")
    return LocalRegistrations(rewards, envs, path)


def merge(regs: LocalRegistrations, rewards: Mapping[str, Any] | None,
          envs: Mapping[str, Any] | None,
          source: str = "<scenario>") -> tuple[dict[str, Any], dict[str, Any]]:
    """The module's registrations plus a caller's ``rewards`` / ``envs``.

    Raises:
        ConfigError: a name registered by both (naming it and the file).
    """
    out: list[dict[str, Any]] = []
    for kind, mine, given in (("reward", regs.rewards, rewards), ("env", regs.envs, envs)):
        both = sorted(set(mine) & set(given or {}))
        if both:
            raise ConfigError(f"{source}: {FIELD}: {kind}s {both} are registered both by "
                              f"{regs.path} and by the caller (open_cluster({kind}s=...)); "
                              "keep one")
        out.append({**mine, **(given or {})})
    return out[0], out[1]
