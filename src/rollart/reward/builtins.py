"""Built-in reward functions: ``math``, ``reasoning_gym``, ``exact_match``, ``boxed_format``,
``env_return``, ``env_success``.

All take ``(prompt, response, reference, metadata)`` and return ``(reward, details)`` with reward
in ``{0.0, 1.0}`` (``reasoning_gym`` may return partial credit in ``[0, 1]`` when the dataset's own
scorer does). A *wrong or missing answer* in the response scores 0.0; *unusable input* (a reference
that does not parse, unknown dataset, missing entry) raises :class:`RewardInputError` (HTTP 422),
so a broken request is never silently scored 0.

``math`` and ``reasoning_gym`` run sympy-backed scoring, which is CPU-bound and can be slow on
adversarial input: they are marked ``executor="process"`` so the service runs them in its process
pool under a timeout, never on the event loop.
"""

from __future__ import annotations

import functools
import math as _math
import re
from typing import Any, Literal

from rollart.reward.registry import RewardInputError, reward_function

# Inner limits of math-verify's own SIGALRM-based timeouts; they work because process-pool workers
# run tasks in their main thread. The service's outer timeout (default 30 s) is the backstop.
MATH_PARSE_TIMEOUT_S = 5
MATH_VERIFY_TIMEOUT_S = 5

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced.

    Returns ``None`` if there is none or its braces never close; the content is stripped and may be
    an empty string for ``\boxed{}``.
    """
    for match in reversed(list(_BOX_OPEN.finditer(text))):
        depth = 1
        for j in range(match.end(), len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : j].strip()
        # Unclosed braces: fall back to the previous box rather than giving up.
    return None


def _reference_text(reference: Any, fn: str) -> str:
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
        raise RewardInputError(
            f"{fn}: reference must be a string or number, got {type(reference).__name__}"
        )
    if isinstance(reference, float) and not _math.isfinite(reference):
        raise RewardInputError(f"{fn}: reference must be finite, got {reference!r}")
    text = str(reference).strip()
    if not text:
        raise RewardInputError(f"{fn}: reference is empty")
    return text


def _mv_parse(text: str, configs: list[Any],
              fallback_mode: Literal["no_fallback", "first_match"] = "first_match") -> list[Any]:
    """math-verify parse; [] if nothing parses; TimeoutError if it ran out of time.

    ``fallback_mode="first_match"`` keeps the extracted string next to the sympy value (so a
    string-only answer can still match); ``"no_fallback"`` returns only sympy values."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(
            text,
            extraction_config=configs,
            fallback_mode=fallback_mode,
            parsing_timeout=MATH_PARSE_TIMEOUT_S,
            raise_on_error=True,
        )
    except TimeoutException:
        # math-verify's timeout is a BaseException and, left alone, it would read as "no answer"
        # and so as reward 0: surface it as a failure instead.
        raise TimeoutError(
            f"math-verify took over {MATH_PARSE_TIMEOUT_S} s parsing {text[:200]!r}"
        ) from None
    except Exception:
        return []


def _mv_equal(gold: list[Any], answer: list[Any]) -> bool:
    """True iff any (gold, answer) pair verifies; a comparison error counts as "not equal" as in
    math-verify, but a comparison timeout with no success is raised as TimeoutError."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for g in gold:
        for a in answer:
            try:
                if verify(g, a, timeout_seconds=MATH_VERIFY_TIMEOUT_S, raise_on_error=True):
                    return True
            except TimeoutException:
                timed_out = True
            except Exception:
                continue
    if timed_out:
        raise TimeoutError(f"math-verify took over {MATH_VERIFY_TIMEOUT_S} s comparing answers")
    return False


@reward_function("math", executor="process")
def math_reward(prompt: str, response: str, reference: Any, metadata: dict) -> tuple[float, dict]:
    r"""Math answer check with math-verify: 1.0 iff the final answer equals the reference.

    The final answer is the last ``\boxed{}`` in the response if any, else math-verify's own
    extraction of the last LaTeX / plain expression. The reference (string or number, e.g.
    ``"\frac{1}{2}"`` or ``0.5``) is parsed by math-verify; equivalence is symbolic/numeric
    (``math_verify.verify``, gold first). Raises RewardInputError if the reference does not
    parse, TimeoutError if math-verify runs out of time (never scored as 0).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    ref_text = _reference_text(reference, "math")
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold: list[Any] = []
    if "$" not in ref_text and "\\boxed" not in ref_text:
        # A bare reference (2\pi, \frac{1}{2}, (x+1)^2) is LaTeX without delimiters; the
        # plain-expression extractor alone would read 2\pi as 2.
        gold = _mv_parse(f"${ref_text}$", [LatexExtractionConfig()], "no_fallback")
    if not gold:
        gold = _mv_parse(ref_text, configs, "no_fallback")
    if not gold:
        raise RewardInputError(f"math: reference {ref_text!r} does not parse as a math answer")

    boxed = last_boxed(response)
    if boxed is not None:
        source = "boxed"
        answer = _mv_parse(f"\\boxed{{{boxed}}}", [LatexExtractionConfig(boxed_match_priority=0)])
    else:
        source = "final_expression"
        answer = _mv_parse(response, configs)
    details: dict[str, Any] = {"answer_source": source, "reference_parsed": str(gold[-1])}
    if not answer:
        details["answer"] = boxed
        details["reason"] = "no parseable final answer in the response"
        return 0.0, details
    details["answer"] = str(answer[-1])
    return (1.0 if _mv_equal(gold, answer) else 0.0), details


@functools.lru_cache(maxsize=256)
def _rg_score_fn(dataset: str) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(dataset)
    except (KeyError, ValueError) as exc:
        raise RewardInputError(f"reasoning_gym: unknown dataset {dataset!r}: {exc}") from None


def _rg_answer(response: str, mode: str) -> tuple[str | None, str]:
    from reasoning_gym.utils import extract_answer

    if mode in ("auto", "answer_tag"):
        tagged = extract_answer(response, tag_name="answer", strip=True)
        if tagged is not None or mode == "answer_tag":
            return tagged, "answer_tag"
    if mode in ("auto", "boxed"):
        boxed = last_boxed(response)
        if boxed is not None or mode == "boxed":
            return boxed, "boxed"
    return response.strip(), "raw"


_RG_MODES = ("auto", "answer_tag", "boxed", "raw")


@reward_function("reasoning_gym", executor="process")
def reasoning_gym_reward(
    prompt: str, response: str, reference: Any, metadata: dict
) -> tuple[float, dict]:
    """reasoning-gym: the dataset's own ``score_answer(answer, entry)``, reward in [0, 1].

    metadata: ``{"dataset": name, "entry": entry}`` where ``entry`` is the dataset item as
    generated (``question``, ``answer``, ``metadata``), and optionally ``"extract"``: how to find
    the answer in the response: ``auto`` (default: ``<answer>...</answer>``, else the last
    ``\\boxed{}``, else the whole response), ``answer_tag``, ``boxed`` or ``raw``. ``reference`` is
    not used (the entry carries the answer). Raises RewardInputError on missing/unknown metadata.
    """
    dataset = metadata.get("dataset")
    entry = metadata.get("entry")
    mode = metadata.get("extract", "auto")
    if not isinstance(dataset, str) or not dataset:
        raise RewardInputError("reasoning_gym: metadata.dataset (a dataset name) is required")
    if not isinstance(entry, dict) or "answer" not in entry:
        raise RewardInputError(
            "reasoning_gym: metadata.entry (the dataset item, with 'answer') is required"
        )
    if mode not in _RG_MODES:
        raise RewardInputError(
            f"reasoning_gym: metadata.extract must be one of {_RG_MODES}, got {mode!r}"
        )
    entry = {"metadata": {}, **entry}  # some scorers read entry["metadata"]; don't mutate input
    score_fn = _rg_score_fn(dataset)
    answer, source = _rg_answer(response, mode)
    score = score_fn(answer, entry)
    return float(score), {"dataset": dataset, "answer": answer, "answer_source": source}


@reward_function("exact_match", executor="inline")
def exact_match_reward(
    prompt: str, response: str, reference: Any, metadata: dict
) -> tuple[float, dict]:
    """1.0 iff the response equals the reference after collapsing runs of whitespace.

    Compares the whole response (not an extracted answer), case-sensitively. The reference is a
    string or number; anything else raises RewardInputError.
    """
    ref = " ".join(_reference_text(reference, "exact_match").split())
    got = " ".join(response.split())
    return (1.0 if got == ref else 0.0), {"normalised_response": got, "normalised_reference": ref}


@reward_function("boxed_format", executor="inline")
def boxed_format_reward(
    prompt: str, response: str, reference: Any, metadata: dict
) -> tuple[float, dict]:
    r"""1.0 iff the response contains a non-empty ``\boxed{...}`` answer (braces balanced)."""
    boxed = last_boxed(response)
    return (1.0 if boxed else 0.0), {"boxed": boxed}


@reward_function("env_return", executor="inline")
def env_return_reward(
    prompt: str, response: str, reference: Any, metadata: dict
) -> tuple[float, dict]:
    """The environment's own return: ``metadata["env_return"]``, the sum of the env's per-step
    rewards over the trajectory (the controller sends it), shaping included. GEM's games shape
    it: GuessTheNumber pays ``1 - |guess - target| / range`` for a lost game's last guess, so a
    policy that guesses the middle every turn already earns ~0.7 on 1..10 without reading a
    hint; use ``env_success`` to train on the outcome alone.

    Raises RewardInputError when ``env_return`` is missing or not a finite number.
    """
    return _env_return(metadata, "env_return"), {"num_turns": metadata.get("num_turns")}


#: the return that marks a won episode: GEM's ``LanguageGameReward.success_reward`` (1.0); the
#: partial credit GEM's games pay for a lost episode stays below it.
ENV_SUCCESS_RETURN = 1.0


@reward_function("env_success", executor="inline")
def env_success_reward(
    prompt: str, response: str, reference: Any, metadata: dict
) -> tuple[float, dict]:
    """The outcome of a multi-turn game, free of the env's shaping: 1.0 when the episode was
    won (``metadata["env_return"] >= ENV_SUCCESS_RETURN``: 1.0, GEM's success reward); the
    return itself when it is negative (GEM ends an episode whose reply it cannot parse with
    -0.1: a broken format stays worse than a lost game, so training never trades one for the
    other); else 0.0. A constant answer earns only its win rate.

    Raises RewardInputError when ``env_return`` is missing or not a finite number.
    """
    value = _env_return(metadata, "env_success")
    return env_outcome(value), {"env_return": value, "num_turns": metadata.get("num_turns")}


def env_outcome(env_return: float) -> float:
    """``env_success``'s score of a finite env return (see `env_success_reward`)."""
    if env_return >= ENV_SUCCESS_RETURN:
        return 1.0
    return min(env_return, 0.0)


def _env_return(metadata: dict, fn: str) -> float:
    value = metadata.get("env_return")
    if isinstance(value, bool) or not isinstance(value, int | float) or not _math.isfinite(value):
        raise RewardInputError(
            f"{fn}: metadata.env_return must be a finite number, got {value!r:.80}"
        )
    return float(value)
