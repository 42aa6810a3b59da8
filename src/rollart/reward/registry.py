"""Registry of reward functions served by the reward service.

A reward function has the signature::

    fn(prompt: str, response: str, reference: Any, metadata: dict) -> float | tuple[float, dict]

and may be ``def`` or ``async def``. It returns the reward (a finite real number) or the reward
and a JSON-serialisable ``details`` dict. To say "this request is unusable for me" (a reference
that does not parse, a missing metadata key) it raises :class:`RewardInputError`, which the
service reports as HTTP 422; any other exception is reported as HTTP 500. Neither is ever turned
into a reward of 0.

Functions are declared with the :func:`reward_function` decorator, which only *marks* the function
(no global state), and are added to a :class:`RewardRegistry` either directly
(:meth:`RewardRegistry.register`) or by import path (:meth:`RewardRegistry.register_import_path`),
which is what ``rollart serve-reward --functions pkg.mod:func`` does.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

Executor = Literal["inline", "thread", "process"]
"""Where a sync function runs: ``inline`` on the event loop (only for trivial functions),
``thread`` in the service's thread pool, ``process`` in its process pool (CPU-bound work such as
sympy; the function must be importable by module path so it can be pickled by reference)."""

_EXECUTORS: tuple[Executor, ...] = ("inline", "thread", "process")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MARK = "__rollart_reward__"


class RewardInputError(ValueError):
    """Raised by a reward function when the request cannot be scored (bad reference/metadata).

    The service answers HTTP 422 with this message; it is the function's way to say "your input
    is wrong", as opposed to "I crashed" (any other exception, HTTP 500).
    """


@dataclass(frozen=True)
class RewardFunction:
    """One registered reward function.

    Attributes:
        name: URL name, ``[A-Za-z0-9_.-]{1,64}``; served at ``POST /v1/reward/{name}``.
        fn: the callable, ``(prompt, response, reference, metadata) -> float | (float, dict)``.
        is_async: ``fn`` is a coroutine function (then ``executor`` is ignored; it runs on the loop).
        executor: where a sync ``fn`` runs (see :data:`Executor`).
        timeout_s: per-call limit in seconds including queueing, or ``None`` for the service default.
        description: first line of the docstring, shown by ``GET /v1/reward``.
    """

    name: str
    fn: Callable[..., Any]
    is_async: bool
    executor: Executor = "thread"
    timeout_s: float | None = None
    description: str = ""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid reward function name {name!r}: use 1-64 characters from [A-Za-z0-9_.-]"
        )
    return name


def _make_spec(
    fn: Callable[..., Any], name: str, executor: str, timeout_s: float | None
) -> RewardFunction:
    if not callable(fn):
        raise TypeError(f"reward function {name!r} is not callable: {fn!r}")
    if executor not in _EXECUTORS:
        raise ValueError(
            f"reward function {name!r}: executor must be one of {_EXECUTORS}, got {executor!r}"
        )
    if timeout_s is not None and not (timeout_s > 0):
        raise ValueError(f"reward function {name!r}: timeout_s must be > 0, got {timeout_s!r}")
    try:
        inspect.signature(fn).bind("prompt", "response", None, {})
    except TypeError as exc:
        raise TypeError(
            f"reward function {name!r} must accept (prompt, response, reference, metadata): {exc}"
        ) from None
    except ValueError:
        pass  # builtins without an introspectable signature: trust the caller
    doc = inspect.getdoc(fn) or ""
    return RewardFunction(
        name=_check_name(name),
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
        executor=executor,
        timeout_s=timeout_s,
        description=doc.strip().splitlines()[0] if doc.strip() else "",
    )


def reward_function(
    name: str, *, executor: Executor = "thread", timeout_s: float | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that marks ``fn`` as the reward function ``name``; returns ``fn`` unchanged.

    Marking has no global effect: the function is served once its module (or the function itself)
    is registered, e.g. ``--functions my_pkg.rewards`` or ``--functions my_pkg.rewards:fn``.

    Args:
        name: URL name (``[A-Za-z0-9_.-]{1,64}``).
        executor: where a sync function runs; ``process`` for CPU-bound scorers.
        timeout_s: per-call limit in seconds (``None``: the service default).

    Raises:
        ValueError / TypeError: bad name, executor, timeout or signature.
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _MARK, _make_spec(fn, name, executor, timeout_s))
        return fn

    return mark


def marked_spec(fn: Any) -> RewardFunction | None:
    """The :class:`RewardFunction` attached by :func:`reward_function`, or ``None``."""
    spec = getattr(fn, _MARK, None)
    return spec if isinstance(spec, RewardFunction) else None


class RewardRegistry:
    """Name -> :class:`RewardFunction` for one service instance (no process-wide state)."""

    def __init__(self) -> None:
        self._functions: dict[str, RewardFunction] = {}

    def add(self, spec: RewardFunction) -> RewardFunction:
        """Add a prepared spec. Raises ``ValueError`` if the name is taken."""
        if spec.name in self._functions:
            raise ValueError(f"reward function {spec.name!r} is already registered")
        self._functions[spec.name] = spec
        return spec

    def register(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        *,
        executor: Executor | None = None,
        timeout_s: float | None = None,
    ) -> RewardFunction:
        """Register ``fn`` under ``name``.

        Defaults come from the :func:`reward_function` mark if present, else ``fn.__name__``,
        the ``thread`` executor and the service default timeout.

        Raises:
            ValueError: the name is invalid or already registered; TypeError: bad signature.
        """
        mark = marked_spec(fn)
        spec = _make_spec(
            fn,
            name or (mark.name if mark else getattr(fn, "__name__", "")),
            executor or (mark.executor if mark else "thread"),
            timeout_s if timeout_s is not None else (mark.timeout_s if mark else None),
        )
        return self.add(spec)

    def register_module(self, module: ModuleType | str) -> list[RewardFunction]:
        """Register every function of ``module`` marked with :func:`reward_function`.

        Raises:
            ImportError: the module cannot be imported; ValueError: it marks no function.
        """
        mod = importlib.import_module(module) if isinstance(module, str) else module
        specs = []
        for value in vars(mod).values():
            spec = marked_spec(value)
            if spec is not None and getattr(value, "__module__", None) == mod.__name__:
                specs.append(spec)
        if not specs:
            raise ValueError(f"module {mod.__name__!r} has no function marked @reward_function")
        return [self.add(spec) for spec in specs]

    def register_import_path(self, path: str, name: str | None = None) -> list[RewardFunction]:
        """Register functions by import path.

        ``pkg.mod:func`` registers one function (as ``name``, else its mark's name, else
        ``func``); ``pkg.mod`` registers every marked function in the module (``name`` not allowed).

        Raises:
            ValueError: malformed path, missing attribute or name clash; ImportError: no module.
        """
        module_name, sep, attr = path.partition(":")
        if not module_name or (sep and not attr):
            raise ValueError(f"invalid import path {path!r}: expected 'pkg.mod:func' or 'pkg.mod'")
        if not sep:
            if name is not None:
                raise ValueError(f"import path {path!r} names a module; name= needs 'pkg.mod:func'")
            return self.register_module(module_name)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"cannot import module {module_name!r} of {path!r}: {exc}") from exc
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"import path {path!r}: {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        return [self.register(obj, name)]

    def get(self, name: str) -> RewardFunction:
        """The function ``name``. Raises ``KeyError`` naming the known functions."""
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(
                f"unknown reward function {name!r}; known: {sorted(self._functions)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __iter__(self) -> Iterator[RewardFunction]:
        return iter([self._functions[n] for n in self.names()])

    def __len__(self) -> int:
        return len(self._functions)
