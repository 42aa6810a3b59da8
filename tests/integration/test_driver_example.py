"""The driver script shown in README.md runs as written (extracted from the README itself)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from short_run import SHORT_RUN, eager

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = SHORT_RUN


def readme_driver_script() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Driver API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_readme_shows_the_example_file():
    assert readme_driver_script() == (ROOT / "examples" / "driver.py").read_text()


def test_readme_driver_script_trains_two_steps(tmp_path, rollart_cache_dir):
    script = tmp_path / "driver.py"
    script.write_text(readme_driver_script())
    # Engines without torch.compile (~35 s per engine on the 2-core machine, two engines
    # here): what this test checks is the script, not the engine (short_run.eager).
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(eager(SCENARIO.read_text()))
    # The session's model cache (not the user's): the same tiny-model path as the other runs.
    proc = subprocess.run([sys.executable, str(script), str(scenario)], cwd=tmp_path,
                          env=dict(os.environ, ROLLART_CACHE_DIR=str(rollart_cache_dir)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert [x.split(":")[0] for x in lines] == ["step 1", "step 2"]
    assert all("samples=8" in x for x in lines)
    assert (tmp_path / "runs" / "driver-example" / "logs").is_dir()
    # open_cluster authenticated every service with the run's own key (mode 0600).
    key = tmp_path / "runs" / "driver-example" / "keys" / "run.key_secret"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
