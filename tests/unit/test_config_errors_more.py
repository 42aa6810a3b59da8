"""A scenario error names everything wrong with the file's keys at once: unknown keys beside a
bad value (msgspec stops at its first error), top-level keys located and pointed to the table
that takes them, and ``env_options`` an env would refuse at every session open."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.cli import main as cli
from rollart.config import ConfigError, parse_scenario

MINIMAL = (Path(__file__).resolve().parents[1] / "minimal_scenario.toml").read_text()
RUN_TAKES = "the scenario takes ['pools', 'domains', 'run', "


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_scenario(text, "s.toml")
    message = str(err.value)
    assert message.startswith("s.toml: "), message
    return message


def _with_options(env: str, options: str) -> str:
    return (MINIMAL.replace("rg:basic_arithmetic", env)
            .replace('pool = "cpu"', f'pool = "cpu"\nenv_options = {{ {options} }}'))


def _with_two_domains(env: str, options: str, old: str, new: str) -> str:
    """``_with_options(env, options)`` plus a copy of its domain named 'arith2', with
    ``old`` replaced by ``new`` in the copy."""
    text = _with_options(env, options)
    dom = text[text.index("[[domains]]"):]
    dom = dom[:dom.index("\n[", 1)] if "\n[" in dom[1:] else dom
    return text + "\n" + dom.replace('name = "arith"', 'name = "arith2"').replace(old, new)


# --- a bad value no longer hides the unknown keys, nor an unknown key the bad value ---------


def test_a_bad_value_is_named_with_every_unknown_key_after_it() -> None:
    msg = _error(MINIMAL.replace("[run]", "[run]\nsteps = 0\nmdoe = 'sync'")
                 + "\n[trainr]\nlr = 1e-6\n")
    assert msg.startswith("s.toml: run.steps: Expected `int` >= 1; "), msg
    assert "run: Object contains unknown field `mdoe` (did you mean 'mode'?)" in msg
    assert "top level of the file: Object contains unknown field `trainr` (did you mean " \
           "'trainer'?)" in msg


def test_a_bad_value_after_an_unknown_key_is_named_too() -> None:
    msg = _error(MINIMAL.replace("[run]", "[run]\nmdoe = 'sync'\nselection = 'frist'"))
    assert msg == ("s.toml: run: Object contains unknown field `mdoe` (did you mean 'mode'?); "
                   "run.selection: Invalid enum value 'frist'; one of ['first', 'unbiased'] "
                   "(did you mean 'first'?)")


def test_a_misspelt_required_table_is_not_also_reported_missing() -> None:
    msg = _error(MINIMAL.replace("[[domains]]", "[[domain]]"))
    assert msg == ("s.toml: top level of the file: Object contains unknown field `domain` "
                   "(did you mean 'domains'?)")


def test_unknown_keys_under_a_table_of_named_entries_are_found() -> None:
    msg = _error(MINIMAL + '[[env_hosts]]\nname = "e"\n[env_hosts.latency.game]\n'
                 'distribution = "normal"\nmean = 1\n')
    assert "env_hosts[0].latency.game: Object contains unknown field `mean` (did you mean " \
           "'mean_s'?)" in msg


# --- top-level keys: located, the tables listed once, a misplaced key pointed home ----------


@pytest.mark.parametrize(("key", "hint"), [
    ("stpes", "(did you mean [run] steps?)"),
    ("steps", "(did you mean [run] steps?)"),
    ("seed", "(did you mean [run] seed or [eval] seed?)"),
    ("temprature", "(did you mean [domains.sampling] temperature?)"),
])
def test_a_misplaced_top_level_key_names_the_table_that_takes_it(key, hint) -> None:
    msg = _error(f"{key} = 3\n" + MINIMAL)
    assert msg.startswith(f"s.toml: top level of the file: Object contains unknown field "
                          f"`{key}` {hint}; {RUN_TAKES}"), msg


def test_the_top_level_tables_are_listed_once() -> None:
    msg = _error("zzzz = 1\nqqqq = 2\nstpes = 3\n" + MINIMAL)
    assert msg.count(RUN_TAKES) == 1, msg
    assert msg.endswith("'output', 'eval']"), msg
    for key in ("zzzz", "qqqq", "stpes"):
        assert f"top level of the file: Object contains unknown field `{key}`" in msg


def test_a_nested_key_of_another_table_is_pointed_there() -> None:
    msg = _error(MINIMAL.replace("[run]", "[run]\nlr = 1e-5"))
    assert msg.startswith("s.toml: run: Object contains unknown field `lr` (did you mean "
                          "[trainer] lr?); run takes ['seed', "), msg


# --- env_options: checked against the env's own option names --------------------------------


@pytest.mark.parametrize(("env", "options", "expect"), [
    ("rg:basic_arithmetic", "min_term = 2, max_terms = 2",
     "s.toml: domains[0].env_options: domain 'arith', env 'rg:basic_arithmetic': unknown "
     "option 'min_term' (did you mean 'min_terms'?); accepted: ['allow_negation', "
     "'allow_parentheses', 'format_style', 'max_digits', 'max_terms', 'min_digits', "
     "'min_terms', 'operators', 'size', 'whitespace']"),
    ("rg:basic_arithmetic", "seed = 1",
     "unknown option 'seed' (each group's env seed is drawn from run.seed); accepted: "),
    ("game:GuessTheNumber-v0-easy", "max_numbr = 5, zzz = 3",
     "s.toml: domains[0].env_options: domain 'arith', env 'game:GuessTheNumber-v0-easy': "
     "unknown options 'max_numbr' (did you mean 'max_number'?), 'zzz'; accepted: "
     "['max_number', 'max_turns', 'min_number']"),
    # a value with a line break stays on the refusal's one line
    ("rg:basic_arithmetic", 'operators = ["+\\n-"]',
     "reasoning-gym refuses them: AssertionError: unsupported operator: +\\n-"),
    ("rg:basic_arithmetic", "min_terms = 5, max_terms = 3",
     "env 'rg:basic_arithmetic': reasoning-gym refuses them: AssertionError: max_terms must "
     "be >= min_terms"),
    ("rg:spell_backward", 'data_file = "/etc/passwd"',
     "options naming files may only name a file of the dataset package's own data"),
    # values reasoning-gym's config check lets through but its first entry cannot be drawn with
    ("rg:basic_arithmetic", "min_terms = 2.5",
     "env 'rg:basic_arithmetic': reasoning-gym cannot draw an entry with options "
     "{'min_terms': 2.5} (seeds 0-4 all failed, so every session would fail): ValueError: "
     "non-integer arg 1 for randrange()"),
    ("rg:spell_backward", 'data_file = "nonexistent.txt"',
     "(seeds 0-4 all failed, so every session would fail): FileNotFoundError: "),
])
def test_env_options_the_env_would_refuse_are_refused(env, options, expect) -> None:
    assert expect in _preflight_error(_with_options(env, options))


def _preflight_error(text: str, local_envs=()) -> str:
    from rollart.launcher.local import preflight

    with pytest.raises(ConfigError) as err:
        preflight(parse_scenario(text + '\n[[env_hosts]]\nname = "envs"\n', "s.toml"),
                  "s.toml", local_envs=local_envs)
    return str(err.value)


def test_every_domain_with_refused_env_options_is_named_in_one_error() -> None:
    two = _with_two_domains("rg:basic_arithmetic", "min_term = 2", "min_term", "max_term")
    msg = _preflight_error(two)
    assert "domains[0].env_options: domain 'arith'" in msg and "'min_term'" in msg, msg
    assert "domains[1].env_options: domain 'arith2'" in msg and "'max_term'" in msg, msg


def test_an_env_served_in_process_takes_whatever_its_factory_takes() -> None:
    from rollart.launcher.local import preflight

    sc = parse_scenario(_with_options("rg:basic_arithmetic", "foo = 2"), "s.toml")
    preflight(sc, "s.toml", local_envs={"rg:basic_arithmetic"})  # its factory's options
    assert "unknown option 'foo'" in _preflight_error(
        _with_options("rg:basic_arithmetic", "foo = 2"))


@pytest.mark.parametrize(("env", "options"), [
    ("rg:basic_arithmetic", "min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1"),
    ("game:GuessTheNumber-v0-easy", "max_number = 20, max_turns = 5"),
    # the env host imports py: envs, from its own path: nothing to look up here
    ("py:nowhere.to.be:Found", "anything = 1"),
    # an unknown env name is the preflight's to refuse (or an in-process env's own name)
    ("script:echo", "turns = 3"),
    ("rg:no_such_dataset", "x = 1"),
])
def test_env_options_that_cannot_be_told_wrong_here_pass(env, options) -> None:
    from rollart.config.envoptions import check_env_options

    check_env_options(parse_scenario(_with_options(env, options), "s.toml"), "s.toml")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_refuse_an_env_option_typo(tmp_path, capsys, command) -> None:
    sc = tmp_path / "s.toml"
    sc.write_text(_with_options("rg:basic_arithmetic", "min_term = 2")
                  + '\n[[env_hosts]]\nname = "envs"\n')
    out_dir = tmp_path / "run"
    extra = ["--out", str(out_dir)] if command == "run" else ["--quiet"]
    # valid as a file (exit 1 from validate: `rollart run` would refuse it; 2 from run)
    assert cli([command, str(sc), *extra]) == (1 if command == "validate" else 2)
    err = capsys.readouterr().err
    assert f"{sc}: domains[0].env_options: domain 'arith'" in err, err
    assert "(did you mean 'min_terms'?)" in err
    assert not out_dir.exists()


def test_a_key_another_table_takes_as_it_is_is_pointed_there_before_a_near_own_field() -> None:
    # `every` is near run's `retry` by spelling, but it is [eval]'s field as written
    msg = _error(MINIMAL.replace("[run]", "[run]\nevery = 5"))
    assert "run: Object contains unknown field `every` (did you mean [eval] every?)" in msg, msg
    msg = _error(MINIMAL.replace('[[domains]]', '[[domains]]\nweight_decay = 0.01'))
    assert "`weight_decay` (did you mean [trainer] weight_decay?)" in msg, msg


def test_a_mistyped_table_is_offered_tables_only() -> None:
    msg = _error("[evaluation]\nx = 1\n" + MINIMAL)
    assert "unknown field `evaluation` (did you mean 'eval'?)" in msg, msg
    msg = _error("[checkpoint]\nx = 1\n" + MINIMAL)
    assert "checkpoint_every" not in msg.partition(";")[0], msg


def test_a_misspelled_required_key_does_not_hide_a_bad_value_after_it() -> None:
    # the bad value after the typo in the file: msgspec stops at the missing `name`
    text = MINIMAL.replace('name = "arith"', 'nme = "arith"') + '\n[trainer]\nlr = "x"\n'
    msg = _error(text)
    assert "domains[0]: Object contains unknown field `nme` (did you mean 'name'?)" in msg, msg
    assert "missing required field" not in msg, msg
    assert "trainer.lr: Expected `float`, got `str`" in msg, msg


def test_env_options_some_seeds_can_draw_with_pass_and_a_printing_generator_stays_off_stdout(
        tmp_path, capsys) -> None:
    from rollart.config.envdraw import draw_problems

    # countdown with these targets fails on some seeds and draws on others: the env host
    # re-draws a failed open, so the run is not refused for seed 0's luck
    opts = {"min_numbers": 3, "max_numbers": 3, "min_value": 1, "max_value": 8,
            "min_target": 100, "max_target": 125}
    assert draw_problems([("countdown", opts), ("bf", {"size": 10})]) == [None, None]
    # rg:bf prints while it generates: validate's stdout stays the resolved scenario (JSON)
    sc = tmp_path / "s.toml"
    sc.write_text(_with_options("rg:bf", "size = 10") + '\n[[env_hosts]]\nname = "envs"\n')
    assert cli(["validate", str(sc)]) == 0
    json.loads(capsys.readouterr().out)


def test_a_draw_that_never_ends_is_stopped_at_its_deadline() -> None:
    from rollart.config.envdraw import draw_problems

    # no end cell distinct from the start in a 1x1 grid: reasoning-gym loops without end
    opts = {"min_rows": 1, "max_rows": 1, "min_cols": 1, "max_cols": 1}
    # each domain's draws have their own alarm (in the child, after its imports)
    assert draw_problems([("shortest_path", opts), ("chain_sum", {})], timeout_s=2.0) == [
        "drawing an entry of rg:shortest_path with options {'min_rows': 1, 'max_rows': 1, "
        "'min_cols': 1, 'max_cols': 1} did not finish within 2 s (each session draws one "
        "when it opens)", None]


def test_draws_see_the_options_as_sessions_receive_them_and_many_domains_pass() -> None:
    from rollart.config.envdraw import draw_problems

    # inf travels to the env host as it is (msgpack), and no entry can be drawn with it
    got = draw_problems([("basic_arithmetic", {"max_terms": float("inf")})])
    assert "seeds 0-4 all failed" in got[0] and "OverflowError" in got[0], got
    # sixteen valid domains: one child draws them all (no per-domain interpreter to start)
    many = [("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "size": 10 + k})
            for k in range(16)]
    assert draw_problems(many) == [None] * 16


def test_the_draw_child_imports_nothing_from_the_working_directory_or_local_module_folder(
        tmp_path, monkeypatch) -> None:
    from rollart.config.envdraw import draw_problems

    marker = tmp_path / "imported"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "msgspec.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     "raise ImportError('not the real msgspec')\n")
    monkeypatch.chdir(evil)
    monkeypatch.syspath_prepend(str(evil))  # as run.local_module's folder is
    assert draw_problems([("chain_sum", {"min_terms": 2})]) == [None]
    assert not marker.exists()
    # a check that cannot run says so (here: the user's own PYTHONPATH breaks the child)
    monkeypatch.setenv("PYTHONPATH", str(evil))
    got = draw_problems([("chain_sum", {"min_terms": 2})])
    assert got[0].startswith("the draw check could not run (its process exited with code 1: "
                             "ImportError: not the real msgspec"), got


def test_validate_lists_each_domain_whose_env_options_are_refused_on_its_own_line(
        tmp_path, capsys) -> None:
    two = _with_two_domains("rg:basic_arithmetic", "min_term = 2", "min_term", "max_term")
    sc = tmp_path / "s.toml"
    sc.write_text(two + '\n[[env_hosts]]\nname = "envs"\n')
    assert cli(["validate", str(sc), "--quiet"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "env_options" in line]
    assert len(lines) == 2, err
    assert "domain 'arith'," in lines[0] and "domain 'arith2'," in lines[1]
    assert all(line.startswith("rollart validate: error: ") for line in lines)
    assert "2 reason(s) above" in err


def test_every_unknown_env_name_is_named_at_once() -> None:
    two = _with_two_domains("rg:basic_arithmatic", "min_terms = 2", "rg:basic_arithmatic", "rg:chain_sumx")
    msg = _preflight_error(two)
    assert "domains[0].env:" in msg and "domains[1].env:" in msg, msg
