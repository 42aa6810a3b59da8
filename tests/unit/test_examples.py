"""Every example in examples/ that runs as a script starts from a default scenario that
``rollart validate`` accepts and that has every domain the example names (its agent's domain):
``python examples/agent_calculator.py`` once defaulted to the quickstart, which has no
``arith`` domain, and stopped after minutes of start-up. The runs themselves:
``tests/integration/test_examples_run.py`` (``agent_calculator`` with its defaults),
``test_driver_example`` (``driver.py``, fast variant), ``test_admission_policy`` (a module,
no script)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from rollart.cli import main as cli
from rollart.config import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "examples").glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


def default_scenario(example: Path) -> Path:
    """The scenario ``python examples/NAME.py`` runs (its ``DEFAULT_SCENARIO``, else the
    literal default of its ``__main__`` block, relative to the repository root)."""
    spec = importlib.util.spec_from_file_location(f"example_{example.stem}", example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the __main__ block does not run
    if hasattr(module, "DEFAULT_SCENARIO"):
        return Path(module.DEFAULT_SCENARIO)
    (literal,) = re.findall(r'else "([^"]+\.toml)"', example.read_text())
    return ROOT / literal


def test_the_examples_that_run_are_known() -> None:
    assert [p.name for p in SCRIPTS] == ["agent_calculator.py", "driver.py"]


@pytest.mark.parametrize("example", SCRIPTS, ids=lambda p: p.stem)
def test_each_examples_default_scenario_validates_and_has_its_domains(example: Path,
                                                                      capsys) -> None:
    scenario = default_scenario(example)
    assert scenario.is_file(), f"{example.name}: default scenario {scenario} is missing"
    assert cli(["validate", "--quiet", str(scenario)]) == 0, capsys.readouterr().err
    domains = {d.name for d in load_scenario(scenario).domains}
    pools = {p.name for p in load_scenario(scenario).pools}
    text = example.read_text()
    wanted = set(re.findall(r'cluster\.agent\("([^"]+)"', text))
    assert wanted <= domains, f"{example.name} names domains {wanted - domains} that " \
                              f"{scenario.name} lacks ({sorted(domains)})"
    assert set(re.findall(r'set_affinity\([^,]+, "([^"]+)"\)', text)) <= pools


def test_the_agent_example_runs_from_any_working_directory() -> None:
    scenario = default_scenario(ROOT / "examples" / "agent_calculator.py")
    assert scenario.is_absolute() and scenario == ROOT / "scenarios" / "agent_calculator.toml"
    assert load_scenario(scenario).model.tiny_warmup_tool_calls  # it really calls its tool
