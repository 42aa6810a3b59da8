"""User reward functions loaded by test_reward_service.py via ``--functions reward_user_functions``.

Each misbehaves in one way the service must report as an error (never as a reward of 0), except
``length_bonus`` and ``async_echo`` which are well-behaved user functions.
"""

from __future__ import annotations

import asyncio
import time

from rollart.reward.registry import RewardInputError, reward_function


@reward_function("length_bonus")
def length_bonus(prompt, response, reference, metadata):
    """Well-behaved sync user function: min(1, len(response) / metadata['target_len'])."""
    target = metadata.get("target_len")
    if not isinstance(target, int) or target <= 0:
        raise RewardInputError("metadata.target_len must be a positive int")
    return min(1.0, len(response) / target), {"length": len(response)}


@reward_function("async_echo")
async def async_echo(prompt, response, reference, metadata):
    """Well-behaved async user function: the float in the response."""
    await asyncio.sleep(0)
    return float(response)


@reward_function("raises")
def raises(prompt, response, reference, metadata):
    """Always raises."""
    raise RuntimeError("user function exploded on purpose")


@reward_function("returns_nan")
def returns_nan(prompt, response, reference, metadata):
    """Returns NaN."""
    return float("nan")


@reward_function("returns_none")
def returns_none(prompt, response, reference, metadata):
    """Returns None."""
    return None


@reward_function("returns_text")
def returns_text(prompt, response, reference, metadata):
    """Returns a string instead of a number."""
    return "1.0"


@reward_function("hangs", timeout_s=1.0)
def hangs(prompt, response, reference, metadata):
    """Sleeps far past its 1 s timeout (in a pool thread, so the loop stays free)."""
    time.sleep(30)
    return 1.0


@reward_function("hangs_forever", timeout_s=1.0)
def hangs_forever(prompt, response, reference, metadata):
    """Never returns within the test (a thread call: it is abandoned past its 1 s timeout)."""
    time.sleep(3600)
    return 1.0


@reward_function("hangs_in_process", executor="process", timeout_s=1.0)
def hangs_in_process(prompt, response, reference, metadata):
    """Never returns within the test (its worker process is killed past the 1 s timeout)."""
    time.sleep(3600)
    return 1.0


@reward_function("huge_details")
def huge_details(prompt, response, reference, metadata):
    """A valid reward with 2 MB of details (the client refuses it: RewardTooLargeError)."""
    return 1.0, {"blob": "x" * (2 << 20)}
