"""Field docs of the scenario: visible in help(), rendered as docs/scenario-reference.md (kept
in sync), and the launcher's per-user cache dir and warm-up-set warning."""

from __future__ import annotations

import pydoc
from pathlib import Path

import msgspec

from rollart import config
from rollart.configdoc import TABLES, scenario_reference
from rollart.launcher.local import default_cache_dir, warmup_set_change

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


def test_help_shows_every_field_with_its_comment() -> None:
    text = pydoc.render_doc(config.DomainConfig, renderer=pydoc.plaintext)
    for f in msgspec.structs.fields(config.DomainConfig):
        assert f"{f.name}: " in text, f.name
    assert "relative frequency of this domain's groups" in text  # weight's #: comment
    assert "weight: float (> 0) = 1.0" in text
    run = " ".join(pydoc.render_doc(config.RunConfig, renderer=pydoc.plaintext).split())
    assert "A turn that reaches it ends the episode" in run


def test_scenario_reference_page_is_generated_from_the_config() -> None:
    page = (ROOT / "docs" / "scenario-reference.md").read_text()
    start, end = "<!-- scenario-reference:start -->\n", "<!-- scenario-reference:end -->"
    assert start in page and end in page
    copy = page.split(start, 1)[1].split(end, 1)[0]
    assert copy == scenario_reference(), (
        "docs/scenario-reference.md is out of date: regenerate it with "
        "`python -m rollart.configdoc`")


def test_reference_does_not_depend_on_import_order() -> None:
    # typing caches Annotated[float, Meta(gt=0, le=1)] under the equal Meta(gt=0.0, le=1.0)
    # of rollart.transport.messages when that is imported first (as a full test run does).
    import subprocess
    import sys

    code = ("import rollart.transport.messages, sys; from rollart.configdoc import "
            "scenario_reference; sys.stdout.write(scenario_reference())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out == scenario_reference()


def test_reference_covers_every_config_class_of_the_scenario() -> None:
    def structs(cls, seen):
        for f in msgspec.structs.fields(cls):
            for t in (msgspec.inspect.type_info(f.type),):
                for sub in _struct_types(t):
                    if sub not in seen:
                        seen.add(sub)
                        structs(sub, seen)
        return seen

    classes = {c.__name__ for c in structs(config.Scenario, set())} - {"LatencyConfig"}
    assert classes <= set(TABLES.values()), classes - set(TABLES.values())


def _struct_types(info):
    mi = msgspec.inspect
    if isinstance(info, mi.StructType):
        yield info.cls
    for attr in ("types", "item_type", "value_type"):
        sub = getattr(info, attr, None)
        for s in sub if isinstance(sub, tuple) else [sub] if sub is not None else []:
            yield from _struct_types(s)


def test_cache_dir_is_per_user_not_the_working_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("ROLLART_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "rollart"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "rollart"
    monkeypatch.setenv("ROLLART_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_warns_when_the_tiny_models_warm_up_set_changes(tmp_path) -> None:
    text = MINIMAL.read_text() + '\n[model]\npath = "tiny"\ntiny_warmup = true\n'
    one = config.parse_scenario(text)
    two = config.parse_scenario(text.replace('env = "rg:basic_arithmetic"',
                                             'env = "game:GuessTheNumber-v0-easy"'))
    assert warmup_set_change(tmp_path, one) is None  # first build: nothing to compare
    assert warmup_set_change(tmp_path, one) is None  # same set
    msg = warmup_set_change(tmp_path, two)
    assert msg and "rg:basic_arithmetic" in msg and "GuessTheNumber" in msg
    assert warmup_set_change(tmp_path, two) is None
    # A resume starts from its own checkpoint: no warning, and the last set is kept.
    assert warmup_set_change(tmp_path, one, resume=True) is None
    assert warmup_set_change(tmp_path, two) is None
    tools = config.parse_scenario(text.replace("tiny_warmup = true",
                                               "tiny_warmup = true\ntiny_warmup_tool_calls = true"))
    assert warmup_set_change(tmp_path, one) is not None
    msg = warmup_set_change(tmp_path, tools)  # same envs, other demonstrations
    assert msg and "calculator tool calls" in msg
    cold = config.parse_scenario(MINIMAL.read_text() + '\n[model]\ntiny_warmup = false\n')
    assert warmup_set_change(tmp_path, cold) is None
