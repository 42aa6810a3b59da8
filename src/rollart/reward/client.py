"""Async HTTP client of the reward contract, used by the controller.

Works with any endpoint that speaks the contract of :mod:`rollart.reward.protocol`: the rollart
reward service, or e.g. a serverless function URL (put ``{name}`` in ``base_url`` when the function
name is not a ``/v1/reward/{name}`` path suffix).

Retry policy: a call is retried up to ``max_retries`` times on a connection error, HTTP 429 or
a 5xx other than 504, sleeping ``min(backoff_s * 2**attempt, max_backoff_s)`` seconds between
tries (or the server's ``Retry-After`` when given and larger, capped the same way). A timeout
(HTTP 504, or no reply within ``timeout_s``) is retried only with ``retry_timeouts=True``: a
function that hung once usually hangs again, and each retry would start it again. Other 4xx are
the caller's fault and are not retried. A call that still fails raises ``RewardError`` (never a
reward of 0).

Size limits: a reply body over ``max_reply_bytes`` is not read past the limit, and a 200 whose
``details`` encode to more than ``max_details_bytes`` is refused: both raise
:class:`RewardTooLargeError` (the trajectory fails with reason ``reward_too_large``), so nothing
oversized reaches a sample or a checkpoint.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from rollart.reward.protocol import RewardRequest
from rollart.transport.errors import RewardError, RewardTooLargeError

#: ``max_reply_bytes`` default: a reward reply is a float and a small details object
DEFAULT_MAX_REPLY_BYTES = 1 << 20
#: ``max_details_bytes`` default (JSON-encoded ``details``; kept in each sample's metadata)
DEFAULT_MAX_DETAILS_BYTES = 64 << 10


class RewardResult(msgspec.Struct, frozen=True):
    """A successful reward: ``reward`` is finite; ``details`` is function-specific."""

    reward: float
    details: dict[str, Any] = msgspec.field(default_factory=dict)


_result_decoder = msgspec.json.Decoder(RewardResult)
_encoder = msgspec.json.Encoder()


def _is_retryable(status: int, retry_timeouts: bool) -> bool:
    if status == 504:
        return retry_timeouts
    return status == 429 or status >= 500


class RewardClient:
    """Pooled, concurrency-limited client; use as ``async with RewardClient(url) as client``.

    Args:
        base_url: service root (``http://127.0.0.1:8000``; ``/v1/reward/{name}`` is appended) or a
            URL template containing ``{name}``.
        max_concurrency: calls in flight at once (also the connection-pool size), >= 1.
        timeout_s: limit of one HTTP attempt (connect + send + wait + read), seconds, > 0.
        max_retries: extra attempts after the first on retryable failures, >= 0.
        backoff_s: first retry delay in seconds; doubles per retry, capped at ``max_backoff_s``.
        max_backoff_s: cap of one retry delay, seconds.
        retry_timeouts: also retry HTTP 504 and client-side timeouts (off: a hung function is
            not started again by the retries).
        max_reply_bytes: largest reply body read, bytes (>= 1024).
        max_details_bytes: largest JSON-encoded ``details`` accepted, bytes (>= 2).
        token: bearer token sent as ``Authorization: Bearer <token>`` on every call
            (``rollart.reward.auth``); a wrong one gets HTTP 401, which is not retried.

    Raises:
        ValueError: a bad argument (named in the message).
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_concurrency: int = 64,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        retry_timeouts: bool = False,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_details_bytes: int = DEFAULT_MAX_DETAILS_BYTES,
        token: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                f"backoff_s and max_backoff_s must be >= 0, got {backoff_s}, {max_backoff_s}"
            )
        if max_reply_bytes < 1024 or max_details_bytes < 2:
            raise ValueError(
                "max_reply_bytes must be >= 1024 and max_details_bytes >= 2, got "
                f"{max_reply_bytes}, {max_details_bytes}"
            )
        self.retry_timeouts = retry_timeouts
        self.max_reply_bytes = max_reply_bytes
        self.max_details_bytes = max_details_bytes
        self.base_url = base_url
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._headers = {"Content-Type": "application/json"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RewardClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_concurrency),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers=self._headers,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; later calls raise RuntimeError."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url_for(self, name: str) -> str:
        """The URL that scores with function ``name``."""
        if "{name}" in self.base_url:
            return self.base_url.replace("{name}", quote(name, safe=""))
        return f"{self.base_url.rstrip('/')}/v1/reward/{quote(name, safe='')}"

    async def list_functions(self) -> list[dict[str, Any]]:
        """``GET /v1/reward`` of a rollart service (one attempt). Raises RewardError."""
        session = self._require_session()
        url = f"{self.base_url.rstrip('/')}/v1/reward"
        try:
            async with self._semaphore, session.get(url) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RewardError(f"listing functions at {url}: {_reason(body)}", resp.status)
                return msgspec.json.decode(body)["functions"]
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, KeyError) as exc:
            raise RewardError(f"listing functions at {url}: {type(exc).__name__}: {exc}") from exc

    async def score(
        self,
        name: str,
        prompt: str,
        response: str,
        reference: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> RewardResult:
        """Score one response with reward function ``name``.

        Returns:
            RewardResult with a finite ``reward``.

        Raises:
            RewardTooLargeError: the reply body or its ``details`` exceed the limits (no retry).
            RewardError: ``status`` is the last HTTP status (``None`` after a timeout or
                connection error); ``reason`` names the function, the attempts and the cause.
            msgspec.EncodeError: ``reference`` / ``metadata`` are not JSON-serialisable.
        """
        session = self._require_session()
        url = self.url_for(name)
        body = _encoder.encode(
            RewardRequest(
                prompt=prompt, response=response, reference=reference, metadata=metadata or {}
            )
        )
        attempt = 0
        while True:
            status, reason, retry_after = None, "", None
            try:
                async with self._semaphore, session.post(url, data=body) as resp:
                    status = resp.status
                    payload = await self._read_capped(name, resp)
                    if status == 200:
                        return self._decode(name, payload)
                    reason = _reason(payload)
                    retry_after = _retry_after(resp.headers.get("Retry-After"))
            except TimeoutError:
                reason = f"no reply within timeout_s={self.timeout_s:g}"
            except aiohttp.ClientError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if status is None:
                retryable = self.retry_timeouts or not reason.startswith("no reply within")
            else:
                retryable = _is_retryable(status, self.retry_timeouts)
            if not retryable or attempt >= self.max_retries:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise RewardError(f"reward {name!r} at {url}{tries}: {reason}", status)
            delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
            if retry_after is not None:
                delay = min(max(delay, retry_after), self.max_backoff_s)
            attempt += 1
            await asyncio.sleep(delay)

    async def _read_capped(self, name: str, resp: aiohttp.ClientResponse) -> bytes:
        """The body, refusing one over ``max_reply_bytes`` without reading it all."""
        limit = self.max_reply_bytes
        if resp.content_length is not None and resp.content_length > limit:
            resp.close()
            raise RewardTooLargeError(
                f"reward {name!r}: reply of {resp.content_length} bytes exceeds max_reply_bytes"
                f" = {limit}", resp.status)
        chunks, size = [], 0
        while True:
            chunk = await resp.content.read(min(65536, limit + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                resp.close()
                raise RewardTooLargeError(
                    f"reward {name!r}: reply body exceeds max_reply_bytes = {limit}", resp.status)

    def _decode(self, name: str, payload: bytes) -> RewardResult:
        # A 200 with a broken body is the endpoint's bug; it is not retried (it would repeat).
        try:
            result = _result_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise RewardError(f"reward {name!r}: invalid 200 reply: {exc}", 200) from None
        if not math.isfinite(result.reward):
            raise RewardError(f"reward {name!r}: non-finite reward {result.reward!r}", 200)
        if result.details:
            size = len(_encoder.encode(result.details))
            if size > self.max_details_bytes:
                raise RewardTooLargeError(
                    f"reward {name!r}: details of {size} bytes (JSON) exceed max_details_bytes = "
                    f"{self.max_details_bytes}", 200)
        return result

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("RewardClient is not open: use 'async with RewardClient(...)'")
        return self._session


def _reason(payload: bytes) -> str:
    """The ``error`` of a JSON error body, else the body's first 500 characters."""
    try:
        decoded = msgspec.json.decode(payload)
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
            return decoded["error"]
    except msgspec.DecodeError:
        pass
    text = payload.decode("utf-8", errors="replace").strip()
    return text[:500] or "(empty body)"


def _retry_after(value: str | None) -> float | None:
    # Only the delta-seconds form; an HTTP-date Retry-After is ignored (backoff applies).
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
