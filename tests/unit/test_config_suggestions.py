"""Errors on a mistyped scenario value or key suggest the intended name, and never the name
that means the opposite."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.config import ConfigError, parse_scenario
from rollart.config.validate import suggest

MINIMAL = (Path(__file__).resolve().parents[1] / "minimal_scenario.toml").read_text()


@pytest.mark.parametrize(("text", "expect"), [
    (MINIMAL.replace("[run]", "[run]\nbatch_sze = 8"),
     "run: Object contains unknown field `batch_sze` (did you mean 'batch_size'?)"),
    (MINIMAL.replace('pool = "cpu"', 'pool = "cpu"\nrewrd_url = "local"'),
     "domains[0]: Object contains unknown field `rewrd_url` (did you mean 'reward_url'?)"),
    (MINIMAL + '\n[run.worker_checks]\nagreemnt_policy = "stop"\n',
     "(did you mean 'agreement_policy'?)"),
    (MINIMAL + "\n[trainr]\nlr = 1e-6\n", "unknown field `trainr` (did you mean 'trainer'?)"),
    (MINIMAL + "\n[trainer]\nzzzz = 1\n", "trainer takes ['lr', "),
    (MINIMAL.replace("[run]", '[run]\nmode = "rolart"'), "(did you mean 'rollart'?)"),
])
def test_key_and_value_typos_name_the_intended_one(text, expect) -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario(text)
    assert expect in str(err.value)


def test_async_mode_lists_the_asynchronous_modes_not_sync() -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario(MINIMAL.replace("[run]", '[run]\nmode = "async"'))
    text = str(err.value)
    assert "one of ['areal', 'one_off', 'rollart', 'sync', 'sync_plus']" in text
    assert "'sync'?" not in text and "mode 'one_off', 'areal' or 'rollart'" in text


def test_a_negated_name_is_never_suggested() -> None:
    assert suggest("async", ["sync", "areal"]) == ""
    assert suggest("nonblocking", ["blocking"]) == ""
    assert suggest("unsafe", ["safe"]) == ""
    assert suggest("snyc", ["sync", "areal"]) == " (did you mean 'sync'?)"


def test_every_unknown_key_is_named_not_only_the_first() -> None:
    text = (MINIMAL.replace("[run]", "[run]\nbatch_sze = 8\ngrup_size = 2")
            .replace('pool = "cpu"', 'pool = "cpu"\nrewrd_url = "local"')
            + "\n[trainr]\nlr = 1e-6\n")
    with pytest.raises(ConfigError) as err:
        parse_scenario(text, "two.toml")
    msg = str(err.value)
    for part in ("run: Object contains unknown field `batch_sze` (did you mean 'batch_size'?)",
                 "run: Object contains unknown field `grup_size` (did you mean 'group_size'?)",
                 "domains[0]: Object contains unknown field `rewrd_url` (did you mean "
                 "'reward_url'?)",
                 "unknown field `trainr` (did you mean 'trainer'?)"):
        assert part in msg, (part, msg)
    assert msg.startswith("two.toml: ")
