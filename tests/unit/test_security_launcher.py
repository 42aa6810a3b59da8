"""Launcher side of the application-level checks: the env host's py: allow-list, the trainer's
checkpoint root, the reward service's token (created per run, handed over by path), and the
scenario's per-endpoint token sources (names only, never secrets)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rollart.config import ConfigError, parse_scenario, scenario_to_json
from rollart.launcher.services import env_allow_list, trainer_argv
from rollart.launcher.startup import reward_tokens

MINIMAL = (Path(__file__).parents[1] / "minimal_scenario.toml").read_text()
FAAS = 'reward = "x"\nreward_url = "https://faas.example/{name}"\n'


def _with_domain(extra: str) -> str:
    return MINIMAL.replace('reward = "reasoning_gym"', extra, 1)


def test_env_allow_list_is_the_scenarios_py_domains():
    sc = parse_scenario(MINIMAL + '[[domains]]\nname = "mine"\nenv = "py:my.envs:Maze"\n'
                        'pool = "cpu"\nreward = "x"\n')
    assert env_allow_list(sc) == ["py:my.envs:Maze"]
    assert env_allow_list(parse_scenario(MINIMAL)) == []


def test_trainer_argv_names_its_checkpoint_root(tmp_path):
    argv = trainer_argv(parse_scenario(MINIMAL), tmp_path, None,
                        checkpoint_dir=tmp_path / "run" / "checkpoints")
    assert argv[-2:] == ["--checkpoint-dir", str(tmp_path / "run" / "checkpoints")]


@pytest.mark.parametrize(("extra", "message"), [
    (FAAS + 'reward_token_env = "A"\nreward_token_file = "/f"',
     "domains[0].reward_token_env: give reward_token_env or reward_token_file, not both"),
    ('reward = "x"\nreward_token_env = "A"',
     "domains[0].reward_token_env: only for an http(s) reward_url, not 'service'"),
    (FAAS + 'reward_token_env = "A"\n[[domains]]\nname = "b"\nenv = "rg:x"\npool = "cpu"\n'
     + FAAS + 'reward_token_env = "B"',
     "domains[1].reward_token_env: domains calling https://faas.example/{name} must use the "
     "same token source"),
])
def test_bad_token_sources_are_config_errors(extra, message):
    with pytest.raises(ConfigError) as err:
        parse_scenario(_with_domain(extra), "bad.toml")
    assert message in str(err.value)


def test_reward_token_for_a_started_service_needs_reward_url():
    with pytest.raises(ConfigError, match="reward.token_env: only for a running service"):
        parse_scenario(MINIMAL + '[reward]\ntoken_env = "T"\n', "bad.toml")


def test_launcher_tokens_private_file_and_endpoint_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("FAAS_TOKEN", "faas-secret")
    sc = parse_scenario(_with_domain(FAAS + 'reward_token_env = "FAAS_TOKEN"'))
    token, path, endpoints = reward_tokens(sc, tmp_path)
    assert path == tmp_path / "secrets" / "reward.token"
    assert path.read_text().strip() == token and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert endpoints == {"https://faas.example/{name}": "faas-secret"}
    again, _, _ = reward_tokens(sc, tmp_path)  # a resumed run: a fresh token
    assert again != token
    resolved = scenario_to_json(sc).decode()
    assert "FAAS_TOKEN" in resolved and "faas-secret" not in resolved
    monkeypatch.delenv("FAAS_TOKEN")
    with pytest.raises(ConfigError, match="FAAS_TOKEN"):
        reward_tokens(sc, tmp_path)


def test_a_running_service_uses_the_token_its_entry_names(tmp_path):
    token_file = tmp_path / "svc.token"
    token_file.write_text("svc-secret\n")
    token_file.chmod(0o600)
    sc = parse_scenario(MINIMAL + f'[reward]\nurl = "http://10.0.0.2:8000"\n'
                        f'token_file = "{token_file}"\n')
    token, path, endpoints = reward_tokens(sc, tmp_path / "run")
    assert (token, path, endpoints) == ("svc-secret", None, {})
    assert not (tmp_path / "run" / "secrets").exists()
