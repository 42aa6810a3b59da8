"""A domain's ``env_options`` checked against what its env accepts, before anything starts.

An env host refuses options its env does not name (``rollart.envhost.families``: a GEM game
takes the parameters of its registered entry point, a reasoning-gym dataset the fields of its
config dataclass), but only when a session opens: a typo would pass ``rollart validate`` and
fail every trajectory of the run once the services are up. The accepted names are read here
from the same registries the env host reads, so nothing is constructed and nothing is imported
that the env host would not import for that env name (GEM's own entry-point module,
reasoning-gym's dataset registry). A reasoning-gym domain's values are then checked by its
config and by drawing entries with them (``rollart.config.envdraw``, in child processes).

Not checked: ``py:`` envs (their module is the env host's to import, from its own path and
only if its allow list names it: ``rollart.envhost.allow``), and names neither registry knows
(an unknown env is the preflight's to refuse, ``rollart.launcher.local.preflight``, which
runs this check too), and envs served in-process (``skip``: their factory takes what it
takes, even under a GEM or reasoning-gym name).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from rollart.config.envdraw import draw_problems, one_line
from rollart.config.schema import Scenario
from rollart.config.validate import suggest
from rollart.transport.errors import ConfigError


def accepted_env_options(env: str) -> frozenset[str] | None:
    """The option names the env host accepts for ``env`` (a ``game:`` or ``rg:`` name);
    ``None`` where it cannot be told without the env host (another family, a name its
    registry does not know, the library not installed here)."""
    family, _, rest = env.partition(":")
    if family not in ("game", "rg") or not rest:
        return None
    # The env host's own lookups (GemEnv.__init__, rg_dataset), so the two cannot differ.
    from rollart.envhost.families import EnvSpecError, gem_option_names, rg_config_fields

    try:
        return frozenset(rg_config_fields(rest) if family == "rg" else gem_option_names(env))
    except (ImportError, EnvSpecError):
        return None


def _check_rg_values(dataset: str, options: Mapping[str, Any]) -> str | None:
    """What reasoning-gym's config of ``dataset`` says of ``options`` (its constructor and
    ``validate()``, as ``create_dataset`` runs them; no entry is generated: that is
    ``rollart.config.envdraw``'s), or what the env host says of an option naming a file;
    ``None``: accepted."""
    import reasoning_gym

    from rollart.envhost.families import EnvSpecError, check_file_options

    try:
        check_file_options(f"rg:{dataset}", options)
    except EnvSpecError as exc:
        return exc.message
    config_cls = reasoning_gym.factory.DATASETS[dataset][1]
    try:
        config = config_cls(seed=0, **options)  # the env host passes the session's seed
        if callable(getattr(config, "validate", None)):
            config.validate()
    except Exception as exc:  # whatever it raises, every session open would raise too
        return one_line(f"reasoning-gym refuses them: {type(exc).__name__}: {exc}")
    return None


def check_env_options(scenario: Scenario, source: str = "<scenario>", *,
                      skip: Collection[str] = ()) -> None:
    """Refuse a domain's ``env_options`` that its env would refuse at every session open:
    names a ``game:`` / ``rg:`` env does not take, and values a reasoning-gym dataset's config
    rejects or cannot draw an entry with on any of several seeds, or draws too slowly
    (``rollart.config.envdraw``; GEM values are not checked: constructing some games
    downloads data). Imports GEM / reasoning-gym only for a domain that sets
    options.

    ``skip``: env names served in-process (their factory takes what it takes).

    Raises:
        ConfigError: ``"{source}: domains[i].env_options: ..."`` naming the domain, each
            unknown option with the nearest accepted one, and the accepted list; or the
            dataset config's own refusal, or why no entry could be drawn; every refused
            domain in one error.
    """
    refused: list[tuple[int, str]] = []  # (domain index, reason): listed in domain order
    to_draw: list[tuple[int, str, str, Mapping[str, Any]]] = []
    for i, dom in enumerate(scenario.domains):
        if not dom.env_options or dom.env in skip:
            continue
        accepted = accepted_env_options(dom.env)
        if accepted is None:
            continue
        where = f"{source}: domains[{i}].env_options: domain {dom.name!r}, env {dom.env!r}"
        known = sorted(accepted)
        unknown = [key for key in dom.env_options if key not in accepted]
        if unknown:
            named = ", ".join(f"{key!r}{suggest(key, known)}" for key in unknown)
            hint = (" (each group's env seed is drawn from run.seed)"
                    if dom.env.startswith("rg:") and "seed" in unknown else "")
            refused.append((i, f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                                f"{named}{hint}; accepted: {known}"))
        elif dom.env.startswith("rg:"):
            said = _check_rg_values(dom.env[3:], dom.env_options)
            if said:
                refused.append((i, f"{where}: {said}"))
            else:
                to_draw.append((i, where, dom.env[3:], dom.env_options))
    if to_draw:
        problems = draw_problems([(dataset, opts) for _, _, dataset, opts in to_draw])
        refused += [(i, f"{where}: {problem}") for (i, where, _, _), problem
                    in zip(to_draw, problems, strict=True) if problem]
    if refused:
        raise ConfigError(reasons=[text for _, text in sorted(refused)])
