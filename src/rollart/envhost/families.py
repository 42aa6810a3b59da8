"""Environment families behind one small synchronous adapter interface.

An env name is ``FAMILY:REST``:

- ``game:NAME`` — a GEM (``gem-llm``) game made with ``gem.make("game:NAME", **options)``, e.g.
  ``game:GuessTheNumber-v0-easy``. Actions are free text; GEM reads the last ``\\boxed{...}``.
- ``rg:DATASET`` — a reasoning-gym procedural dataset as a single-turn env (see
  ``ReasoningGymEnv`` for the seed -> entry mapping). Scored by the dataset's own
  ``score_answer``.
- ``py:package.module:Attr`` — a user env: ``Attr(**options)`` must return an object with
  ``reset(seed) -> (observation, info)`` and ``step(action) -> (observation, reward, terminated,
  truncated, info)``, and optionally ``close()``. ``step`` may raise
  ``rollart.transport.errors.InvalidActionError`` for a malformed action (e.g. broken tool-call
  JSON): the host replies ``invalid_action`` and the session stays open (a model-caused outcome
  the controller trains on, per the domain's ``invalid_action`` policy).

Every adapter is synchronous and may block; the host runs it in a worker thread, one call at a
time per session.
"""

from __future__ import annotations

import importlib
import inspect
import math
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from rollart.transport.errors import RollartError, did_you_mean

FAMILIES: dict[str, str] = {
    "game": "GEM games, e.g. game:GuessTheNumber-v0-easy",
    "rg": "reasoning-gym datasets as single-turn envs, e.g. rg:basic_arithmetic",
    "py": "user envs by import path, e.g. py:mypkg.envs:MyEnv",
}

#: env families whose episodes end after one turn, whatever ``max_turns`` says
SINGLE_TURN_FAMILIES = frozenset({"rg"})


def family_turn_cap(env: str) -> int | None:
    """The turns an episode of ``env`` (``FAMILY:NAME``) can last by its family: 1 for a
    single-turn family (``SINGLE_TURN_FAMILIES``), ``None`` when the env decides."""
    family, sep, _ = env.partition(":")
    return 1 if sep and family in SINGLE_TURN_FAMILIES else None


#: Appended to every reasoning-gym question: the env grades the last ``\boxed{}`` only.
RG_ANSWER_INSTRUCTION = (
    "\n\nPut your final answer inside \\boxed{}, for example \\boxed{42}; "
    "only the content of the last \\boxed{} is graded."
)


class EnvSpecError(RollartError, ValueError):
    """An env name or its options are invalid. ``code`` is the wire error code to reply with:
    ``not_found`` (unknown family / env / module) or ``bad_request`` (bad options, bad env
    object)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EnvContractError(RollartError):
    """An env returned something outside the reset/step contract (wrong shape, type, NaN
    reward). Fails that session like any other env error."""


StepResult = tuple[str, float, bool, bool, dict[str, Any]]


@runtime_checkable
class EnvAdapter(Protocol):
    """What the host calls. Observations are text; ``reward`` a finite float; info a plain dict
    (msgpack-encodable: str keys, builtin values)."""

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


def family_of(env_name: str) -> str:
    """The family prefix of ``env_name`` (``"game"``, ``"rg"``, ``"py"``).

    Raises:
        EnvSpecError: (``not_found``) the name has no known ``FAMILY:`` prefix.
    """
    family, sep, rest = env_name.partition(":")
    if not sep or family not in FAMILIES or not rest:
        known = "; ".join(f"{k}: {v}" for k, v in FAMILIES.items())
        raise EnvSpecError(
            "not_found",
            f"unknown env name {env_name!r}: expected FAMILY:NAME with a family of {known}",
        )
    return family


def check_env_name(env_name: str) -> None:
    """Check that ``env_name`` names an env an env host of this install can make, without
    making it: a known family, a registered GEM game (``game:``), an existing reasoning-gym
    dataset (``rg:``). A ``py:`` name is not imported here: the env host imports it, from its
    own path (and only if its allow list names it).

    Raises:
        EnvSpecError: (``not_found``) naming what is unknown and what is known.
    """
    family = family_of(env_name)
    if family == "game":
        _gem_spec(env_name)
    elif family == "rg":
        rg_config_fields(env_name.partition(":")[2])


def _import_gem() -> Any:
    """``import gem``, leaving the root logger as it was: gem's ``__init__`` calls
    ``logging.basicConfig(level=INFO)``, which would turn on every library's INFO lines in a
    driver script that configured no logging (``rollart run`` configures its own first)."""
    import logging
    import sys

    if "gem" in sys.modules:
        return sys.modules["gem"]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


def _gem_spec(env_name: str) -> Any:
    """GEM's registry entry of ``env_name``. Raises EnvSpecError (``not_found``)."""
    gem = _import_gem()
    registry = gem.envs.registration.ENV_REGISTRY
    spec = registry.get(env_name)
    if spec is None:
        games = sorted(k for k in registry if k.startswith("game:"))
        raise EnvSpecError(
            "not_found", f"unknown GEM env {env_name!r}{did_you_mean(env_name, games)}; "
            f"registered games: {', '.join(games)}")
    return spec


def make_env(env_name: str, options: Mapping[str, Any] | None = None) -> EnvAdapter:
    """Build (but do not reset) the adapter for ``env_name``.

    Raises:
        EnvSpecError: unknown family / env / module (``not_found``) or invalid ``options``
            (``bad_request``).
        Exception: whatever the env's own constructor raises (the host replies ``env_error``).
    """
    options = dict(options or {})
    family = family_of(env_name)
    if family == "game":
        return GemEnv(env_name, options)
    if family == "rg":
        return ReasoningGymEnv(env_name.partition(":")[2], options)
    return make_py_env(env_name.partition(":")[2], options)


# ------------------------------------------------------------------------------------------------
# Output validation shared by GEM and user envs
# ------------------------------------------------------------------------------------------------


def _plain_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    # info is diagnostic: an object msgpack cannot carry travels as its repr, not as an error
    return repr(obj)


def plain_info(info: Any, where: str) -> dict[str, Any]:
    """``info`` as a msgpack-encodable dict (numpy values unwrapped, other objects as repr).

    Raises:
        EnvContractError: ``info`` is not a mapping.
    """
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise EnvContractError(f"{where}: info must be a dict, got {type(info).__name__}")
    return msgspec.to_builtins(dict(info), enc_hook=_plain_hook, str_keys=True)


def check_reset(result: Any, where: str) -> tuple[str, dict[str, Any]]:
    """Validate a ``reset`` result ``(observation: str, info: dict)``.

    Raises:
        EnvContractError: wrong shape or types.
    """
    if not (isinstance(result, tuple) and len(result) == 2):
        raise EnvContractError(
            f"{where}.reset must return (observation, info), got {result!r:.200}"
        )
    obs, info = result
    if not isinstance(obs, str):
        raise EnvContractError(f"{where}.reset: observation must be str, got {type(obs).__name__}")
    return obs, plain_info(info, f"{where}.reset")


def check_step(result: Any, where: str) -> StepResult:
    """Validate a ``step`` result ``(observation, reward, terminated, truncated, info)``.

    Raises:
        EnvContractError: wrong shape or types, or a reward that is not a finite number (a failed
            env is an error, never a reward).
    """
    if not (isinstance(result, tuple) and len(result) == 5):
        raise EnvContractError(
            f"{where}.step must return (observation, reward, terminated, truncated, info), "
            f"got {result!r:.200}"
        )
    obs, reward, terminated, truncated, info = result
    if not isinstance(obs, str):
        raise EnvContractError(f"{where}.step: observation must be str, got {type(obs).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.number):
        raise EnvContractError(f"{where}.step: reward must be a number, got {reward!r:.100}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise EnvContractError(f"{where}.step: reward must be finite, got {reward}")
    for flag_name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | np.bool_):
            raise EnvContractError(f"{where}.step: {flag_name} must be bool, got {flag!r:.100}")
    return obs, reward, bool(terminated), bool(truncated), plain_info(info, f"{where}.step")


# ------------------------------------------------------------------------------------------------
# GEM games
# ------------------------------------------------------------------------------------------------

# GEM games draw from the process-global `random` / `np.random` (reset seeds them, some steps
# draw, e.g. Game2048's new tile). Each session keeps its own snapshot of both states and swaps
# it in under this lock, so concurrent sessions stay deterministic per (env, seed, actions).
_GLOBAL_RNG_LOCK = threading.Lock()


class GemEnv:
    """A GEM game. ``options`` override the registered constructor kwargs; only parameters the
    game's ``__init__`` names are accepted (GEM itself silently drops unknown ones).

    Observations include GEM's ``info["suffix"]`` (see ``_compose``). Seeds must be >= 0.
    Wordle and Hangman need NLTK's ``words`` corpus, which they try to download; offline and
    without it, opening them fails with ``env_error`` (LookupError naming the corpus).
    """

    def __init__(self, env_name: str, options: dict[str, Any]) -> None:
        gem = _import_gem()
        allowed = gem_option_names(env_name)
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise EnvSpecError(
                "bad_request",
                f"{env_name}: unknown option(s) {unknown}; accepted: {sorted(allowed)}",
            )
        self.name = env_name
        with _GLOBAL_RNG_LOCK:
            self._env = gem.make(env_name, **options)
        self._rng_state: tuple[Any, Any] | None = None

    def _call(self, fn: Callable[[], Any]) -> Any:
        with _GLOBAL_RNG_LOCK:
            if self._rng_state is not None:
                random.setstate(self._rng_state[0])
                np.random.set_state(self._rng_state[1])
            try:
                return fn()
            finally:
                self._rng_state = (random.getstate(), np.random.get_state())

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if seed < 0:
            raise EnvSpecError("bad_request", f"{self.name}: GEM seeds must be >= 0, got {seed}")
        obs, info = check_reset(self._call(lambda: self._env.reset(seed=seed)), self.name)
        return _compose(obs, info, done=False), info

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = check_step(
            self._call(lambda: self._env.step(action)), self.name
        )
        return (
            _compose(obs, info, done=terminated or truncated),
            reward,
            terminated,
            truncated,
            info,
        )

    def close(self) -> None:
        close = getattr(self._env, "close", None)
        if callable(close):
            close()


def _compose(obs: str, info: dict[str, Any], *, done: bool) -> str:
    """The turn's text as GEM's own ``ObservationWrapper`` shows it: ``info["prefix"]`` +
    observation + ``info["suffix"]`` (the suffix carries the current state, e.g. Sokoban's
    board, and the prompt for the next move). Both keys move from info into the text; the
    suffix is dropped once the episode is over (there is no next move)."""
    prefix = info.pop("prefix", "")
    suffix = info.pop("suffix", "")
    if suffix and not done:
        obs = (obs if not obs or obs.endswith("\n") else obs + "\n") + suffix
    return f"{prefix}{obs}"


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _named_params(cls_or_fn: Any) -> set[str]:
    params = inspect.signature(cls_or_fn).parameters.values()
    return {
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    }


def gem_option_names(env_name: str) -> set[str]:
    """The options GEM env ``env_name`` takes: its registered entry point's parameters, as
    ``GemEnv`` checks them. Raises EnvSpecError (``not_found``) for an unregistered name,
    ImportError without GEM."""
    entry_point = _gem_spec(env_name).entry_point
    return _named_params(_resolve(entry_point) if isinstance(entry_point, str) else entry_point)


# ------------------------------------------------------------------------------------------------
# reasoning-gym datasets
# ------------------------------------------------------------------------------------------------


def rg_config_fields(dataset: str) -> set[str]:
    """Config fields a reasoning-gym ``dataset`` accepts as options (``seed`` excluded).

    Raises:
        EnvSpecError: (``not_found``) unknown dataset.
    """
    import reasoning_gym

    registry = reasoning_gym.factory.DATASETS
    if dataset not in registry:
        names = [f"rg:{k}" for k in sorted(registry)]
        raise EnvSpecError(
            "not_found",
            f"unknown reasoning-gym dataset {dataset!r}{did_you_mean(f'rg:{dataset}', names)};"
            f" e.g. {', '.join(names[:12])}, ... ({len(names)} in all)",
        )
    return _named_params(registry[dataset][1]) - {"seed"}


def rg_dataset(dataset: str, seed: int, config: Mapping[str, Any] | None = None) -> Any:
    """The reasoning-gym dataset an ``rg:dataset`` session reset with ``seed`` draws from.

    Mapping: the session serves entry 0 (``rg_entry``) of ``reasoning_gym.create_dataset(dataset, seed=seed, **config)``. Datasets
    draw entry ``i`` from ``Random(dataset_seed + i)``, so distinct seeds give distinct,
    independent entries (drawing entry ``seed`` of a dataset seeded ``seed`` would make seeds
    ``s`` and ``s + size`` collide once indices wrap).

    Raises:
        EnvSpecError: unknown dataset (``not_found``); unknown config key, ``seed`` in config or a
            config the dataset's ``validate()`` rejects (``bad_request``).
    """
    import reasoning_gym

    config = dict(config or {})
    allowed = rg_config_fields(dataset)
    unknown = sorted(set(config) - allowed)
    if unknown:
        hint = " (the seed comes from EnvOpen.seed)" if "seed" in unknown else ""
        raise EnvSpecError(
            "bad_request",
            f"rg:{dataset}: unknown option(s) {unknown}{hint}; accepted: {sorted(allowed)}",
        )
    check_file_options(f"rg:{dataset}", config)
    try:
        ds = reasoning_gym.create_dataset(dataset, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as exc:
        raise EnvSpecError(
            "bad_request", f"rg:{dataset}: invalid options {config}: {type(exc).__name__}: {exc}"
        ) from None
    return ds


def check_file_options(where: str, config: Mapping[str, Any]) -> None:
    """Options naming a file (``spell_backward``'s ``data_file``) may name only a file of the
    package's own data directory: reasoning-gym joins the value to that directory, so an
    absolute path or ``..`` would read any file and show its words in the observations.

    Raises:
        EnvSpecError: (``bad_request``) such an option holding a path, not a bare file name.
    """
    for key, value in config.items():
        if not any(w in key for w in ("file", "path", "dir")):
            continue
        if not isinstance(value, str) or not value or value != PurePosixPath(value).name \
                or value.startswith(".") or "\\" in value:
            raise EnvSpecError(
                "bad_request",
                f"{where}: option {key}={value!r} refused: options naming files may only name "
                "a file of the dataset package's own data (a bare file name, no path)")


def rg_entry(dataset: str, seed: int, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Entry 0 of ``rg_dataset(dataset, seed, config)``: ``{"question": str, "answer": str,
    "metadata": dict}`` as the dataset generates it. Raises as ``rg_dataset``."""
    return rg_dataset(dataset, seed, config)[0]


class ReasoningGymEnv:
    """A reasoning-gym dataset as a single-turn env.

    ``reset(seed)``: the observation is the entry's question plus ``RG_ANSWER_INSTRUCTION``
    (never the answer); info is ``{"dataset", "seed", "index": 0, "config", "entry",
    "reference"}``: the entry (answer included) and its answer travel in info, which the policy
    never sees, so that a reward service can score with the dataset's own ``score_answer``
    (``reasoning_gym`` reward: metadata ``{"dataset", "entry"}``).
    ``step(action)``: reward = the dataset's ``score_answer(last \\boxed{} content or None,
    entry)``, in [0, 1]; always ``terminated=True``. Stepping again is an error.
    """

    def __init__(self, dataset: str, options: dict[str, Any]) -> None:
        rg_config_fields(dataset)  # fail fast on an unknown dataset, before reset
        self.dataset = dataset
        self.config = options
        self._ds: Any = None
        self._entry: dict[str, Any] | None = None
        self._done = False

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._ds = rg_dataset(self.dataset, seed, self.config)
        self._entry = entry = self._ds[0]
        self._done = False
        info = {"dataset": self.dataset, "seed": seed, "index": 0, "config": self.config,
                "entry": entry, "reference": entry["answer"]}
        return entry["question"] + RG_ANSWER_INSTRUCTION, plain_info(info, "rg")

    def step(self, action: str) -> StepResult:
        from gem.utils.parsing import extract_last_boxed_answer

        if self._entry is None or self._done:
            raise EnvContractError(f"rg:{self.dataset}: step after the episode ended (single turn)")
        answer = extract_last_boxed_answer(action)
        reward = self._ds.score_answer(answer, self._entry)
        self._done = True
        info = {"dataset": self.dataset, "extracted_answer": answer}
        return check_step(("", reward, True, False, info), f"rg:{self.dataset}")

    def close(self) -> None:
        self._ds = self._entry = None


# ------------------------------------------------------------------------------------------------
# User envs by import path
# ------------------------------------------------------------------------------------------------


class PyEnv:
    """Wraps a user env object, validating what it returns."""

    def __init__(self, path: str, env: Any) -> None:
        self.name = f"py:{path}"
        self._env = env

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return check_reset(self._env.reset(seed), self.name)

    def step(self, action: str) -> StepResult:
        return check_step(self._env.step(action), self.name)

    def close(self) -> None:
        close = getattr(self._env, "close", None)
        if callable(close):
            close()


def make_py_env(path: str, options: dict[str, Any]) -> PyEnv:
    """Import ``package.module:Attr`` and build ``Attr(**options)``.

    Raises:
        EnvSpecError: malformed path or module / attribute missing (``not_found``); options the
            factory does not accept, or an object without ``reset`` / ``step`` (``bad_request``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvSpecError("not_found", f"py:{path}: expected py:package.module:ClassOrFactory")
    try:
        factory = _resolve(path)
    except ModuleNotFoundError as exc:
        raise EnvSpecError("not_found", f"py:{path}: cannot import module: {exc}") from None
    except AttributeError as exc:
        raise EnvSpecError("not_found", f"py:{path}: {exc}") from None
    if not callable(factory):
        raise EnvSpecError("bad_request", f"py:{path}: {type(factory).__name__} is not callable")
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise EnvSpecError("bad_request", f"py:{path}: options {sorted(options)}: {exc}") from None
    except ValueError:
        pass  # builtins without a signature: let the call itself decide
    env = factory(**options)
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise EnvSpecError(
            "bad_request", f"py:{path}: {type(env).__name__} has no callable {' / '.join(missing)}"
        )
    return PyEnv(path, env)
