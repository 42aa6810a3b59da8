"""The reward service process (``rollart serve-reward``): an aiohttp app on uvloop.

Routes (contract in :mod:`rollart.reward.protocol`):

- ``POST /v1/reward/{name}``: score one response -> ``{"reward": float, "details": object}``.
- ``GET /v1/reward``: ``{"functions": [{"name", "description", "executor", "timeout_s"}, ...]}``.
- ``GET /healthz``: 200 ``{"status": "ok", "hung_threads": int, "idle_processes": int,
  "killed_processes": int, "broken_processes": int}`` (see
  :class:`~rollart.reward.runner.RewardRunner`).

Every non-200 reply is JSON ``{"error": "..."}`` naming the problem, and no failure is ever
reported as a reward: a crashing, hanging or misbehaving function fails that request only, and the
service keeps serving.

Authentication (:mod:`rollart.reward.auth`): with ``--token-file`` every route but ``/healthz``
needs ``Authorization: Bearer TOKEN`` (else 401). Without it the service refuses to start, on
a loopback ``--host`` too (every local user can connect there), unless ``--no-auth`` says so
explicitly; it then warns. Started by ``rollart run`` it always gets a fresh token file.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec
import uvloop
from aiohttp import web

from rollart import logredact
from rollart.filemodes import apply_umask
from rollart.reward import builtins
from rollart.reward.auth import bearer_middleware, read_token_file
from rollart.reward.protocol import ErrorResponse, RewardRequest
from rollart.reward.registry import RewardRegistry
from rollart.reward.runner import RewardRunner, ScoringError
from rollart.transport.errors import ConfigError

log = logging.getLogger("rollart.reward.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_INFLIGHT = 256

_REGISTRY = web.AppKey("registry", RewardRegistry)
_RUNNER = web.AppKey("runner", RewardRunner)

_request_decoder = msgspec.json.Decoder(RewardRequest)
_encoder = msgspec.json.Encoder()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=_encoder.encode(ErrorResponse(error=message)),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn aiohttp's text errors (404 route, 405, 413) and unexpected bugs into JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(
            exc.status,
            f"{exc.reason}: {request.method} {request.path}",
            headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None,
        )
    except Exception as exc:  # a bug in the service itself: report it, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


class _RewardHandler:
    def __init__(self, max_body_bytes: int, max_inflight: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.inflight = 0

    async def score(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        registry = request.app[_REGISTRY]
        if name not in registry:
            return _error(404, f"unknown reward function {name!r}; known: {registry.names()}")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return _error(413, self._too_large(request.content_length))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, self._too_large(None))
        if not body.strip():
            return _error(400, "request body is empty; expected a JSON object")
        try:
            req = _request_decoder.decode(body)
        except msgspec.ValidationError as exc:
            return _error(400, f"invalid request body: {exc}")
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"malformed JSON in request body: {exc}")
        if self.inflight >= self.max_inflight:
            return _error(
                429,
                f"server busy: {self.inflight} calls in flight (limit {self.max_inflight})",
                headers={"Retry-After": "1"},
            )
        self.inflight += 1
        try:
            result = await request.app[_RUNNER].score(
                registry.get(name), req.prompt, req.response, req.reference, req.metadata
            )
        except ScoringError as exc:
            log.warning("reward %s failed (HTTP %d): %s", name, exc.status, exc.reason)
            return _error(exc.status, exc.reason)
        finally:
            self.inflight -= 1
        try:
            payload = _encoder.encode(result)
        except (TypeError, msgspec.EncodeError) as exc:
            return _error(
                422, f"reward function {name!r} returned details that are not JSON: {exc}"
            )
        return web.Response(body=payload, content_type="application/json")

    def _too_large(self, size: int | None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return f"request body too large{got}: the limit is {self.max_body_bytes} bytes"


async def _list(request: web.Request) -> web.Response:
    runner = request.app[_RUNNER]
    functions = [
        {
            "name": spec.name,
            "description": spec.description,
            "executor": "async" if spec.is_async else spec.executor,
            "timeout_s": spec.timeout_s if spec.timeout_s is not None else runner.default_timeout_s,
        }
        for spec in request.app[_REGISTRY]
    ]
    return web.Response(
        body=_encoder.encode({"functions": functions}), content_type="application/json"
    )


async def _healthz(request: web.Request) -> web.Response:
    # The runner's counters show a service that keeps serving around hung functions.
    return web.json_response({"status": "ok", **request.app[_RUNNER].stats()})


def build_registry(import_paths: Sequence[str] = ()) -> RewardRegistry:
    """Built-in functions plus user functions by import path.

    Each path is ``pkg.mod:func``, ``NAME=pkg.mod:func`` (served as NAME) or ``pkg.mod`` (every
    ``@reward_function`` in the module). Raises ImportError / ValueError / TypeError naming the path.
    """
    registry = RewardRegistry()
    registry.register_module(builtins)
    for path in import_paths:
        name, eq, target = path.partition("=")
        if eq:
            registry.register_import_path(target, name=name)
        else:
            registry.register_import_path(path)
    return registry


def create_app(
    registry: RewardRegistry,
    runner: RewardRunner,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    token: str | None = None,
) -> web.Application:
    """The aiohttp application. Closing it (``on_cleanup``) shuts ``runner``'s pools down.

    Args:
        max_body_bytes: request bodies above this get 413.
        max_inflight: concurrent scoring calls above this get 429 with ``Retry-After: 1``.
        token: if given, every route but ``/healthz`` answers 401 unless the request carries
            ``Authorization: Bearer <token>`` (checked before the body is read).
    """
    if max_body_bytes < 1 or max_inflight < 1:
        raise ValueError(
            f"max_body_bytes and max_inflight must be >= 1, got {max_body_bytes}, {max_inflight}"
        )
    auth = [bearer_middleware(token)] if token is not None else []
    app = web.Application(middlewares=[_json_errors, *auth], client_max_size=max_body_bytes)
    app[_REGISTRY] = registry
    app[_RUNNER] = runner
    handler = _RewardHandler(max_body_bytes, max_inflight)
    app.router.add_post("/v1/reward/{name}", handler.score)
    app.router.add_get("/v1/reward", _list)
    app.router.add_get("/healthz", _healthz)

    async def _close_runner(app: web.Application) -> None:
        runner.close()

    app.on_cleanup.append(_close_runner)
    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rollart serve-reward", description="HTTP reward service (POST /v1/reward/{name})."
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--functions",
        action="append",
        default=[],
        metavar="[NAME=]pkg.mod[:func]",
        help="user reward functions by import path (repeatable)",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--max-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        help="concurrent calls before answering 429",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="per-call limit for functions without their own, seconds",
    )
    p.add_argument("--threads", type=int, default=8, help="thread calls running at once")
    p.add_argument(
        "--max-hung-threads",
        type=int,
        default=1024,
        help="thread calls abandoned past their timeout before thread calls get 503",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="process-pool size for CPU-bound functions (default min(4, cpus))",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write the bound 'host:port' here once listening",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file (mode 0600) holding the bearer token every request must carry "
        "('Authorization: Bearer TOKEN'); rollart run creates one per run",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without a token (any process that can connect may call the functions); "
        "one of --token-file / --no-auth is required",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.token_file is not None and args.no_auth:
        p.error("--token-file and --no-auth exclude each other")
    if args.token_file is None and not args.no_auth:
        # As the ZeroMQ services need --key-file or --insecure: on loopback too, any local
        # user's process could otherwise call the functions.
        where = ("reachable from other machines" if not _is_loopback(args.host)
                 else "reachable by every local user")
        p.error(f"--host {args.host} is {where}: give --token-file FILE (a mode-0600 file "
                "holding the bearer token) or --no-auth to serve without authentication")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_body_bytes", "max_inflight", "threads", "max_hung_threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.timeout_s <= 0:
        p.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.processes is not None and args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    return args


def _is_loopback(host: str) -> bool:
    # IP literals parsed; a host name merely starting with "127." may resolve anywhere.
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _write_ready_file(path: Path, host: str, port: int) -> None:
    # Write-then-rename so a poller never reads a half-written address.
    tmp = path.with_name(path.name + ".tmp")
    shown = f"[{host}]" if ":" in host else host  # IPv6 literal
    tmp.write_text(f"{shown}:{port}\n")
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, registry: RewardRegistry, runner: RewardRunner, *,
                token: str | None = None) -> int:
    """Listen until SIGINT/SIGTERM, then drain and shut down (``token``: see ``create_app``).
    Returns the exit code."""
    if any(spec.executor == "process" and not spec.is_async for spec in registry):
        runner.start_process_pool()
    if token is None:
        log.warning("serving without authentication (--no-auth): any process that can connect "
                    "can call the reward functions")
    app = create_app(
        registry,
        runner,
        max_body_bytes=args.max_body_bytes,
        max_inflight=args.max_inflight,
        token=token,
    )
    app_runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await app_runner.setup()
    try:
        site = web.TCPSite(app_runner, args.host, args.port)
        await site.start()
        host, port = app_runner.addresses[0][:2]
        log.info("reward service on http://%s:%d, functions %s", host, port, registry.names())
        if args.ready_file is not None:
            _write_ready_file(args.ready_file, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("reward service stopping")
    finally:
        await app_runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rollart serve-reward``; returns the process exit code (2: bad arguments)."""
    apply_umask()  # the ready file and anything the functions write: private (rollart.filemodes)
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        token = read_token_file(args.token_file, "--token-file") if args.token_file else None
    except ConfigError as exc:
        print(f"rollart serve-reward: {exc}", file=sys.stderr)
        return 2
    if token is not None:
        logredact.add_secret(token)
    try:
        registry = build_registry(args.functions)
    except (ImportError, ValueError, TypeError) as exc:
        print(f"rollart serve-reward: cannot load reward functions: {exc}", file=sys.stderr)
        return 2
    runner = RewardRunner(
        num_threads=args.threads, num_processes=args.processes, default_timeout_s=args.timeout_s,
        max_hung_threads=args.max_hung_threads,
    )
    try:
        code = uvloop.run(serve(args, registry, runner, token=token))
    except OSError as exc:
        print(
            f"rollart serve-reward: cannot listen on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        code = 1
    finally:
        runner.close()
    hung = runner.wait_threads(timeout_s=2.0)
    if hung:
        # Threads cannot be killed and the interpreter joins them at exit: a hung user function
        # would keep a stopped service alive indefinitely.
        log.warning("abandoning %d reward call(s) still running after their timeout", hung)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
