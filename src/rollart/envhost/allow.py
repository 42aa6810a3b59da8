"""Which envs an env host may build: the ``py:`` allow-list.

A ``py:package.module:Attr`` env makes the host import ``package.module`` and call ``Attr``, so
the client's env name would pick code to run (``py:os:system`` with ``command=...`` ran a shell
command before this check existed). The host therefore builds ``py:`` envs only from an
allow-list fixed when it starts (``rollart serve-env --allow-env NAME``, ``HostConfig.allow_env``;
``rollart run`` / ``open_cluster`` pass the scenario's ``py:`` domains). Entries are exact env
names: a module-wide entry would let ``py:allowed_mod:os.system`` walk attributes into any module
the allowed one imports.

``game:`` and ``rg:`` names are looked up in GEM's and reasoning-gym's own registries (never
imported by name) and need no entry. Env options are data only: they decode to msgpack values
(str, numbers, lists, maps) and are passed as keyword arguments to the allowed constructor, which
only accepts parameters it names. GEM games take numbers and flags only; a reasoning-gym option
naming a file (``spell_backward``'s ``data_file``) may only name one of the package's own data
files (``families.check_file_options``), never a path to read.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollart.envhost.families import EnvSpecError, family_of

#: the CLI flag and config field naming the allow-list, quoted in refusals
ALLOW_FLAG = "--allow-env (HostConfig.allow_env)"


def check_allow_entries(entries: Iterable[str]) -> list[str]:
    """The allow-list ``entries`` validated: each an exact ``py:package.module:Attr`` name.

    Raises:
        ValueError: an entry of another family, or not of the exact ``py:mod:Attr`` form.
    """
    out = []
    for entry in entries:
        family, _, rest = entry.partition(":")
        module, sep, attr = rest.partition(":")
        if family != "py" or not sep or not module or not attr:
            raise ValueError(
                f"allow-list entry {entry!r}: expected an exact py:package.module:Attr name "
                "(game: and rg: envs need no entry)"
            )
        out.append(entry)
    return sorted(set(out))


def check_env_allowed(env_name: str, allowed: frozenset[str]) -> None:
    """Refuse ``env_name`` unless it may be built here; imports and looks up nothing.

    Raises:
        EnvSpecError: (``not_found``) no known ``FAMILY:`` prefix; (``bad_request``) a ``py:``
            env that is not exactly on ``allowed``, naming the env and the rule.
    """
    if family_of(env_name) != "py" or env_name in allowed:
        return
    shown = ", ".join(sorted(allowed)) if allowed else "none"
    raise EnvSpecError(
        "bad_request",
        f"env {env_name!r} refused: py: envs are built only from this env host's allow-list "
        f"({ALLOW_FLAG}, fixed at start; allowed: {shown})",
    )
