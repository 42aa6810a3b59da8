"""Placement decisions of ``--cluster ray`` (``rollart.launcher.placement``), no Ray cluster:
which bundle each service reserves, by its hardware label; and that nothing imports Ray unless
``--cluster ray`` is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from rollart.config import Scenario, load_scenario, parse_scenario, validate_scenario
from rollart.launcher.placement import parse_cluster, plan_placement
from rollart.transport.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _scenario(**changes) -> Scenario:
    sc = load_scenario(ROOT / "scenarios" / "qwen3-8b-h800-h20.toml")
    return validate_scenario(msgspec.structs.replace(sc, **changes))


def test_example_pools_reserve_their_hardware_label_and_gpus_per_worker():
    plan = plan_placement(load_scenario(ROOT / "scenarios" / "qwen3-8b-h800-h20.toml"), "r")
    for pool in ("h800", "h20"):
        group = plan.groups[f"r-pool-{pool}"]
        assert group.bundles == [{"CPU": 1, "GPU": 1, pool: 1}] * 8
        assert group.strategy == "PACK"
        assert plan.slots[f"worker-{pool}-7"].bundle == 7
    # env hosts on the CPU env nodes, the trainer on an H800 node, the reward service too
    assert plan.resources("env-env-cpu-0") == {"CPU": 1, "cpu_env": 1}
    assert plan.resources("trainer") == {"CPU": 1, "GPU": 1, "h800": 1}
    assert plan.resources("reward") == {"CPU": 1, "cpu_env": 1}
    assert plan.slots["reward"].bind == "host"
    assert plan.slots["trainer"].bind == "address"


def test_tensor_parallel_worker_takes_its_gpus_in_one_bundle():
    sc = load_scenario(ROOT / "scenarios" / "qwen3-32b-modes-sync-plus.toml")
    plan = plan_placement(sc, "r")
    pool = sc.pools[0]
    tp = pool.engine.tensor_parallel_size
    assert tp > 1
    bundles = plan.groups[f"r-pool-{pool.name}"].bundles
    assert bundles == [{"CPU": 1, "GPU": tp, pool.hardware: tp}] * pool.num_workers


def test_cpu_pool_has_no_label_unless_given_and_ray_resource_overrides_hardware():
    sc = _scenario()
    cpu = msgspec.structs.replace(sc.pools[0], hardware="cpu")
    labelled = msgspec.structs.replace(sc.pools[1], hardware="cpu", ray_resource="h20")
    plan = plan_placement(_scenario(pools=[cpu, labelled]), "r")
    assert plan.resources("worker-h800-0") == {"CPU": 1}
    assert plan.resources("worker-h20-0") == {"CPU": 1, "h20": 1}
    gpu = msgspec.structs.replace(sc.pools[0], ray_resource="H800_SXM")
    plan = plan_placement(_scenario(pools=[gpu, sc.pools[1]]), "r")
    assert plan.resources("worker-h800-0") == {"CPU": 1, "GPU": 1, "H800_SXM": 1}


def test_services_with_addresses_are_not_placed():
    sc = _scenario()
    given = msgspec.structs.replace(sc.pools[1], addresses=["tcp://10.0.0.5:5600"] * 8)
    host = msgspec.structs.replace(sc.env_hosts[0], address="tcp://10.0.0.9:7000")
    reward = msgspec.structs.replace(sc.reward, url="http://10.0.0.30:8000")
    plan = plan_placement(_scenario(pools=[sc.pools[0], given], env_hosts=[host],
                                    reward=reward), "r")
    assert sorted(plan.slots) == ["trainer"] + [f"worker-h800-{i}" for i in range(8)]


def test_cpu_trainer_reserves_a_cpu_per_rank():
    sc = _scenario()
    trainer = msgspec.structs.replace(sc.trainer, device="cpu", num_processes=2,
                                      ray_resource=None)
    plan = plan_placement(_scenario(trainer=trainer), "r")
    assert plan.resources("trainer") == {"CPU": 2}


def test_hardware_label_that_is_no_resource_name_is_a_config_error():
    sc = _scenario()
    bad = msgspec.structs.replace(sc.pools[0], hardware="H800 80GB")
    with pytest.raises(ConfigError, match=r"pools\[0\]\.hardware"):
        plan_placement(_scenario(pools=[bad, sc.pools[1]]), "r")


@pytest.mark.parametrize("name", ["GPU", "CPU", "memory", "h 20", "", "a:b:c", ":H100",
                                  "accelerator_type:"])
def test_ray_resource_field_rejects_reserved_and_bad_names(name):
    text = (ROOT / "scenarios" / "qwen3-8b-h800-h20.toml").read_text()
    text = text.replace('ray_resource = "h800"', f'ray_resource = "{name}"')
    with pytest.raises(ConfigError, match="ray_resource"):
        parse_scenario(text.encode(), "x.toml")


def test_ray_resource_may_name_an_accelerator_type():
    text = (ROOT / "scenarios" / "qwen3-8b-h800-h20.toml").read_text()
    text = text.replace('ray_resource = "h800"', 'ray_resource = "accelerator_type:H800"')
    sc = parse_scenario(text.encode(), "x.toml")
    assert sc.trainer.ray_resource == "accelerator_type:H800"
    plan_placement(sc, "r")


@pytest.mark.parametrize(("spec", "address"), [(None, None), ("local", None), ("ray", "auto"),
                                               ("ray://10.0.0.1:6379", "10.0.0.1:6379")])
def test_parse_cluster(spec, address):
    assert parse_cluster(spec) == address


@pytest.mark.parametrize("spec", ["ray://", "slurm", "ray:10.0.0.1"])
def test_parse_cluster_rejects_others(spec):
    with pytest.raises(ConfigError, match="--cluster"):
        parse_cluster(spec)


def test_local_launcher_does_not_import_ray():
    code = ("import sys, rollart, rollart.launcher.local, rollart.launcher.run, "
            "rollart.launcher.placement, rollart.cli\n"
            "from rollart.launcher.run import _parse\n"
            "_parse(['x.toml'])\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == "[]"


def test_run_rejects_an_unknown_cluster_before_anything_starts(tmp_path, capsys):
    from rollart.launcher.run import main

    rc = main([str(ROOT / "scenarios" / "quickstart.toml"), "--cluster", "slurm",
               "--out", str(tmp_path / "run")])
    assert rc == 2
    assert "--cluster: 'slurm'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


async def test_insecure_is_refused_on_a_ray_cluster(tmp_path):
    from rollart.launcher.local import open_cluster

    with pytest.raises(ConfigError, match="CURVE key is required"):
        async with open_cluster(ROOT / "scenarios" / "quickstart.toml", run_dir=tmp_path / "r",
                                insecure=True, cluster="ray"):
            pass
    assert not (tmp_path / "r").exists()


def test_validate_notes_a_scenario_that_ray_could_not_place(tmp_path, capsys):
    from rollart.cli import main as cli

    text = (ROOT / "scenarios" / "qwen3-8b-h800-h20.toml").read_text()
    ok = tmp_path / "ok.toml"
    ok.write_text(text)
    # refused on this machine (no such model here, a CPU torch), placed all the same
    assert cli(["validate", str(ok), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--cluster ray" not in err and "model.path" in err
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('hardware = "h800"', 'hardware = "H800 SXM"', 1))
    assert cli(["validate", str(bad), "--quiet"]) == 1  # a note for the local launcher
    err = capsys.readouterr().err
    assert "`rollart run --cluster ray` would refuse it" in err and "hardware" in err
