"""The scenario: one TOML file describing a rollart run, decoded into msgspec Structs.

Layout (tables of ``scenarios/*.toml``)::

    [run]          seed, steps, mode, alpha, batch/group sizes, redundancy, limits, retries
    [model]        path ("tiny" = the project's own tiny model, else a local HF checkpoint dir)
    [[pools]]      inference worker pools: name, hardware label, num_workers, engine options
    [[domains]]    task domains: env name, pool affinity, reward function, mix weight, sampling
    [[env_hosts]]  environment host processes (and optional latency injection)
    [reward]       the HTTP reward service (launched locally or an existing URL)
    [trainer]      optimisation and checkpoint settings
    [output]       what the run folder gets: transcripts, TensorBoard, W&B
    [eval]         held-out evaluation: size, schedule, pass@k, collapse floor

Every Struct rejects unknown fields, bounds are ``msgspec.Meta`` constraints, and cross-field
rules are checked by :func:`validate_scenario`. Nothing is ever rewritten after loading: a bad
value raises :class:`ConfigError` naming the file, the field and the reason.
"""

from __future__ import annotations

import datetime
import functools
import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect

from rollart.config.envoptions import check_env_options
from rollart.config.schema import (
    AdaptiveAffinityConfig,
    DomainConfig,
    EngineConfig,
    EnvHostConfig,
    EvalConfig,
    ModelConfig,
    OutputConfig,
    PoolConfig,
    RetryConfig,
    RewardServiceConfig,
    RunConfig,
    SamplingConfig,
    Scenario,
    TrainerConfig,
    WorkerChecksConfig,
)
from rollart.config.validate import closest, suggest, validate_scenario
from rollart.transport.errors import ConfigError

__all__ = [
    "AdaptiveAffinityConfig",
    "ConfigError",
    "DomainConfig",
    "EngineConfig",
    "EnvHostConfig",
    "EvalConfig",
    "ModelConfig",
    "OutputConfig",
    "PoolConfig",
    "RetryConfig",
    "RewardServiceConfig",
    "RunConfig",
    "SamplingConfig",
    "Scenario",
    "TrainerConfig",
    "WorkerChecksConfig",
    "check_env_options",
    "in_file",
    "load_scenario",
    "parse_scenario",
    "scenario_to_json",
    "validate_scenario",
]


def _struct_of(t: msgspec.inspect.Type | None) -> msgspec.inspect.StructType | None:
    """The struct a table decodes into, through lists and optionals (None: not exactly one
    struct)."""
    while isinstance(t, msgspec.inspect.ListType | msgspec.inspect.UnionType):
        if isinstance(t, msgspec.inspect.ListType):
            t = t.item_type
            continue
        structs = [u for u in t.types if isinstance(u, msgspec.inspect.StructType)]
        if len(structs) != 1:
            return None
        t = structs[0]
    return t if isinstance(t, msgspec.inspect.StructType) else None


def _field_type(path: str) -> msgspec.inspect.Type | None:
    """The declared type at a msgspec error path such as ``domains[0].sampling.top_p``."""
    t: msgspec.inspect.Type | None = msgspec.inspect.type_info(Scenario)
    for name in re.sub(r"\[\d+\]", "", path).split("."):
        st = _struct_of(t)  # the struct that holds ``name``
        fields = {f.name: f.type for f in st.fields} if st is not None else {}
        if name not in fields:
            return None
        t = fields[name]
    return t


#: where a top-level key is, in messages (a nested key is named by its table: ``run``,
#: ``domains[0]``)
_TOP_LEVEL = "top level of the file"

#: (table path, key, that table's struct, whether the key's value is a table or an array
#: of tables)
_Unknown = tuple[str, str, msgspec.inspect.StructType, bool]


def _is_table(value: Any) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value))


def _unknown_field(text: str, where: str) -> str:
    """msgspec's "Object contains unknown field `x`" with the nearest field of that table."""
    bad = text.partition("`")[2].rpartition("`")[0]
    st = _struct_of(_field_type(where) if where else msgspec.inspect.type_info(Scenario))
    if st is None:
        return text
    names = [f.name for f in st.fields]
    return text + (suggest(bad, names) or f"; {where or 'the scenario'} takes {names}")


def _unknown_fields(raw: Any, t: msgspec.inspect.Type | None, where: str = ""
                    ) -> tuple[Any, list[_Unknown]]:
    """``raw`` (the TOML as plain data) without the keys the declared type ``t`` does not
    take, and each of those as (table path, key, that table's struct): msgspec stops at the
    first error, a user with two typos wants both."""
    if isinstance(t, msgspec.inspect.UnionType) and isinstance(raw, list):
        t = next((u for u in t.types if isinstance(u, msgspec.inspect.ListType)), None)
    if isinstance(t, msgspec.inspect.ListType) and isinstance(raw, list):
        pairs = [_unknown_fields(item, t.item_type, f"{where}[{i}]")
                 for i, item in enumerate(raw)]
        return [kept for kept, _ in pairs], [u for _, found in pairs for u in found]
    if isinstance(t, msgspec.inspect.DictType) and isinstance(raw, dict):  # env_hosts.latency
        walked = {k: _unknown_fields(v, t.value_type, f"{where}.{k}") for k, v in raw.items()}
        return ({k: kept for k, (kept, _) in walked.items()},
                [u for _, found in walked.values() for u in found])
    st = _struct_of(t) if not isinstance(t, msgspec.inspect.ListType) else None
    if st is None or not isinstance(raw, dict):
        return raw, []
    fields = {f.encode_name: f.type for f in st.fields}
    out: dict[str, Any] = {}
    unknown: list[_Unknown] = []
    for key, value in raw.items():
        if key not in fields:
            unknown.append((where, key, st, _is_table(value)))
        else:
            out[key], found = _unknown_fields(value, fields[key],
                                              f"{where}.{key}" if where else key)
            unknown += found
    return out, unknown


@functools.cache
def _tables() -> tuple[tuple[str, str, frozenset[str]], ...]:
    """(path, TOML header, field names) of every table below the top level: ``run`` /
    ``[run]``, ``pools`` / ``[[pools]]``, ``pools.engine`` / ``[pools.engine]``, ..."""
    out: list[tuple[str, str, frozenset[str]]] = []

    def walk(st: msgspec.inspect.StructType, path: str) -> None:
        for f in st.fields:
            sub = _struct_of(f.type)
            if sub is None:
                continue
            sub_path = f"{path}.{f.encode_name}" if path else f.encode_name
            listed = isinstance(f.type, msgspec.inspect.ListType) or (
                isinstance(f.type, msgspec.inspect.UnionType)
                and any(isinstance(u, msgspec.inspect.ListType) for u in f.type.types))
            header = f"[[{sub_path}]]" if listed else f"[{sub_path}]"
            out.append((sub_path, header, frozenset(g.encode_name for g in sub.fields)))
            walk(sub, sub_path)

    top = _struct_of(msgspec.inspect.type_info(Scenario))
    assert top is not None
    walk(top, "")
    return tuple(out)


def _elsewhere_table(key: str, own: str) -> str:
    """`` (did you mean [pools.engine]?)``: the tables (not at path ``own``) named ``key``,
    else the nearest name; ``""`` when none is near."""
    tables = [(path.rpartition(".")[2], header) for path, header, _ in _tables()
              if path != own]
    name = key if any(n == key for n, _ in tables) else closest(key, sorted({n for n, _ in
                                                                             tables}))
    if name is None:
        return ""
    return f" (did you mean {' or '.join(h for n, h in tables if n == name)}?)"


def _exactly_elsewhere(key: str, own: str) -> bool:
    """Whether a table other than the one at path ``own`` takes ``key``."""
    return any(key in names for path, _, names in _tables() if path != own)


def _elsewhere(key: str, own: str) -> str:
    """`` (did you mean [run] steps?)``: the tables other than the one at path ``own`` that
    take ``key``, else the field nearest to it in any of them; ``""`` when none is near."""
    tables = [(header, names) for path, header, names in _tables() if path != own]
    name: str | None = key
    holders = [header for header, names in tables if key in names]
    if not holders:
        name = closest(key, sorted({n for _, names in tables for n in names}))
        if name is None:
            return ""
        holders = [header for header, names in tables if name in names]
    return f" (did you mean {' or '.join(f'{h} {name}' for h in holders)}?)"


def _at(doc: Any, path: str) -> Any:
    """The table at ``path`` (``domains[0].engine``; ``""``: the top) of plain TOML data."""
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        doc = doc[int(index)] if index else doc[name]
    return doc


def _unknown_messages(unknown: list[_Unknown]) -> tuple[list[str], dict[tuple[str, str], str]]:
    """One message per unknown key, with the nearest field of its table or, when none is
    near, where a field of that name (or the nearest) is; a table's own field list is said
    once, after its last key without a near field. Also the (table path, field) pairs
    suggested in the key's own table, each with the key it was suggested for."""
    parts: list[str] = []
    suggested: dict[tuple[str, str], str] = {}
    listed: dict[str, tuple[int, msgspec.inspect.StructType]] = {}
    for where, key, st, table in unknown:
        own = re.sub(r"\[\d+\]", "", where)
        # a table is offered table names, a value field names; a key another table takes as
        # it is was put in the wrong table (``every`` under [run]: [eval] every), however near
        # a field of its own table looks
        names = [f.encode_name for f in st.fields if (_struct_of(f.type) is not None) == table]
        text = f"{where or _TOP_LEVEL}: Object contains unknown field `{key}`"
        near = None if not table and _exactly_elsewhere(key, own) else closest(key, names)
        if near is None and table:  # [evaluation] for [eval]: too long for difflib's cutoff
            near = next((n for n in names if len(n) >= 3 and key.startswith(n)), None)
        if near is not None:
            suggested.setdefault((where, near), key)
            parts.append(text + (suggest(key, names) or f" (did you mean {near!r}?)"))
            continue
        parts.append(text + (_elsewhere_table(key, own) if table else _elsewhere(key, own)))
        listed[where] = (len(parts) - 1, st)
    for where, (i, st) in listed.items():
        parts[i] += f"; {where or 'the scenario'} takes {[f.encode_name for f in st.fields]}"
    return parts, suggested


def _validation_message(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.run.batch_size`"; name the field first, as the other errors do.
    text = str(exc)
    if " - at `$." not in text:
        if text.startswith("Object contains unknown field"):  # a top-level table
            return f"{_TOP_LEVEL}: {_unknown_field(text, '')}"
        return text
    reason, _, where = text.rpartition(" - at `$.")
    where = where.rstrip("`")
    if reason.startswith("Invalid enum value"):
        # msgspec names the bad value only: add what the field takes, and the nearest.
        t = _field_type(where)
        if isinstance(t, msgspec.inspect.UnionType):
            t = next((u for u in t.types if isinstance(u, msgspec.inspect.LiteralType)), None)
        if isinstance(t, msgspec.inspect.LiteralType):
            allowed = [str(v) for v in t.values]
            bad = reason.removeprefix("Invalid enum value").strip().strip("'")
            field = re.sub(r"\[\d+\]", "", where)
            reason += f"; one of {allowed}{suggest(bad, allowed, field)}"
    elif reason.startswith("Object contains unknown field"):
        reason = _unknown_field(reason, where)
    return f"{where}: {reason}"


def _decode_error(data: bytes | str, exc: msgspec.ValidationError) -> str:
    """The message of a failed typed decode: msgspec's error, field first, and every unknown
    key of the file. msgspec stops at its first error, so an unknown key after a bad value is
    found by walking the plain TOML, and a bad value after an unknown key by decoding again
    without the unknown keys."""
    raw = msgspec.toml.decode(data)  # cannot fail: the typed decode got past the TOML
    kept, unknown = _unknown_fields(raw, msgspec.inspect.type_info(Scenario))
    first_unknown = str(exc).startswith("Object contains unknown field")
    if first_unknown and not unknown:  # somewhere the walk does not go: msgspec's own word
        return _validation_message(exc)
    parts, suggested = _unknown_messages(unknown)
    other: msgspec.ValidationError | None = exc
    taken: set[tuple[str, str]] = set()
    while first_unknown:
        try:
            msgspec.convert(kept, Scenario, str_keys=True,
                            builtin_types=(datetime.datetime, datetime.date, datetime.time))
            other = None
        except msgspec.ValidationError as hidden:
            missing = re.fullmatch(r"Object missing required field `(.+?)`(?: - at `\$\.(.*)`)?",
                                   str(hidden))
            at = (missing[2] or "", missing[1]) if missing else None
            other = hidden
            if at in suggested and at not in taken:
                # `nme = "guess"`: "did you mean 'name'?" already says `name` is missing; go
                # on as if the suggestion were taken, so a bad value after it is named too
                taken.add(at)
                try:
                    _at(kept, at[0])[at[1]] = _at(raw, at[0])[suggested[at]]
                    continue
                except (KeyError, IndexError, TypeError):  # msgspec's path not the TOML's
                    pass
            if at in suggested:
                other = None
        break
    if other is None:
        return "; ".join(parts)
    text = _validation_message(other)
    return "; ".join([*parts, text] if first_unknown else [text, *parts])


def parse_scenario(data: bytes | str, source: str = "<scenario>") -> Scenario:
    """Decode and validate a scenario from TOML text (each domain's ``env_options`` are
    checked against what its env takes where the env is known: ``rollart.launcher.local.
    preflight``, :func:`check_env_options`).

    Raises:
        ConfigError: invalid TOML, unknown fields (every one of the file, each with the
            nearest field), a value of the wrong type or out of bounds (msgspec's first), a
            cross-field rule broken, or env options the domain's env does not take; the
            message starts with ``source`` and names the field.
    """
    try:
        scenario = msgspec.toml.decode(data, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_decode_error(data, exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    validate_scenario(scenario, source)
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Read, decode and validate the scenario file at ``path``.

    Raises:
        ConfigError: the file is missing / unreadable, or anything :func:`parse_scenario` rejects.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read scenario: {exc.strerror or exc}") from None
    return parse_scenario(data, str(path))


def in_file(source: str, exc: ConfigError) -> ConfigError:
    """``exc`` as an error naming the scenario file ``source``: its message prefixed with
    ``"source: "`` unless it already starts so (errors found after loading, e.g. a
    ``model.path`` that is not a local checkpoint, name only the field)."""
    text = str(exc)
    return exc if text.startswith(f"{source}:") else ConfigError(f"{source}: {text}")


def scenario_to_json(scenario: Scenario) -> bytes:
    """The resolved scenario (defaults filled in) as indented JSON, for ``DIR/config.json``."""
    return msgspec.json.format(msgspec.json.encode(scenario), indent=2) + b"\n"


def scenario_from_json(data: bytes | str, source: str = "<config.json>") -> Scenario:
    """Inverse of :func:`scenario_to_json` (resume reads a run dir's config.json). ConfigError."""
    try:
        scenario = msgspec.json.decode(data, type=Scenario)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return validate_scenario(scenario, source)
