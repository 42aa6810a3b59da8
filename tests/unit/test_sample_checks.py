"""``Sample`` and ``TrainSample`` validation look for problems from the first generated token on
(one pass over the mask finds it): the verdicts and messages stay those of a full pass, for
problems before, at and after that token, short and long generations alike."""

from __future__ import annotations

import array
import math

import numpy as np
import pytest

from rollart.controller.buffer.sample import Sample
from rollart.transport import messages as m

PROMPT = 1000


def _fields(gen: list[int], n: int = PROMPT + 200) -> dict[str, array.array]:
    """A sequence of ``n`` tokens whose positions ``gen`` were generated (version 3)."""
    mask = array.array("b", bytes(n))
    versions = array.array("i", [-1]) * n
    lps = array.array("f", bytes(4 * n))
    for t in gen:
        mask[t], versions[t], lps[t] = 1, 3, -0.25
    return {"token_ids": array.array("i", [7]) * n, "loss_mask": mask,
            "behaviour_logprobs": lps, "versions": versions}


def _sample(**f: array.array) -> Sample:
    return Sample(sample_id="g/1", group_key="g", reward=1.0, **f)


def _train(**f: array.array) -> m.TrainSample:
    return m.TrainSample(token_ids=f["token_ids"], loss_mask=f["loss_mask"],
                         behaviour_logprobs=f["behaviour_logprobs"], advantage=0.5,
                         sample_id="g/1")


@pytest.mark.parametrize("gen", [[PROMPT], [PROMPT, PROMPT + 5, PROMPT + 190],
                                 list(range(PROMPT, PROMPT + 150))])
def test_counts_and_min_version_from_the_first_generated_token(gen: list[int]) -> None:
    f = _fields(gen)
    f["versions"][gen[-1]] = 1  # the oldest version is the last generated token's
    s = _sample(**f)
    assert s.num_generated == len(gen)
    assert s.min_version == 1
    assert _train(**f).num_loss_tokens == len(gen)


def test_nothing_generated() -> None:
    s = _sample(**_fields([]))
    assert (s.num_generated, s.min_version) == (0, None)
    assert (_sample(**_fields([], n=0)).num_generated, _sample(**_fields([], n=0)).min_version) \
        == (0, None)
    with pytest.raises(ValueError, match="no generated token"):
        _train(**_fields([]))


@pytest.mark.parametrize("where", [5, PROMPT, PROMPT + 100])
def test_a_mask_value_above_one_anywhere_is_refused(where: int) -> None:
    f = _fields([PROMPT + 1, PROMPT + 50])
    f["loss_mask"][where] = 2
    with pytest.raises(ValueError, match="loss_mask values must be 0 or 1"):
        _sample(**f)
    with pytest.raises(ValueError, match="loss_mask values must be 0 or 1"):
        _train(**f)


def test_negative_version_of_a_generated_token_names_its_position() -> None:
    f = _fields([PROMPT, PROMPT + 7, PROMPT + 9])
    f["versions"][PROMPT + 7] = -2
    with pytest.raises(ValueError, match=rf"generated token {PROMPT + 7} has version -2"):
        _sample(**f)
    # a negative version where nothing was generated is the convention (-1), not an error
    ok = _fields([PROMPT])
    ok["versions"][3] = -5
    assert _sample(**ok).min_version == 3


@pytest.mark.parametrize("num_gen", [3, 150])  # the item-by-item and the vectorised check
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.5])
def test_a_bad_logprob_of_a_generated_token_is_refused(num_gen: int, bad: float) -> None:
    gen = list(range(PROMPT, PROMPT + num_gen))
    f = _fields(gen)
    f["behaviour_logprobs"][gen[-1]] = bad
    with pytest.raises(ValueError, match="behaviour logprob .* must be finite and <= 0") as e:
        _train(**f)
    shown = float(str(e.value).split("logprob ")[1].split(" ")[0])
    assert (math.isnan(shown) and math.isnan(bad)) or shown == bad
    # the same value where nothing was generated is not the trainer's concern
    g = _fields(gen)
    g["behaviour_logprobs"][3] = bad
    assert _train(**g).num_tokens == PROMPT + 200


def test_mask_at_zero_and_negative_ids_still_refused() -> None:
    f = _fields([0, PROMPT])
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must be 0"):
        _train(**f)
    g = _fields([PROMPT])
    g["token_ids"][4] = -1
    with pytest.raises(ValueError, match="negative token id"):
        _train(**g)


def test_numpy_views_stay_zero_copy() -> None:
    f = _fields([PROMPT])
    s = _sample(**f)
    assert np.asarray(s.token_ids).base is not None
    assert s.token_ids.obj is f["token_ids"]
