"""In-process envs (``Cluster.register_env``): one env object per session, closed on every path.

An env is closed exactly once, whichever way its session ends: the step that ends its episode,
``close_session``, or a failure of the factory, ``reset`` or ``step`` (an exception, a deadline
passed, a malformed result, the caller cancelled). A sync call past its deadline keeps running
on its abandoned thread (threads cannot be killed) and closing the env under it would race it,
so such an env is closed by that thread when the call returns; an env built by a factory that
returns after its deadline is closed the same way. This mirrors the env host, whose sessions
are released on every failure, so that an env holding a container or a subprocess is not left
behind by a trajectory that failed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rollart.controller.rollout.offloop import OffLoopCalls
from rollart.envhost.families import EnvContractError, check_reset, check_step
from rollart.transport import messages as m
from rollart.transport.errors import EnvError, InvalidActionError

log = logging.getLogger(__name__)

#: deadline of one env ``close()`` made on a failure path (seconds); past it the close's thread
#: is abandoned like any other call's
CLOSE_TIMEOUT_S = 30.0


class _LocalEnv:
    """One session's env (``None`` until its factory returned) and whether a sync call runs on
    it; ``lock`` orders the loop's "give up" against the thread's "call returned"."""

    __slots__ = ("closed", "doomed", "env", "lock", "loop", "running")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.env: Any = None
        self.loop = loop
        self.lock = threading.Lock()
        self.running = False  # a sync call of this env is on a thread
        self.doomed = False  # the session is over: close the env once nothing runs on it
        self.closed = False  # its close has been started (exactly once)


class LocalEnvBackend:
    """In-process envs registered by name; each session is one env object.

    ``factories[name](**options)`` (the domain's ``env_options``; ``factory()`` when there are
    none) returns an object with ``reset(seed) -> (observation: str, info: dict)`` and
    ``step(action: str) -> (observation, reward, terminated, truncated, info)`` (sync or async)
    and optionally ``close()``. Sync calls run off the event loop (``calls``: bounded threads)
    and every call is bounded by the ``timeout_s`` it is given. An exception in the env raises
    ``EnvError("env_error")``, a call past its deadline ``EnvError("env_timeout")``;
    ``InvalidActionError`` from ``step`` passes through (a model-caused outcome, not a failure).
    A session is closed (its env's ``close()`` called) by the step that ends its episode
    (``EnvStepResult.closed``), as on an env host, and by any failure of ``open`` or ``step``
    (see the module docstring).
    """

    name = "local"
    dead = False

    def __init__(self, factories: Mapping[str, Callable[..., Any]] | None = None,
                 calls: OffLoopCalls | None = None) -> None:
        self.factories: dict[str, Callable[..., Any]] = dict(factories or {})
        self.calls = calls or OffLoopCalls(what="local env")
        self._sessions: dict[str, _LocalEnv] = {}
        self._ids = itertools.count()
        self._background: set[asyncio.Task[None]] = set()

    async def _call(self, s: _LocalEnv, what: str, timeout_s: float | None,
                    fn: Callable[..., Any], *args: Any) -> Any:
        if not inspect.iscoroutinefunction(fn):
            fn = functools.partial(self._tracked, s, fn)
        try:
            return await self.calls.run(fn, *args, timeout_s=timeout_s, name=what)
        except InvalidActionError:
            raise
        except TimeoutError as exc:
            raise EnvError("env_timeout", f"{what}: no result within {timeout_s} s") from exc
        except Exception as exc:
            raise EnvError("env_error", f"{what}: {type(exc).__name__}: {exc}") from exc

    def _tracked(self, s: _LocalEnv, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on its thread, closing the env afterwards if the session ended
        meanwhile (its caller gave up on this call)."""
        with s.lock:
            if s.doomed:  # the caller gave up before the thread started: do not touch the env
                raise EnvError("env_timeout", "the session ended before this call started")
            s.running = True
        try:
            return fn(*args)
        finally:
            with s.lock:
                s.running = False
                late = s.doomed
            if late:
                try:
                    s.loop.call_soon_threadsafe(self._close_in_background, s)
                except RuntimeError:  # the loop is closed: nobody is left to await a close
                    _close_sync_quietly(s)

    def _discard(self, s: _LocalEnv) -> bool:
        """End ``s``: returns True when its env is to be closed now (no call runs on it);
        otherwise the thread of the running call closes it when that call returns."""
        with s.lock:
            s.doomed = True
            if s.running or s.closed or s.env is None:
                return False
            s.closed = True
            return True

    async def _close(self, s: _LocalEnv, what: str, timeout_s: float | None) -> None:
        close = getattr(s.env, "close", None)
        if close is not None:
            await self._call(_LocalEnv(s.loop), what, timeout_s, close)

    async def _close_quietly(self, s: _LocalEnv, what: str) -> None:
        try:
            await self._close(s, what, CLOSE_TIMEOUT_S)
        except Exception as exc:  # the session failed already; its close must not mask why
            log.warning("closing %s failed: %s", what, exc)

    def _spawn_close(self, s: _LocalEnv, what: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._close_quietly(s, what))
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)
        return task

    def _close_in_background(self, s: _LocalEnv) -> None:
        with s.lock:
            if s.closed or s.env is None:
                return
            s.closed = True
        self._spawn_close(s, "a local env whose call returned after its deadline")

    async def _fail(self, s: _LocalEnv, what: str) -> None:
        """Close ``s`` after a failure: now if nothing runs on it, else when that call returns.
        Shielded: a caller cancelled meanwhile leaves, the close goes on."""
        if self._discard(s):
            await asyncio.shield(self._spawn_close(s, what))

    async def open(self, env_name: str, seed: int, options: dict[str, Any] | None = None, *,
                   timeout_s: float | None = None) -> m.EnvOpened:
        """Build env ``env_name`` with ``options`` and reset it with ``seed``. Raises
        ``EnvError`` (``not_found``, ``env_error``, ``env_timeout``); the env, if built, is
        closed on every failure."""
        if env_name not in self.factories:
            raise EnvError("not_found", f"no local env {env_name!r}")
        factory = functools.partial(self.factories[env_name], **(options or {}))
        s = _LocalEnv(asyncio.get_running_loop())

        def build() -> Any:
            env = factory()
            if not inspect.isawaitable(env):  # awaited on the loop, under the deadline
                s.env = env  # set on the thread, so that a late return is still closed
            return env

        try:
            s.env = await self._call(s, f"{env_name} factory", timeout_s,
                                     factory if inspect.iscoroutinefunction(factory) else build)
            out = await self._call(s, f"{env_name}.reset", timeout_s, s.env.reset, seed)
            # The env host's contract checks: a malformed return fails this session
            # (env_error), never the run.
            obs, info = _contract(check_reset, out, env_name)
        except BaseException:
            await self._fail(s, f"{env_name} after a failed open")
            raise
        sid = f"local-{next(self._ids)}"
        self._sessions[sid] = s
        return m.EnvOpened(session_id=sid, observation=obs, info=info)

    async def step(self, session_id: str, action: str, *, timeout_s: float | None = None
                   ) -> m.EnvStepResult:
        """Apply ``action``. A failure (other than ``InvalidActionError``, after which the
        session goes on) closes the session; so does the step that ends the episode."""
        s = self._sessions.get(session_id)
        if s is None:
            raise EnvError("not_found", f"no local session {session_id!r}")
        try:
            out = await self._call(s, f"{session_id}.step", timeout_s, s.env.step, action)
            obs, reward, terminated, truncated, info = _contract(check_step, out, session_id)
        except InvalidActionError:
            raise
        except BaseException:
            if self._sessions.pop(session_id, None) is not None:
                await self._fail(s, f"{session_id} after a failed step")
            raise
        ended = bool(terminated or truncated) and session_id in self._sessions
        if ended:  # as the env hosts do: an ended episode's session closes with its last step
            await self.close_session(session_id)
        return m.EnvStepResult(session_id=session_id, observation=obs, reward=reward,
                               terminated=terminated, truncated=truncated, info=info,
                               closed=ended)

    async def close_session(self, session_id: str) -> None:
        """Close a session's env (an unknown or already closed id: nothing). If a call of it
        is still running (abandoned past its deadline), the env closes when that returns.
        Raises ``EnvError`` when ``close()`` raises or times out."""
        s = self._sessions.pop(session_id, None)
        if s is not None and self._discard(s):
            await self._close(s, f"{session_id}.close", None)

    @property
    def num_open(self) -> int:
        """Sessions open (built, reset and not closed)."""
        return len(self._sessions)


def _close_sync_quietly(s: _LocalEnv) -> None:
    with s.lock:
        if s.closed or s.env is None:
            return
        s.closed = True
    close = getattr(s.env, "close", None)
    try:
        if close is not None and inspect.iscoroutine(out := close()):
            out.close()  # a coroutine nobody can run any more
    except Exception as exc:  # noqa: BLE001 - shutting down: log and go on
        log.warning("closing a local env failed: %s", exc)


def _contract(check: Callable[[Any, str], Any], out: Any, where: str) -> Any:
    try:
        return check(out, where)
    except EnvContractError as exc:
        raise EnvError("env_error", str(exc)) from None
