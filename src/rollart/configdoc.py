"""Field documentation of the scenario's config Structs, from their ``#:`` comments.

``rollart.config`` documents each field with ``#:`` comment lines right above it (readable in
the source, where people edit). :func:`attach_field_docs` appends a ``Fields:`` section built
from them to each Struct's docstring at import, so ``help(DomainConfig)`` shows every field
with its type, default and text; :func:`scenario_reference` renders the same as the Markdown
reference in docs/scenario-reference.md (``python -m rollart.configdoc`` prints it; a test
keeps that copy in sync).
"""

from __future__ import annotations

import inspect
import re
import sys
from types import ModuleType
from typing import Any

import msgspec

#: Scenario table -> Struct class name, in the reference's order
TABLES = {
    "[run]": "RunConfig", "[run.retry]": "RetryConfig",
    "[run.worker_checks]": "WorkerChecksConfig",
    "[run.adaptive_affinity]": "AdaptiveAffinityConfig", "[model]": "ModelConfig",
    "[[pools]]": "PoolConfig", "[pools.engine]": "EngineConfig", "[[domains]]": "DomainConfig",
    "[domains.sampling]": "SamplingConfig", "[[env_hosts]]": "EnvHostConfig",
    "[reward]": "RewardServiceConfig", "[trainer]": "TrainerConfig", "[output]": "OutputConfig",
    "[eval]": "EvalConfig",
}


def field_comments(module: ModuleType) -> dict[str, dict[str, str]]:
    """``{class name: {field: text of the #: lines above it}}`` from the module's source
    (empty when the source is not available). A line scan, not a parse: it runs at import of
    ``rollart.config`` in every process."""
    try:
        lines = inspect.getsource(module).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, dict[str, str]] = {}
    fields: dict[str, str] | None = None
    text: list[str] = []
    for line in lines:
        stripped = line.strip()
        if m := _CLASS.match(line):
            fields, text = out.setdefault(m.group(1), {}), []
        elif fields is None:
            continue
        elif stripped.startswith("#:"):
            text.append(stripped[2:].strip())
        elif m := _FIELD.match(line):
            fields[m.group(1)] = " ".join(text)
            text = []
        else:  # the comment must sit right above its field
            text = []
    return out


_CLASS = re.compile(r"^class (\w+)\(")
_FIELD = re.compile(r"^    (\w+): ")


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if isinstance(tp, type) else None
    return text or str(tp).replace("typing.", "").replace("rollart.config.", "")


def field_table(cls: type[msgspec.Struct], comments: dict[str, str]) -> list[tuple[str, ...]]:
    """``(name, type, default, text)`` of each field of ``cls``; type and bounds as written in
    the source annotations (``Annotated[int, Meta(ge=1)]`` shows as ``int (>= 1)``)."""
    hints = msgspec.structs.fields(cls)
    rows = []
    for f in hints:
        if f.default is not msgspec.NODEFAULT:
            default = repr(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            made = f.default_factory()
            default = repr(made) if not isinstance(made, msgspec.Struct) else "(table)"
        else:
            default = "required"
        rows.append((f.encode_name, _describe(f.type), default, comments.get(f.name, "")))
    return rows


def _describe(tp: Any) -> str:
    info = msgspec.inspect.type_info(tp)
    return _info_text(info)


def _info_text(info: Any) -> str:
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        return " | ".join(_info_text(t) for t in info.types)
    if isinstance(info, mi.LiteralType):
        return " | ".join(repr(v) for v in info.values)
    if isinstance(info, (mi.ListType,)):
        return f"list[{_info_text(info.item_type)}]"
    if isinstance(info, mi.DictType):
        return f"dict[{_info_text(info.key_type)}, {_info_text(info.value_type)}]"
    if isinstance(info, mi.StructType):
        return info.cls.__name__
    name = {mi.IntType: "int", mi.FloatType: "float", mi.StrType: "str", mi.BoolType: "bool",
            mi.NoneType: "None", mi.AnyType: "any"}.get(type(info), type(info).__name__)
    bounds = []
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                      ("min_length", "min length"), ("max_length", "max length")):
        v = getattr(info, attr, None)
        if v is not None:
            # Whole floats as ints: typing caches Annotated[float, Meta(gt=0)] under the equal
            # Meta(gt=0.0) of a module imported earlier, so the spelling would follow import order.
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            bounds.append(f"{sym} {v}")
    return f"{name} ({', '.join(bounds)})" if bounds else name


def attach_field_docs(module: ModuleType) -> None:
    """Append a ``Fields:`` section to the docstring of every Struct class in ``module``."""
    comments = field_comments(module)
    for name, cls in vars(module).items():
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)
                and cls.__module__ == module.__name__ and name in comments):
            continue
        rows = field_table(cls, comments[name])
        if not rows:
            continue
        lines = ["", "Fields:"]
        for fname, tp, default, text in rows:
            lines.append(f"    {fname}: {tp} = {default}")
            if text:
                lines.append(f"        {text}")
        cls.__doc__ = (inspect.cleandoc(cls.__doc__ or "") + "\n" + "\n".join(lines)).strip()


def scenario_reference() -> str:
    """The scenario reference in Markdown, as docs/scenario-reference.md holds it."""
    from rollart.config import schema as config

    comments = field_comments(config)
    out = []
    for table, cls_name in TABLES.items():
        cls = getattr(config, cls_name)
        summary = inspect.cleandoc(cls.__doc__ or "").split("\n\nFields:")[0]
        out += [f"## `{table}`", "", " ".join(summary.split()), "",
                "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for fname, tp, default, text in field_table(cls, comments.get(cls_name, {})):
            cell, tp_cell = text.replace("|", "\\|"), tp.replace("|", "\\|")
            out.append(f"| `{fname}` | {tp_cell} | `{default}` | {cell} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(scenario_reference())
