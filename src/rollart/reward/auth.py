"""Bearer-token authentication of the HTTP reward service and its clients.

``rollart run`` / ``open_cluster`` create a fresh token per run (:func:`create_token_file`: 32
random bytes, url-safe base64, in a file of mode 0600 under ``RUN_DIR/secrets/``), hand
``rollart serve-reward`` the file's *path* (``--token-file``; the secret never appears on a
command line, where ``ps`` would show it) and give the controller's ``RewardClient`` the token,
which it sends as ``Authorization: Bearer TOKEN``. The service answers a request without that
header, or with another token, ``401`` (JSON ``{"error": ...}``, ``WWW-Authenticate: Bearer``)
and keeps serving; ``GET /healthz`` stays open (it says nothing but "ok"). Tokens are compared
with ``hmac.compare_digest`` (time independent of where they differ).

Endpoints of other owners (a FaaS URL in ``domains[].reward_url``, a running service in
``reward.url``) get their token from an environment variable or a file named in the scenario
(``reward_token_env`` / ``reward_token_file``): the scenario and the run's ``config.json`` hold
only that name, never the secret.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from rollart.transport.errors import ConfigError

#: paths served without a token
OPEN_PATHS = frozenset({"/healthz"})


def create_token_file(path: Path) -> str:
    """Write a new random token to ``path`` (mode 0600, parent made 0700); returns the token.

    Raises:
        OSError: the file exists already or cannot be written.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token_file(path: Path, what: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped).

    Raises:
        ConfigError: unreadable, empty, or readable by the group or others (``chmod 600``);
            names ``what`` and the path, never the content.
    """
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read token file {path}: {exc.strerror or exc}") \
            from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what}: token file {path} is accessible by group or others "
                          f"(mode {stat.S_IMODE(mode):o}); make it private: chmod 600 {path}")
    token = text.strip()
    if not token:
        raise ConfigError(f"{what}: token file {path} is empty")
    return token


def token_from(env_name: str | None, file: str | None, what: str) -> str | None:
    """The token configured by an environment variable name or a file path (``None``: none).

    Raises:
        ConfigError: the variable is unset or empty, or the file as in :func:`read_token_file`.
    """
    if env_name is not None:
        value = os.environ.get(env_name, "").strip()
        if not value:
            raise ConfigError(f"{what}: environment variable {env_name} (the token) is unset "
                              "or empty")
        return value
    if file is not None:
        return read_token_file(Path(file).expanduser(), what)
    return None


def bearer_middleware(token: str) -> Callable:
    """aiohttp middleware answering 401 unless ``Authorization: Bearer <token>`` is sent."""
    expected = token.encode()

    @web.middleware
    async def require_token(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        got = request.headers.get("Authorization")
        if got is None:
            reason = "no Authorization header: send 'Authorization: Bearer <token>'"
        else:
            # RFC 7235 section 2.1: the auth scheme is case-insensitive ("bearer" is "Bearer").
            scheme, _, presented = got.partition(" ")
            if scheme.lower() != "bearer":
                reason = "wrong bearer token"
            elif hmac.compare_digest(presented.strip().encode(errors="surrogateescape"), expected):
                return await handler(request)
            else:
                reason = "wrong bearer token"
        return web.json_response({"error": f"unauthorized: {reason}"}, status=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="rollart-reward"'})

    return require_token
