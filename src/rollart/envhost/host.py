"""The env host process: many stateful env sessions served over ZeroMQ RPC (``rollart serve-env``).

Requests: ``EnvOpen`` -> ``EnvOpened``, ``EnvStep`` -> ``EnvStepResult``, ``EnvClose`` -> ``Ack``,
``GetEnvStats`` -> ``EnvHostStats`` (``Ping`` -> ``Pong`` comes with ``RpcServer``).

Env code is synchronous and may block, so every reset / step / close runs in a thread pool of
``threads`` workers with a timeout, and the event loop keeps serving other sessions meanwhile.
An env that raises or times out fails *that* session: the reply is ``env_error`` /
``env_timeout``, the session is removed (a later step gets ``not_found`` naming why) and released.
An env whose ``step`` raises ``InvalidActionError`` (a malformed action: the model's fault) gets
the reply ``invalid_action`` with its message, and the session stays open.
A thread stuck in a hung env cannot be interrupted: it stays busy until the env returns (then the
env is closed), which is why ``threads`` should exceed the number of envs expected to hang.
Injected latency is an awaited sleep before the step, so it never holds a thread.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from rollart.envhost.allow import check_allow_entries, check_env_allowed
from rollart.envhost.families import EnvAdapter, EnvSpecError, make_env
from rollart.envhost.latency import LatencyConfig, LatencyModel, select_latency
from rollart.filemodes import apply_umask
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError, EnvError, InvalidActionError
from rollart.transport.rpc import RpcServer
from rollart.transport.security import Auth, add_auth_args, service_auth

log = logging.getLogger(__name__)

TimeoutS = Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]
_CLOSED_MEMORY = 4096  # how many closed session ids keep their reason for error messages


class HostConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Env host settings (TOML ``--config`` or flags).

    Fields:
        address: ZeroMQ endpoint to bind (``:0`` = a free port); 127.0.0.1 by default.
        name: host name in ``Pong``, stats and session ids (``{name}-{ordinal}``).
        step_timeout_s: wall-clock limit of one env ``step`` call (seconds), latency excluded.
        open_timeout_s: limit of building + resetting an env on ``EnvOpen`` (seconds).
        close_timeout_s: limit of one env ``close`` call (seconds).
        max_sessions: sessions open (or opening) at once; ``EnvOpen`` beyond it is refused.
        threads: worker threads running env code.
        latency: env name, family (``game`` / ``rg`` / ``py``) or ``"*"`` -> ``LatencyConfig``.
        max_message_bytes: largest request accepted (bytes), also the socket's ``MAXMSGSIZE``
            (a larger frame disconnects its sender before it is buffered). Requests are an env
            name, options and one action (a turn's text: ``run.max_tokens_per_turn`` tokens,
            a few KiB to a few hundred KiB); 4 MiB leaves room for large options while a
            flood of oversized frames cannot grow the host's memory. At least 2 MiB, the
            largest batch envelope of small requests (``zmqloop.MAX_BATCH_FRAME_BYTES``).
        allow_env: the only ``py:package.module:Attr`` envs this host builds (exact names;
            ``rollart.envhost.allow``); ``game:`` / ``rg:`` envs need no entry.
    """

    address: str = "tcp://127.0.0.1:0"
    name: str = "envhost"
    step_timeout_s: TimeoutS = 60.0
    open_timeout_s: TimeoutS = 120.0
    close_timeout_s: TimeoutS = 10.0
    max_sessions: Annotated[int, msgspec.Meta(gt=0, le=1_000_000)] = 1024
    threads: Annotated[int, msgspec.Meta(gt=0, le=4096)] = 32
    latency: dict[str, LatencyConfig] = {}
    max_message_bytes: Annotated[int, msgspec.Meta(ge=2 << 20, le=1 << 30)] = 4 << 20
    allow_env: list[str] = []

    def __post_init__(self) -> None:
        check_allow_entries(self.allow_env)  # raises ValueError naming a malformed entry


@dataclass(eq=False)
class _Session:
    id: str
    env_name: str
    latency: LatencyModel | None
    env: EnvAdapter | None = None
    busy: bool = True  # opening counts as busy
    num_steps: int = 0
    closed: bool = False
    inflight: concurrent.futures.Future | None = None  # the env call running in a thread


class EnvHost:
    """Holds env sessions and serves them with ``RpcServer``.

    Use ``await host.start(auth)`` (binds, returns the bound address) then ``await host.aclose()``.
    Handlers raise ``EnvError`` with codes ``not_found`` (unknown env / session),
    ``bad_request`` (bad options, session busy, host full), ``env_error``, ``env_timeout``.
    """

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.name = config.name
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix=f"{config.name}-env"
        )
        self._sessions: dict[str, _Session] = {}
        self._closed_reasons: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._latency = {k: LatencyModel(v) for k, v in config.latency.items()}
        self._allowed = frozenset(config.allow_env)
        self._ordinal = 0
        self.num_steps = 0
        self.num_errors = 0
        self.num_stuck_threads = 0
        self._server: RpcServer | None = None
        self._serve_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def handlers(self) -> dict[type, Callable]:
        return {
            m.EnvOpen: self.open,
            m.EnvStep: self.step,
            m.EnvClose: self.close_session,
            m.GetEnvStats: self.stats,
        }

    async def start(self, auth: Auth) -> str:
        """Bind and start serving in the background, only to holders of ``auth`` (the run's
        key, or ``INSECURE``); returns the bound address."""
        self._server = RpcServer(
            self.config.address,
            self.handlers,
            name=self.name,
            auth=auth,
            max_message_bytes=self.config.max_message_bytes,
        )
        self._serve_task = asyncio.create_task(self._server.serve_forever())
        return self._server.address

    async def aclose(self) -> None:
        """Stop serving, close every session (each within ``close_timeout_s``), stop the pool
        without waiting for threads stuck in hung envs."""
        if self._server is not None:
            await self._server.close()
        if self._serve_task is not None:
            self._serve_task.cancel()
            await asyncio.gather(self._serve_task, return_exceptions=True)
        sessions = list(self._sessions.values())
        for s in sessions:
            self._forget(s, "the host shut down")
        await asyncio.gather(
            *self._background, *(self._release(s) for s in sessions), return_exceptions=True
        )
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers -----------------------------------------------------------------------------------

    async def _run(self, s: _Session, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Run ``fn`` in the pool; raise ``EnvError(env_timeout)`` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        cf = self._pool.submit(_no_stray_cancel, fn)
        s.inflight = cf
        try:
            return await asyncio.wait_for(asyncio.wrap_future(cf), timeout_s)
        except TimeoutError:
            if cf.cancel():  # still queued behind busy threads: it never ran
                raise EnvError(
                    "env_timeout", f"{what}: no free env thread within {timeout_s:g} s"
                ) from None
            self.num_stuck_threads += 1
            log.warning(
                "%s: %s exceeded %g s; its thread stays busy until it returns",
                self.name,
                what,
                timeout_s,
            )
            cf.add_done_callback(lambda _: self._unstick_threadsafe(loop))
            raise EnvError(
                "env_timeout", f"{what} exceeded its timeout of {timeout_s:g} s"
            ) from None

    def _unstick_threadsafe(self, loop: asyncio.AbstractEventLoop) -> None:
        def unstick() -> None:
            self.num_stuck_threads -= 1

        try:
            loop.call_soon_threadsafe(unstick)
        except RuntimeError:  # the loop is closed: the host has shut down, nobody counts
            pass

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            reason = self._closed_reasons.get(session_id)
            detail = f"was closed: {reason}" if reason else "is unknown"
            raise EnvError("not_found", f"session {session_id!r} {detail}")
        return s

    def _forget(self, s: _Session, reason: str) -> None:
        """Remove ``s`` from the live sessions, remembering why (for later error messages)."""
        s.closed = True
        if self._sessions.pop(s.id, None) is not None:
            self._closed_reasons[s.id] = reason
            while len(self._closed_reasons) > _CLOSED_MEMORY:
                self._closed_reasons.popitem(last=False)

    async def _release(self, s: _Session) -> None:
        """Close ``s``'s env in the pool, once no call of it is running; errors are logged (the
        session is gone either way)."""
        if s.inflight is not None and not s.inflight.done():
            # Closing under a running call would race it: the thread closes the env when that
            # call returns (if it finished in between, the callback runs here, at once).
            s.inflight.add_done_callback(lambda _: _close_quietly(s))
            return
        if s.env is None:
            return
        try:
            await asyncio.wait_for(
                asyncio.wrap_future(self._pool.submit(_close_quietly, s)),
                self.config.close_timeout_s,
            )
        except TimeoutError:
            log.warning(
                "%s: close of %s exceeded %g s", self.name, s.id, self.config.close_timeout_s
            )
        except RuntimeError:  # the pool is already shut down
            _close_quietly(s)

    def _fail(self, s: _Session, exc: EnvError) -> None:
        self.num_errors += 1
        self._end(s, f"{exc.code}: {exc.message}")

    def _end(self, s: _Session, reason: str) -> None:
        """Forget ``s`` now and release its env in the background (the reply need not wait)."""
        self._forget(s, reason)
        task = asyncio.get_running_loop().create_task(self._release(s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- handlers ----------------------------------------------------------------------------------

    async def open(self, msg: m.EnvOpen, _frames: list[memoryview] | None = None) -> m.EnvOpened:
        """Build env ``msg.env_name`` with ``msg.options`` and reset it with ``msg.seed``.
        A ``py:`` env not on the allow-list is refused (``bad_request``) before anything is
        imported or looked up, and no session is created."""
        try:
            check_env_allowed(msg.env_name, self._allowed)
        except EnvSpecError as exc:
            log.warning("%s: %s", self.name, exc.message)
            raise EnvError(exc.code, exc.message) from None
        if len(self._sessions) >= self.config.max_sessions:
            raise EnvError(
                "bad_request",
                f"{self.name} is full: {len(self._sessions)}/{self.config.max_sessions} sessions open",
            )
        self._ordinal += 1
        sid = f"{self.name}-{self._ordinal}"
        latency = select_latency(self._latency, msg.env_name)
        s = _Session(id=sid, env_name=msg.env_name, latency=latency)
        self._sessions[sid] = s

        def build_and_reset() -> tuple[str, dict[str, Any]]:
            env = make_env(msg.env_name, msg.options)
            s.env = env
            return env.reset(msg.seed)

        try:
            obs, info = await self._run(
                s, build_and_reset, self.config.open_timeout_s, f"open {msg.env_name}"
            )
        except EnvSpecError as exc:
            self._forget(s, f"open failed: {exc.message}")
            await self._release(s)
            raise EnvError(exc.code, exc.message) from None
        except EnvError as exc:
            self._fail(s, exc)
            raise
        except Exception as exc:
            err = EnvError(
                "env_error",
                f"open {msg.env_name} (seed {msg.seed}) raised {type(exc).__name__}: {exc}",
            )
            log.warning("%s: %s", self.name, err.message, exc_info=True)
            self._fail(s, err)
            raise err from None
        finally:
            s.busy = False
        if s.closed:  # closed by the client while opening
            await self._release(s)
            raise EnvError("not_found", f"session {sid!r} was closed while opening")
        return m.EnvOpened(session_id=sid, observation=obs, info=info)

    async def step(
        self, msg: m.EnvStep, _frames: list[memoryview] | None = None
    ) -> m.EnvStepResult:
        """Apply ``msg.action`` to the session (after any injected latency)."""
        s = self._get(msg.session_id)
        if s.busy:
            raise EnvError(
                "bad_request", f"session {s.id!r} is already stepping; sessions are sequential"
            )
        s.busy = True
        env = s.env
        assert env is not None
        what = f"step {s.num_steps} of {s.id} ({s.env_name})"
        try:
            if s.latency is not None:
                delay_s, fail = s.latency.draw(s.id, s.num_steps)
                await asyncio.sleep(delay_s)
                if fail:
                    raise EnvError("env_error", f"{what}: injected failure (latency config)")
            obs, reward, terminated, truncated, info = await self._run(
                s, lambda: env.step(msg.action), self.config.step_timeout_s, what
            )
        except InvalidActionError as exc:
            # The model's action was malformed; the env is fine and the session goes on (the
            # controller applies the domain's invalid_action policy).
            s.num_steps += 1
            raise EnvError("invalid_action", f"{what}: {exc.message}") from None
        except EnvError as exc:
            if not s.closed:
                self._fail(s, exc)
            raise
        except Exception as exc:
            err = EnvError("env_error", f"{what} raised {type(exc).__name__}: {exc}")
            log.warning("%s: %s", self.name, err.message, exc_info=True)
            if not s.closed:
                self._fail(s, err)
            raise err from None
        finally:
            s.busy = False
        s.num_steps += 1
        self.num_steps += 1
        if s.closed:  # closed by the client mid-step: the step happened, now release the env
            await self._release(s)
        ended = bool(terminated or truncated) and not s.closed
        if ended:
            # The episode is over, so nothing will step it again: close it now, and the
            # controller skips its EnvClose (one RPC fewer per trajectory). The env is
            # released after the reply, so a slow env.close() does not delay it.
            self._end(s, "closed by the host when its episode ended")
        return m.EnvStepResult(
            session_id=s.id,
            observation=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            info=info,
            closed=ended,
        )

    async def close_session(
        self, msg: m.EnvClose, _frames: list[memoryview] | None = None
    ) -> m.Ack:
        """Close a session and release its env. Closing a session that already ended (failed
        or closed) acknowledges with the reason; an id never seen is ``not_found``."""
        s = self._sessions.get(msg.session_id)
        if s is None:
            reason = self._closed_reasons.get(msg.session_id)
            if reason is None:
                raise EnvError("not_found", f"session {msg.session_id!r} is unknown")
            return m.Ack(detail=f"already closed: {reason}")
        self._forget(s, "closed by the client")
        if s.busy:
            return m.Ack(detail="closing after the in-flight call returns")
        await self._release(s)
        return m.Ack(detail="closed")

    async def stats(
        self, _msg: m.GetEnvStats | None = None, _frames: list[memoryview] | None = None
    ) -> m.EnvHostStats:
        """Open sessions, successful steps and env failures (env_error + env_timeout) so far."""
        return m.EnvHostStats(
            host=self.name,
            num_sessions=len(self._sessions),
            num_steps=self.num_steps,
            num_errors=self.num_errors,
        )


def _no_stray_cancel(fn: Callable[[], Any]) -> Any:
    """``fn()``; a ``CancelledError`` raised by env code becomes an ordinary error (nobody
    cancelled anything: passed on as is it would look like the handler being cancelled)."""
    try:
        return fn()
    except asyncio.CancelledError as exc:
        raise RuntimeError(f"env code raised CancelledError ({exc})") from None


def _close_quietly(s: _Session) -> None:
    env, s.env = s.env, None
    if env is None:
        return
    try:
        env.close()
    except Exception:
        log.warning("closing env of session %s raised", s.id, exc_info=True)


# ------------------------------------------------------------------------------------------------
# Process entry point
# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollart serve-env", description="Serve environment sessions over ZeroMQ RPC."
    )
    p.add_argument("--config", type=Path, help="TOML file with HostConfig fields")
    p.add_argument("--address", help="ZeroMQ endpoint (default tcp://127.0.0.1:0 = free port)")
    p.add_argument("--name", help="host name (default envhost)")
    p.add_argument("--ready-file", type=Path, help="write the bound address here once serving")
    p.add_argument("--step-timeout-s", type=float, help="limit of one env step (s)")
    p.add_argument("--open-timeout-s", type=float, help="limit of building + resetting an env (s)")
    p.add_argument("--max-sessions", type=int, help="sessions open at once")
    p.add_argument("--threads", type=int, help="worker threads running env code")
    p.add_argument(
        "--latency",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='latency injection for an env name, family or "*", e.g. '
        'game=\'{"distribution": "normal", "mean_s": 10, "std_s": 3}\' (repeatable)',
    )
    p.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="py:package.module:Attr",
        help="a py: env this host may build (exact name, repeatable); py: envs not listed are "
        "refused before any import. game: and rg: envs need no entry",
    )
    p.add_argument("--log-level", default="INFO")
    add_auth_args(p)
    return p


def build_config(args: argparse.Namespace) -> HostConfig:
    """``HostConfig`` from ``--config`` (if any) overridden by explicit flags.

    Raises:
        ConfigError: unreadable / invalid TOML, an invalid flag value or ``--latency`` entry.
    """
    raw: dict[str, Any] = {}
    if args.config is not None:
        try:
            raw = msgspec.toml.decode(args.config.read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            raise ConfigError(f"{args.config}: {exc}") from None
    flags = {
        "address": args.address,
        "name": args.name,
        "step_timeout_s": args.step_timeout_s,
        "open_timeout_s": args.open_timeout_s,
        "max_sessions": args.max_sessions,
        "threads": args.threads,
    }
    raw.update({k: v for k, v in flags.items() if v is not None})
    latency = dict(raw.get("latency", {}))
    for item in args.latency:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--latency {item!r}: expected KEY=JSON")
        try:
            latency[key] = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"--latency {key}: invalid JSON: {exc}") from None
    if latency:
        raw["latency"] = latency
    if args.allow_env:
        raw["allow_env"] = [*raw.get("allow_env", []), *args.allow_env]
    try:
        return msgspec.convert(raw, HostConfig)
    except msgspec.ValidationError as exc:
        where = str(args.config) if args.config is not None else "flags"
        raise ConfigError(f"{where}: {exc}") from None


async def _serve(config: HostConfig, auth: Auth, ready_file: Path | None) -> int:
    # Import the env libraries before serving so the first open is not slowed by it.
    import gem  # noqa: F401
    import reasoning_gym  # noqa: F401

    host = EnvHost(config)
    address = await host.start(auth)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(address)
        tmp.replace(ready_file)  # atomic: a reader never sees a partial address
    log.info("%s serving on %s (pid %d)", config.name, address, os.getpid())
    await stop.wait()
    log.info("%s shutting down", config.name)
    await host.aclose()
    return host.num_stuck_threads


def main(argv: list[str] | None = None) -> int:
    """Run the env host until SIGTERM / SIGINT. Returns the exit status (2: bad config)."""
    apply_umask()  # what it and its envs write: private (rollart.filemodes)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_config(args)
        auth = service_auth(args.key_file, args.insecure, config.address)
    except ConfigError as exc:
        print(f"rollart serve-env: {exc}", file=sys.stderr)
        return 2
    import uvloop

    stuck = uvloop.run(_serve(config, auth, args.ready_file))
    if stuck:
        # Threads stuck in hung envs cannot be interrupted and would block interpreter exit.
        log.warning("%d env thread(s) still stuck at exit; exiting without joining them", stuck)
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
