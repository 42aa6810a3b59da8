"""The run's authentication, decided once by the launcher (``rollart run`` / ``open_cluster``)
before any service starts: which key every ZeroMQ service and client of the run gets.

- Default: a new CURVE key pair per launch at ``RUN_DIR/keys/run.key_secret`` (directory 0700,
  file 0600), handed to each service as ``--key-file PATH`` (a path: key material never appears
  on a command line, which every local user can read in ``ps``).
- ``run.key_file`` (or ``key_file=``): the key of services started by hand (their
  ``--key-file``), needed when the scenario names running services (``pools[].addresses``,
  ``env_hosts[].address``); it is copied to ``RUN_DIR/keys`` so ``run_credentials(RUN_DIR)``
  finds it.
- Insecure: by ``--insecure`` or ``run.insecure = true`` (``check_insecure`` for the rule).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rollart.config import Scenario
from rollart.transport.errors import ConfigError
from rollart.transport.security import (
    INSECURE,
    KEY_NAME,
    Auth,
    check_insecure,
    create_key_file,
    load_key_file,
)


@dataclass(frozen=True)
class RunAuth:
    """``auth`` for the run's clients and ``argv`` to append to each ZeroMQ service's command."""

    auth: Auth
    argv: list[str]


def remote_addresses(scenario: Scenario) -> list[tuple[str, str]]:
    """(field, address) of every ZeroMQ service the scenario says is already running."""
    out = [(f"pools[{i}].addresses", a) for i, p in enumerate(scenario.pools) for a in p.addresses]
    out += [(f"env_hosts[{i}].address", h.address) for i, h in enumerate(scenario.env_hosts)
            if h.address is not None]
    return out


def check_run_auth(scenario: Scenario, *, insecure: bool = False,
                   key_file: str | Path | None = None) -> Path | None:
    """The checks of ``run_auth`` without writing anything (``rollart validate`` runs them).

    Returns:
        None for an insecure run or a new per-launch key; else the given key file's path.
    Raises:
        ConfigError: as ``run_auth``.
    """
    remote = remote_addresses(scenario)
    # Local services bind 127.0.0.1; only services elsewhere put the run on the network.
    if check_insecure([a for _, a in remote], flag=insecure, config=scenario.run.insecure,
                      flag_name="--insecure", config_name="run.insecure = true"):
        return None
    given = key_file or scenario.run.key_file
    if given is None:
        if remote:
            field, address = remote[0]
            raise ConfigError(
                f"{field}: {address} was started by hand with its own key; set run.key_file "
                "(or rollart run --key-file) to that key file (`rollart keygen DIR` makes one "
                "to start every service with)")
        return None
    load_key_file(given)  # checks mode and content
    return Path(given)


def run_auth(scenario: Scenario, run_dir: Path, *, insecure: bool = False,
             key_file: str | Path | None = None) -> RunAuth:
    """Decide the run's authentication and prepare its key (see the module docstring).

    Args:
        insecure: the command-line opt-in (``rollart run --insecure``).
        key_file: an existing key (overrides ``run.key_file``).
    Raises:
        ConfigError: insecure on a non-loopback address with one opt-in only; running services
            named but no key given for them; a bad key file.
    """
    given = check_run_auth(scenario, insecure=insecure, key_file=key_file)
    keys = run_dir / "keys"
    if given is None:
        if insecure or scenario.run.insecure:
            return RunAuth(INSECURE, ["--insecure"])
        path = create_key_file(keys)
    else:
        key = load_key_file(given)
        keys.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(keys, 0o700)
        path = keys / f"{KEY_NAME}.key_secret"
        if Path(given).expanduser().resolve() != path.resolve():
            assert key.path is not None  # load_key_file sets it
            shutil.copyfile(key.path, path)
            os.chmod(path, 0o600)
    return RunAuth(load_key_file(path), ["--key-file", str(path.resolve())])
