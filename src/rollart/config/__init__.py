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

import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect

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
from rollart.config.validate import suggest, validate_scenario
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


def _unknown_field(text: str, where: str) -> str:
    """msgspec's "Object contains unknown field `x`" with the nearest field of that table."""
    bad = text.partition("`")[2].rpartition("`")[0]
    st = _struct_of(_field_type(where) if where else msgspec.inspect.type_info(Scenario))
    if st is None:
        return text
    names = [f.name for f in st.fields]
    return text + (suggest(bad, names) or f"; {where or 'the scenario'} takes {names}")


def _unknown_fields(raw: Any, t: msgspec.inspect.Type | None, where: str = ""
                    ) -> list[tuple[str, str]]:
    """Every (table path, key) of ``raw`` (the TOML as plain data) that the declared type
    ``t`` does not take: msgspec stops at the first, a user with two typos wants both."""
    if isinstance(t, msgspec.inspect.UnionType) and isinstance(raw, list):
        t = next((u for u in t.types if isinstance(u, msgspec.inspect.ListType)), None)
    if isinstance(t, msgspec.inspect.ListType) and isinstance(raw, list):
        return [u for i, item in enumerate(raw)
                for u in _unknown_fields(item, t.item_type, f"{where}[{i}]")]
    st = _struct_of(t) if not isinstance(t, msgspec.inspect.ListType) else None
    if st is None or not isinstance(raw, dict):
        return []
    fields = {f.encode_name: f.type for f in st.fields}
    out: list[tuple[str, str]] = []
    for key, value in raw.items():
        if key not in fields:
            out.append((where, key))
        else:
            out += _unknown_fields(value, fields[key], f"{where}.{key}" if where else key)
    return out


def _validation_message(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.run.batch_size`"; name the field first, as the other errors do.
    text = str(exc)
    if " - at `$." not in text:
        if text.startswith("Object contains unknown field"):  # a top-level table
            return _unknown_field(text, "")
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


def parse_scenario(data: bytes | str, source: str = "<scenario>") -> Scenario:
    """Decode and validate a scenario from TOML text.

    Raises:
        ConfigError: invalid TOML, an unknown field, a value out of bounds or a cross-field rule
            broken; the message starts with ``source`` and names the field.
    """
    try:
        scenario = msgspec.toml.decode(data, type=Scenario)
    except msgspec.ValidationError as exc:
        message = _validation_message(exc)
        if "unknown field" in str(exc):
            unknown = _unknown_fields(msgspec.toml.decode(data),
                                      msgspec.inspect.type_info(Scenario))
            if len(unknown) > 1:
                message = "; ".join(
                    f"{where + ': ' if where else ''}"
                    + _unknown_field(f"Object contains unknown field `{key}`", where)
                    for where, key in unknown)
        raise ConfigError(f"{source}: {message}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    return validate_scenario(scenario, source)


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
