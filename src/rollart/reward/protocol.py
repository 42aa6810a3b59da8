"""HTTP contract of the reward service (JSON bodies as msgspec Structs) and result validation.

``POST /v1/reward/{name}``
    request  ``{"prompt": str, "response": str, "reference": any, "metadata": object}``
    (``metadata`` optional, default ``{}``; unknown fields are rejected)
    200      ``{"reward": float, "details": object}``
    4xx/5xx  ``{"error": str}`` naming the problem.

Status codes: 400 malformed JSON / bad fields, 404 unknown function, 413 body too large,
422 the function rejected the input or returned an invalid reward, 429 server saturated,
500 the function raised, 503 the scoring pool is broken, 504 the function timed out.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

from rollart.transport.messages import ErrorResponse, RewardRequest, RewardResponse

__all__ = ["ErrorResponse", "InvalidRewardError", "RewardRequest", "RewardResponse",
           "validate_result"]


class InvalidRewardError(ValueError):
    """A reward function returned something that is not a valid reward (HTTP 422)."""


def validate_result(name: str, result: Any) -> RewardResponse:
    """Check a reward function's return value and wrap it.

    Accepts a finite real number (int, float, numpy scalar; not bool) or a ``(reward, details)``
    tuple/list whose ``details`` is a dict with string keys.

    Raises:
        InvalidRewardError: ``None``, NaN, +-inf, bool, a non-number, or bad details; the
            message names the function and what it returned.
    """
    details: Any = {}
    reward = result
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise InvalidRewardError(
                f"reward function {name!r} returned a sequence of length {len(result)}; "
                "expected reward or (reward, details)"
            )
        reward, details = result
    if reward is None:
        raise InvalidRewardError(f"reward function {name!r} returned None instead of a reward")
    if isinstance(reward, bool) or not isinstance(reward, Real):
        raise InvalidRewardError(
            f"reward function {name!r} returned {type(reward).__name__} {reward!r:.80}; "
            "expected a finite float"
        )
    value = float(reward)
    if not math.isfinite(value):
        raise InvalidRewardError(f"reward function {name!r} returned a non-finite reward {value!r}")
    if details is None:
        details = {}
    if not isinstance(details, dict) or not all(isinstance(k, str) for k in details):
        raise InvalidRewardError(
            f"reward function {name!r} returned details of type {type(details).__name__}; "
            "expected a dict with string keys"
        )
    return RewardResponse(reward=value, details=details)
