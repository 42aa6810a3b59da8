"""Every shipped scenario parses and validates; bad configs name the file, field and reason."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rollart.config import (
    ConfigError,
    Scenario,
    load_scenario,
    parse_scenario,
    scenario_from_json,
    scenario_to_json,
)

SCENARIOS = sorted((Path(__file__).parents[2] / "scenarios").glob("*.toml"))

#: the smallest valid scenario (shared with the integration tests)
MINIMAL = (Path(__file__).parents[1] / "minimal_scenario.toml").read_text()


def test_there_are_scenarios() -> None:
    names = {p.name for p in SCENARIOS}
    assert "quickstart.toml" in names
    assert any(name.startswith("qwen3") for name in names)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_every_scenario_parses_and_round_trips(path: Path) -> None:
    scenario = load_scenario(path)
    assert isinstance(scenario, Scenario)
    again = scenario_from_json(scenario_to_json(scenario))
    assert again == scenario


def test_quickstart_meets_the_issue() -> None:
    sc = load_scenario(Path(__file__).parents[2] / "scenarios" / "quickstart.toml")
    run = sc.run
    assert run.mode == "rollart" and run.alpha == 1
    assert run.group_size >= 4 and run.redundancy >= 1
    # "first" would train on the members that finish first: in a game, the short (won) ones
    assert run.selection == "unbiased"
    assert sc.model.path == "tiny"
    assert len(sc.domains) >= 2 and sc.run.max_turns > 1  # multi-task, multi-turn
    assert any(d.env.startswith("game:") for d in sc.domains)
    # Learning you can trust: a held-out eval, and the warm-up recipe stated in the file.
    assert sc.eval.enabled and sc.eval.size >= 400
    assert sc.model.tiny_warmup and None not in (
        sc.model.tiny_warmup_episodes, sc.model.tiny_warmup_epochs, sc.model.tiny_warmup_lr)
    assert any(d.reward_url == "service" for d in sc.domains)
    # the game's outcome, not GEM's shaped return (which a guess that ignores every hint farms),
    # judged by the policy as it is trained (sampled pass@1) against the best fixed sequence
    assert {d.reward for d in sc.domains} == {"env_success"}
    assert sc.eval.headline == "sampled" and sc.eval.pass_k >= 1
    # a policy that still samples (a three-epoch warm-up leaves RL nothing to learn), and the
    # KV of in-flight requests recomputed after each update (runs that kept it lost their gain)
    assert sc.model.tiny_warmup_epochs == 2 and run.reprefill
    assert len({d.pool for d in sc.domains}) >= 2
    assert sum(p.num_workers for p in sc.pools) >= 2
    # the staleness policy is the default, not spelled out
    assert (run.weight_apply, run.fresh_start, run.hold_batch_for_groups) == (None, None, None)
    assert _policy(run) == DEFAULT_POLICY["rollart"]


def test_the_smoke_test_stays_small_and_whole(capsys) -> None:
    # README "Smoke test": every process of a real run, started once, in about a minute.
    from rollart.cli import main as cli

    path = Path(__file__).parents[2] / "scenarios" / "smoke.toml"
    sc = load_scenario(path)
    assert sc.model.path == "tiny" and not sc.model.tiny_warmup  # nothing to build first
    assert len(sc.pools) == 1 and sc.pools[0].num_workers == 1
    assert sc.pools[0].engine.enforce_eager  # torch.compile is most of an engine's start
    assert sc.run.steps == 2 and sc.run.batch_size <= 8
    assert {d.env.split(":")[0] for d in sc.domains} == {"game", "rg"}
    assert all(d.reward_url == "service" for d in sc.domains) and sc.env_hosts
    assert sc.eval.enabled and sc.eval.size <= 8
    assert cli(["validate", "--quiet", str(path)]) == 0
    assert capsys.readouterr() == ("", "")


def test_minimal_defaults() -> None:
    sc = parse_scenario(MINIMAL)
    assert sc.run.mode == "rollart" and sc.domains[0].reward_url == "service"


#: the staleness policy's fields as a scenario that sets none of them gets them, per mode
#: (weight_apply, fresh_start, hold_batch_for_groups, apply_waves, admission, domain_mix)
DEFAULT_POLICY = {
    "rollart": ("eager", True, True, 2, "capacity", "yield"),
    "areal": ("eager", True, False, 2, "capacity", "yield"),
    "one_off": ("eager", True, False, 2, "capacity", "yield"),
    "sync_plus": ("at_batch", False, False, 2, "capacity", "yield"),
    "sync": ("at_batch", False, False, 2, "capacity", "yield"),
}
MODE_ALPHA = {"rollart": 1, "areal": 2, "one_off": 1, "sync_plus": 0, "sync": 0}


def _policy(run) -> tuple:
    return (run.effective_weight_apply, run.effective_fresh_start, run.effective_hold_batch,
            run.apply_waves, run.admission, run.domain_mix)


@pytest.mark.parametrize("mode", sorted(DEFAULT_POLICY))
def test_a_scenario_without_policy_fields_gets_the_waste_free_policy(mode: str) -> None:
    text = MINIMAL.replace("[run]", f'[run]\nmode = "{mode}"\nalpha = {MODE_ALPHA[mode]}', 1)
    run = parse_scenario(text).run
    # unset: on where it applies; the fields themselves stay unset (nothing rewritten)
    assert (run.weight_apply, run.fresh_start, run.hold_batch_for_groups) == (None, None, None)
    assert _policy(run) == DEFAULT_POLICY[mode]


LAZY = ('weight_apply = "at_batch"\nfresh_start = false\nadmission = "greedy"\n'
        'domain_mix = "weight"\nhold_batch_for_groups = false')


@pytest.mark.parametrize("mode", sorted(DEFAULT_POLICY))
def test_the_previous_lazy_policy_can_still_be_chosen_in_every_mode(mode: str) -> None:
    text = MINIMAL.replace(
        "[run]", f'[run]\nmode = "{mode}"\nalpha = {MODE_ALPHA[mode]}\n{LAZY}', 1)
    run = parse_scenario(text).run
    assert _policy(run) == ("at_batch", False, False, 2, "greedy", "weight")
    assert (run.weight_apply, run.fresh_start, run.hold_batch_for_groups) == (
        "at_batch", False, False)


def test_an_explicit_policy_value_is_kept_over_the_mode_default() -> None:
    run = parse_scenario(MINIMAL.replace(
        "[run]", '[run]\nweight_apply = "at_batch"', 1)).run
    # at_batch in rollart: fresh_start (unset) no longer applies, the hold still does
    assert _policy(run) == ("at_batch", False, True, 2, "capacity", "yield")
    run = parse_scenario(MINIMAL.replace("[run]", "[run]\nfresh_start = false", 1)).run
    assert _policy(run) == ("eager", False, True, 2, "capacity", "yield")
    run = parse_scenario(MINIMAL.replace(
        "[run]", '[run]\napply_waves = 4\nhold_batch_max_s = 5.0', 1)).run
    assert (run.apply_waves, run.hold_batch_max_s, run.effective_hold_batch) == (4, 5.0, True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("group_size = 4", "group_size = 3"),
         "run.batch_size: 8 is not a multiple of run.group_size 3"),
        (('pool = "cpu"', 'pool = "gpu"'), "domains[0].pool: unknown pool 'gpu'"),
        (("batch_size = 8", "batch_size = 0"), "run.batch_size: Expected `int` >= 1"),
        (("batch_size = 8", "batch_size = 8\nbatchsize = 8"),
         "run: Object contains unknown field `batchsize`"),
        (("[run]", '[run]\nmode = "fast"'), "run.mode: Invalid enum value 'fast'; one of "
         "['areal', 'one_off', 'rollart', 'sync', 'sync_plus']"),
        (("[run]", '[run]\nmode = "rolart"'), "(did you mean 'rollart'?)"),
        (('reward = "reasoning_gym"', 'reward = "x"\ninvalid_action = "obsrve"'),
         "domains[0].invalid_action: Invalid enum value 'obsrve'; one of ['fail', 'observe', "
         "'penalty'] (did you mean 'observe'?)"),
        (('name = "cpu"', 'name = "cpu"\n[pools.engine]\nmax_num_seqs = 0'),
         "pools[0].engine.max_num_seqs: Expected `int` >= 1"),
        (("[run]", '[run]\nmode = "sync"'), "run.alpha: mode 'sync' is on-policy: alpha must be 0"),
        (("[run]", "[run]\nalpha = 0"), "run.alpha: mode 'rollart' overlaps rollout"),
        (("[run]", '[run]\nmode = "one_off"\nalpha = 2'), "run.alpha: mode 'one_off'"),
        (("[run]", "[run]\nmax_tokens_per_turn = 9000"),
         "run.max_tokens_per_turn: 9000 exceeds run.max_tokens_per_trajectory"),
        (('reward = "reasoning_gym"', 'reward = "x"\nreward_url = "ftp://x"'),
         "domains[0].reward_url: 'ftp://x' is not"),
        (('reward = "reasoning_gym"', 'reward = "x"\nprompt_template = "{question}"'),
         "domains[0].prompt_template: only the {observation} placeholder"),
        (('name = "cpu"', 'name = "cpu"\n[[pools]]\nname = "cpu"'),
         "pools[1].name: duplicate name 'cpu'"),
        (('name = "cpu"', 'name = "cpu"\nnum_workers = 2\naddresses = ["tcp://a:1"]'),
         "pools[0].addresses: 1 addresses for num_workers = 2"),
        (('reward = "reasoning_gym"', 'reward = "x"\nmax_turns = 99'),
         "domains[0].max_turns: 99 exceeds run.max_turns 8"),
        (("[run]", "[run\n"), "invalid TOML"),
        (('reward = "reasoning_gym"', 'reward = "x"\n[domains.sampling]\ntop_p = 0.9'),
         "domains[0].sampling: top_p / top_k truncate"),
        (('reward = "reasoning_gym"', 'reward = "x"\n[domains.sampling]\ntemperature = 0.0'),
         "0 (greedy) has no sampling distribution"),
        (('reward = "reasoning_gym"', 'reward = "x"\n[[domains]]\nname = "b"\nenv = "rg:x"\n'
          'pool = "cpu"\nreward = "x"\n[domains.sampling]\ntemperature = 0.7'),
         "domains[].sampling.temperature: the trainer scores every sample at one temperature"),
        (('name = "cpu"', 'name = "cpu"\n[pools.engine]\nmax_model_len = 512'),
         "pools[0].engine.max_model_len: 512 is below run.max_tokens_per_trajectory 2048"),
        (("[run]", "[trainer]\nmax_tokens_per_microbatch = 100\n[run]"),
         "trainer.max_tokens_per_microbatch: 100 is below"),
        (("[run]", "[trainer]\nnum_minibatches = 9\n[run]"),
         "trainer.num_minibatches: 9 exceeds run.batch_size 8"),
        (("[run]", '[trainer]\nweight_transfer = "nccl"\n[run]'),
         'trainer.weight_transfer: nccl broadcasts from GPU memory: set trainer.device = "cuda"'),
        (("[run]", '[trainer]\nweight_transfer = "nccl"\ndevice = "cuda"\n[run]'),
         "trainer.weight_transfer: nccl needs GPU workers; pools ['cpu']"),
        (('name = "cpu"', 'name = "cpu"\naddresses = ["tcp://10.0.0.5:5600"]\n[trainer]\n'
          'weight_transfer = "gloo"'),
         "trainer.weight_transfer_address: '127.0.0.1' is this machine only, but workers "
         "['tcp://10.0.0.5:5600'] are elsewhere"),
        # a host name that only starts with "127." is not this machine
        (('name = "cpu"', 'name = "cpu"\naddresses = ["tcp://127.0.0.1.nip.io:5600"]\n'
          '[trainer]\nweight_transfer = "gloo"'),
         "trainer.weight_transfer_address: '127.0.0.1' is this machine only, but workers "
         "['tcp://127.0.0.1.nip.io:5600'] are elsewhere"),
        (("[run]", '[trainer]\nweight_transfer = "ucx"\n[run]'),
         "trainer.weight_transfer: Invalid enum value 'ucx'"),
        (("[run]", '[run]\nmode = "sync_plus"\nalpha = 0\nweight_apply = "eager"'),
         "run.weight_apply: 'eager' needs an overlap mode (one_off, areal, rollart), got mode "
         "'sync_plus'"),
        (("[run]", '[run]\nabort_stale = true\non_stale = "drop"'),
         "run.abort_stale: needs on_stale = 'restart' and a mode with the per-turn staleness "
         "check (sync, sync_plus, rollart); got on_stale 'drop', mode 'rollart'"),
        (("[run]", '[run]\nabort_stale = true\nmode = "areal"'),
         "run.abort_stale: needs on_stale = 'restart'"),
        (("[run]", '[run]\nadmission = "fifo"'), "run.admission: Invalid enum value 'fifo'"),
        (("[run]", "[run]\napply_waves = 0"), "run.apply_waves: Expected `int` >= 1"),
        (("[run]", '[run]\napply_waves = 4\nweight_apply = "at_batch"'),
         "run.apply_waves: 4 is used by weight_apply = 'eager' only"),
        # unset, weight_apply is at_batch in the on-policy modes: waves mean nothing there
        (("[run]", '[run]\napply_waves = 4\nmode = "sync"\nalpha = 0'),
         "run.apply_waves: 4 is used by weight_apply = 'eager' only"),
        (("[run]", '[run]\nfresh_start = true\nweight_apply = "at_batch"'),
         "run.fresh_start: needs weight_apply = 'eager' in an overlap mode (got 'at_batch', "
         "mode 'rollart')"),
        (("[run]", '[run]\nfresh_start = true\nmode = "sync_plus"\nalpha = 0'),
         "run.fresh_start: needs weight_apply = 'eager' in an overlap mode (got 'at_batch', "
         "mode 'sync_plus')"),
        (("[run]", '[run]\nhold_batch_for_groups = true\nmode = "areal"'),
         "run.hold_batch_for_groups: needs mode 'rollart', got mode 'areal'"),
        (("[run]", "[run]\nhold_batch_max_s = 5.0\nhold_batch_for_groups = false"),
         "run.hold_batch_max_s: 5 s is used by run.hold_batch_for_groups = true only"),
        # unset, the hold is on in mode rollart only
        (("[run]", '[run]\nhold_batch_max_s = 5.0\nmode = "areal"'),
         "run.hold_batch_max_s: 5 s is used by run.hold_batch_for_groups = true only"),
        (("[run]", "[run]\nhold_batch_for_groups = true\nhold_batch_max_s = 0.0"),
         "run.hold_batch_max_s: Expected `float` > 0.0"),
    ],
)
def test_bad_configs_name_file_field_and_reason(edit: tuple[str, str], message: str) -> None:
    text = MINIMAL.replace(*edit, 1)
    with pytest.raises(ConfigError) as info:
        parse_scenario(text, "bad.toml")
    assert str(info.value).startswith("bad.toml: ")
    assert message in str(info.value)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("tiny_hidden_size", "256", "256"), ("tiny_num_layers", "4", "4"),
    ("tiny_num_heads", "4", "4"), ("tiny_seed", "3", "3"), ("tiny_warmup", "false", "false"),
    ("tiny_warmup_explore", "0.3", "0.3"), ("tiny_warmup_episodes", "10", "10"),
])
def test_a_tiny_field_with_a_checkpoint_path_is_refused(field: str, value: str,
                                                        shown: str) -> None:
    text = MINIMAL.replace("[run]", f'[model]\npath = "/m/Qwen3-8B"\n{field} = {value}\n[run]', 1)
    with pytest.raises(ConfigError) as info:
        parse_scenario(text, "bad.toml")
    assert str(info.value) == (
        f'bad.toml: model.{field}: {shown} applies only when path = "tiny" (the project\'s tiny '
        "model); model.path is '/m/Qwen3-8B', a checkpoint with its own architecture and "
        "weights: remove it")


def test_tiny_fields_at_their_default_pass_with_a_checkpoint_path() -> None:
    # written out at their defaults (a planned layout keeps the input's [model] table): nothing
    # is ignored that the user believed changed
    text = MINIMAL.replace("[run]", '[model]\npath = "/m/Qwen3-8B"\ntiny_seed = 0\n'
                           "tiny_warmup = true\ntiny_num_layers = 4\n[run]", 1)
    with pytest.raises(ConfigError, match="model.tiny_num_layers"):
        parse_scenario(text, "s.toml")
    sc = parse_scenario(text.replace("tiny_num_layers = 4\n", ""), "s.toml")
    assert sc.model.path == "/m/Qwen3-8B" and sc.model.tiny_seed == 0
    # the same fields are the tiny model's own with path = "tiny"
    assert parse_scenario(text.replace("/m/Qwen3-8B", "tiny"), "s.toml").model.tiny_num_layers == 4


def test_missing_file_and_missing_tables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml: cannot read scenario"):
        load_scenario(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="Object missing required field `domains`"):
        parse_scenario('[[pools]]\nname = "a"\n', "x.toml")
    empty = "domains = []\n" + MINIMAL.split("[[domains]]")[0]
    with pytest.raises(ConfigError, match="x.toml: domains: at least one domain"):
        parse_scenario(empty, "x.toml")


def test_latency_injection_uses_the_env_hosts_schema() -> None:
    text = MINIMAL + '[[env_hosts]]\nname = "e"\n[env_hosts.latency.game]\n' \
        'distribution = "normal"\nmean_s = 10.0\nstd_s = 1.0\n'
    sc = parse_scenario(text)
    assert sc.env_hosts[0].latency["game"].mean_s == 10.0
    bad = text.replace('distribution = "normal"', 'distribution = "exponential"')
    with pytest.raises(ConfigError, match="env_hosts"):
        parse_scenario(bad, "x.toml")


def test_config_structs_are_frozen() -> None:
    sc = parse_scenario(MINIMAL)
    with pytest.raises(AttributeError):
        sc.run.alpha = 3  # type: ignore[misc]
    assert msgspec.json.decode(scenario_to_json(sc))["run"]["alpha"] == 1
