"""The chosen layout as a scenario file: the input with its pools, each domain's pool, the
trainer's ranks, alpha and redundancy rewritten (and ``[run.adaptive_affinity] enabled = true``
where the plan turned online affinity on), written as TOML that ``rollart validate``
reads (``rollart.config.parse_scenario`` checks it before it is written).

A pool of the plan keeps the settings of the input's first pool of the same hardware label
(its name, engine settings, Ray resource); only ``num_workers`` and
``engine.tensor_parallel_size`` change. Comments of the input file are not kept.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from rollart.config import Scenario, parse_scenario
from rollart.planner.inputs import PlanInputs
from rollart.planner.search import Candidate

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def layout_dict(raw: dict[str, Any], inputs: PlanInputs, c: Candidate) -> dict[str, Any]:
    """A copy of the scenario's TOML table ``raw`` with candidate ``c``'s layout."""
    out = copy.deepcopy(raw)
    templates: dict[str, dict[str, Any]] = {}
    for pool in raw["pools"]:
        templates.setdefault(str(pool.get("hardware", "cpu")).lower(), pool)
    pools = []
    for label, n in c.pools(inputs).items():
        pool = copy.deepcopy(templates[label])
        pool["num_workers"] = n
        pool.setdefault("engine", {})["tensor_parallel_size"] = c.tp(inputs, label)
        pools.append(pool)
    out["pools"] = pools
    for dom, label in zip(out["domains"], c.mapping, strict=True):
        dom["pool"] = inputs.pool_names[label]
    out.setdefault("trainer", {})["num_processes"] = c.trainer_gpus
    run = out.setdefault("run", {})
    run["alpha"], run["redundancy"] = c.alpha, c.redundancy
    if c.online_affinity:
        run.setdefault("adaptive_affinity", {})["enabled"] = True
    return out


def scenario_toml(raw: dict[str, Any], source: str = "<plan>") -> tuple[str, Scenario]:
    """(TOML text of ``raw``, the scenario it decodes to). Raises ConfigError when the text
    is not a valid scenario (a planner bug: the input was valid)."""
    text = to_toml(raw)
    return text, parse_scenario(text, source)


def to_toml(table: dict[str, Any]) -> str:
    """TOML text of a table of strings, numbers, booleans, lists and tables (no dates)."""
    lines: list[str] = []
    _table(lines, [], table)
    return "\n".join(lines).strip() + "\n"


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(lines: list[str], path: list[str], table: dict[str, Any]) -> None:
    subs = []
    for k, v in table.items():
        if (isinstance(v, dict) and v) or _is_table_list(v):
            subs.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in subs:
        name = ".".join(_key(p) for p in [*path, k])
        if isinstance(v, dict):
            lines += ["", f"[{name}]"]
            _table(lines, [*path, k], v)
        else:
            for item in v:
                lines += ["", f"[[{name}]]"]
                _table(lines, [*path, k], item)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # A TOML basic string: JSON's escapes are TOML's (DEL too must be escaped in TOML).
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}: {v!r}")
