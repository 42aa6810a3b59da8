"""The OpenAI-compatible HTTP endpoint the controller serves to agents (aiohttp, in the
controller's event loop).

Routes, per trajectory (``<token>``: the session's secret, 192 random bits; each trajectory has
its own base URL ``http://HOST:PORT/t/<token>/v1``):

- ``POST /t/<token>/v1/chat/completions``: one completion (``rollart.controller.agents.session``);
- ``GET /t/<token>/v1/models``: the one model served (``rollart-policy``).

An unknown token (never issued, or its trajectory ended) gets a 404 ``session_not_found`` error
in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; so does any other path.
A body that is not JSON is a 400. A client that disconnects while its completion is generating
(e.g. its own read timeout) cancels the handler (``handler_cancellation``), which cancels the
generate call: the inference client sends ``Abort``, so the vLLM request is aborted on the worker
(counted in ``WorkerStats.num_aborted``), not left to finish; nothing of that call is recorded,
the trajectory goes on, and the agent may send the same request again.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from rollart.controller.agents.params import BadParam, parse_request
from rollart.controller.agents.session import MODEL_ID, AgentSession, ApiError

log = logging.getLogger(__name__)

#: largest request body accepted (a long agent conversation as JSON)
MAX_BODY_BYTES = 64 * 1024 * 1024


#: loggers of the HTTP clients agents use (openai's may come as ``httpx2``)
CLIENT_LOGGERS = ("httpx", "httpx2")


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


class _NoAgentRequestLines(logging.Filter):
    """Drops an HTTP client's per-request log line for this endpoint's URLs: one line per
    completion (noise at scale), each naming a trajectory's secret path. Other URLs' lines
    pass (every record is also redacted: ``rollart.logredact``)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where  # "host:port/t/"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.where not in record.getMessage()


class AgentServer:
    """The endpoint; sessions are added by the runner for as long as their trajectory runs.

    Args:
        host: address to bind (loopback by default: agents in the driver's process or on this
            machine; bind another address only on a trusted network, the token is the only key).
        port: TCP port; 0 picks a free one (see :attr:`port` once started).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self._port = host, port
        self.sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None
        self._quiet: _NoAgentRequestLines | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/t/{token}/v1/chat/completions", self._completions)
        app.router.add_get("/t/{token}/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("agent endpoint on http://%s:%d/t/<token>/v1", self.host, self.port)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        self._quiet = _NoAgentRequestLines(f"{host}:{self.port}/t/")
        for name in CLIENT_LOGGERS:
            logging.getLogger(name).addFilter(self._quiet)

    async def close(self) -> None:
        if self._quiet is not None:
            for name in CLIENT_LOGGERS:
                logging.getLogger(name).removeFilter(self._quiet)
            self._quiet = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, session: AgentSession) -> str:
        """The OpenAI ``base_url`` of ``session``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/t/{session.token}/v1"

    def _session(self, request: web.Request) -> AgentSession:
        session = self.sessions.get(request.match_info["token"])
        if session is None or session.ended.done():
            raise ApiError(404, "session_not_found", "no running trajectory has this URL (it "
                           "ended, or was never issued)", kind="not_found_error")
        return session

    async def _not_found(self, request: web.Request) -> web.Response:
        return _error(ApiError(404, "not_found", f"no route {request.method} {request.path}",
                               kind="not_found_error"))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as exc:
            return _error(exc)
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rollart"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            try:
                body: Any = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, "invalid_json", f"the body is not JSON: {exc}") from None
            except RecursionError:
                raise ApiError(400, "invalid_json", "the body nests too deeply") from None
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, "request_too_large", f"the body is over {MAX_BODY_BYTES} "
                               "bytes") from None
            try:
                req = parse_request(body, session.domain.sampling.temperature)
            except BadParam as exc:
                raise ApiError(400, exc.code, str(exc), exc.param) from None
            return web.json_response(await session.complete(req))
        except ApiError as exc:
            return _error(exc)
        except Exception:  # a bug of ours: still an OpenAI-shaped reply, and logged
            # The route, not the path: the path holds the trajectory's secret.
            resource = request.match_info.route.resource
            log.exception("agent endpoint: %s %s failed", request.method,
                          resource.canonical if resource is not None else "(no route)")
            return _error(ApiError(500, "internal_error", "the endpoint failed on this request "
                                   "(see the controller's log)", kind="server_error"))
