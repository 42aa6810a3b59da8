"""The layout planner (``rollart plan``): search, scenario file, refusals, CLI (SIMULATED)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import time
from pathlib import Path

import pytest

from rollart.cli import main as cli_main
from rollart.config import load_scenario, parse_scenario
from rollart.launcher.validate import main as validate_main
from rollart.planner import PlanError, PlanResult, plan
from rollart.planner.inputs import read_inputs
from rollart.planner.layout import to_toml
from rollart.planner.search import (
    RUNGS,
    SearchLog,
    full_space,
    run_capped,
    sim_of,
    space,
    tp_variants,
)
from rollart.sim.harness import run_simulated

#: two pools on two hardware labels, the tiny model (so `rollart validate` passes here); the
#: planner simulates it as Qwen3-8B (``model="qwen3-8b"``)
SCENARIO = """
[run]
steps = 3
batch_size = 8
group_size = 4
max_turns = 3
max_tokens_per_turn = 16
max_tokens_per_trajectory = 1100

[model]
path = "tiny"
tiny_warmup = false
dtype = "float32"

[[pools]]
name = "fast"
hardware = "h800"
num_workers = {fast}
[pools.engine]
enforce_eager = true
max_model_len = 1152

[[pools]]
name = "wide"
hardware = "{wide_hw}"
num_workers = 2
[pools.engine]
enforce_eager = true
max_model_len = 1152

[[domains]]
name = "guess"
env = "game:GuessTheNumber-v0-easy"
pool = "fast"
reward = "env_return"

[[domains]]
name = "arith"
env = "rg:basic_arithmetic"
pool = "wide"
reward = "reasoning_gym"

[[env_hosts]]
name = "envhost"
threads = 4

[trainer]
num_processes = 2
"""

SEEDS = (0, 1)


def write(tmp_path: Path, *, fast: int = 3, wide_hw: str = "h20") -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO.format(fast=fast, wide_hw=wide_hw))
    return path


def test_plan_finds_the_exhaustive_best_and_writes_a_valid_scenario(tmp_path, capsys):
    path = write(tmp_path)
    res = plan(path, budget_s=120.0, seeds=SEEDS, model="qwen3-8b")
    # Exhaustive: every layout of the same space on the last rung's horizon and seeds.
    inputs = read_inputs(load_scenario(path), model="qwen3-8b")
    sweep = full_space(inputs)  # TP variants included
    assert any(c.wide_tp for c in sweep) and res.log.space == len(sweep)
    steps, warmup = RUNGS[-1]

    def on_sweep_seeds(c) -> float:
        return statistics.fmean(run_simulated(sim_of(inputs, c, steps), sd,
                                              warmup=warmup).step_time_s for sd in SEEDS)

    best = min(on_sweep_seeds(c) for c in sweep)
    # A search: some layouts are dropped before the last rung (racing may repeat the leaders
    # on more seeds than a sweep runs, where the layouts are within each other's noise).
    assert res.log.per_rung[-1] < len(sweep)
    # like with like: the chosen layout on the sweep's seeds (the planner's own score also
    # holds the seeds its race added)
    assert on_sweep_seeds(res.best.candidate) <= 1.05 * best
    # The written layout is the chosen one, and `rollart validate` accepts it.
    out = tmp_path / "plan.toml"
    res.write(out)
    chosen = res.best.candidate
    sc = load_scenario(out)
    assert sc.trainer.num_processes == chosen.trainer_gpus
    assert (sc.run.alpha, sc.run.redundancy) == (chosen.alpha, chosen.redundancy)
    by_label = {"h800": "fast", "h20": "wide"}
    assert [d.pool for d in sc.domains] == [by_label[lb] for lb in chosen.mapping]
    assert {p.name: p.num_workers for p in sc.pools} == {
        by_label[lb]: n for lb, n in chosen.pools(inputs).items()}
    assert validate_main([str(out), "--quiet"]) == 0
    assert "guess->" in res.table()


def test_the_planner_simulates_the_scenarios_own_online_affinity(tmp_path):
    """A scenario with ``[run.adaptive_affinity]`` on is planned with it on (spill and the KV
    working-set hold), as it will run; off, with the static mapping."""
    import msgspec

    path = write(tmp_path)
    sc = load_scenario(path)
    c = space(read_inputs(sc, model="qwen3-8b"))[0][0]
    assert sim_of(read_inputs(sc, model="qwen3-8b"), c, 3).adaptive_affinity is None
    on = msgspec.structs.replace(sc, run=msgspec.structs.replace(
        sc.run, adaptive_affinity=msgspec.structs.replace(sc.run.adaptive_affinity,
                                                          enabled=True, min_hold_s=3.0)))
    got = sim_of(read_inputs(on, model="qwen3-8b"), c, 3).adaptive_affinity
    assert got is not None and got.enabled and got.min_hold_s == 3.0


def test_refuses_hardware_that_cannot_hold_the_model(tmp_path):
    # 4M-token trajectories: Qwen3-32B's KV cache alone outgrows 8 H20s
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(fast=3, wide_hw="h20").replace("1100", "4000000").replace(
        "1152", "4000000").replace("num_processes = 2", "num_processes = 2\n"
                                   "max_tokens_per_microbatch = 4000000"))
    with pytest.raises(PlanError, match=r"hardware '(h800|h20)' cannot hold model 'qwen3-32b'.*GB"):
        plan(path, budget_s=5.0, model="qwen3-32b")


def test_refuses_a_cpu_scenario_naming_the_gpu_profiles_it_plans(tmp_path):
    for model in (None, "qwen3-8b"):
        with pytest.raises(PlanError, match=r"pools \['wide'\] run on hardware 'cpu': the planner "
                           r"plans layouts of simulated GPU hardware profiles \(h100, h20, h200, "
                           r"h800\)"):
            plan(write(tmp_path, wide_hw="cpu"), budget_s=5.0, model=model)
    # the CPU test model on GPU labels, with no --model: the same explanation
    with pytest.raises(PlanError, match=r"model.path 'tiny' is the project's CPU test model: "
                       r"the planner plans .*GPU hardware profiles"):
        plan(write(tmp_path), budget_s=5.0)


def test_refuses_a_trainer_larger_than_a_minibatch_naming_the_trainer_limit(tmp_path):
    # Qwen3-8B trains on 2 H800 at least; 8 // 8 minibatches leaves one row per minibatch.
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(fast=3, wide_hw="h20").replace(
        "num_processes = 2", "num_processes = 1\nnum_minibatches = 8"))
    with pytest.raises(PlanError, match=r"trainer: model 'qwen3-8b' needs at least 2 trainer "
                       r"GPUs .*run.batch_size // trainer.num_minibatches = 8 // 8 = 1 row"):
        plan(path, budget_s=5.0, model="qwen3-8b")


def test_refuses_a_trainer_larger_than_one_node_naming_the_trainer_limit(tmp_path):
    inputs = read_inputs(load_scenario(write(tmp_path, fast=12)), model="qwen3-8b")
    with pytest.raises(PlanError, match=r"needs at least 9 trainer GPUs .*more than one node "
                       r"of 8"):
        space(dataclasses.replace(inputs, trainer_min=9))


def test_a_budget_that_simulates_a_fraction_of_the_layouts_warns(tmp_path, capsys,
                                                                 monkeypatch):
    import rollart.planner.search as search

    # Every run takes 1 s of (fake) CPU clock: a 5 s budget (45% in the first round) covers
    # two of the first round's nine layouts.
    clock = [0.0]
    monkeypatch.setattr(search, "cpu_s", lambda: clock[0])

    def one_second(sim, seed, warmup, cap):
        clock[0] += 1.0
        return _FakeRun([30.0] * sim.steps)

    monkeypatch.setattr(search, "run_capped", one_second)
    out = tmp_path / "plan.toml"
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(out), "--budget-s", "5",
                     "--model", "qwen3-8b", "--seeds", "1"]) == 0
    cap = capsys.readouterr()
    # 8 trainer / pool mappings at their predicted TP, and the scenario's own layout as is
    line = ("warning: the budget (5 CPU s) simulated only 2 of the 9 layouts of the first round "
            "(each trainer / pool mapping, the scenario's own layout among them where the "
            "space holds it;")
    assert f"rollart plan: {line}" in cap.err and line in cap.out
    assert f"# {line}" in out.read_text()
    # named as the user gave it: the command line's flag, not the keyword of rollart.plan()
    assert "give a larger --budget-s\n" in cap.err and "budget_s" not in cap.err + cap.out


def test_refuses_an_unknown_model_as_the_model_option(tmp_path, capsys):
    # named as the user gave it: the keyword of rollart.plan(), or the command line's flag
    with pytest.raises(PlanError, match=r"^model='qwen9': no simulated model "
                       r"profile .*'qwen3-8b'"):
        plan(write(tmp_path), budget_s=5.0, model="qwen9")
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "p.toml"),
                     "--model", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert "rollart plan: error: --model 'qwen9': no simulated model profile" in err
    assert "model=" not in err


class _FakeRun:
    """What the search reads of a ``SimResult``."""

    def __init__(self, times: list[float]) -> None:
        self.steps = [{"step_time_s": t, "trainer_idle_s": 0.0} for t in times]
        self.step_time_s = statistics.fmean(times[1:])


def test_a_noisy_first_step_does_not_drop_the_best_layout(tmp_path, monkeypatch):
    """The best layout (trainer 4, both domains on h800, 20 s/step) draws one long step
    (45 s) first on the ranking seed; every other step of every layout is its mean +-10%.
    Ranked on that one step, the early rungs dropped it; its estimate's noise keeps it."""
    import rollart.planner.search as search

    best = (4, ("h800", "h800"))

    def mean_of(c) -> float:
        others = sorted(itertools.product((2, 4), itertools.product(("h800", "h20"), repeat=2)))
        base = 20.0 if (c.trainer_gpus, c.mapping) == best else 26.0 + others.index(
            (c.trainer_gpus, c.mapping))
        return base + (c.alpha != 2) + 2.0 * c.redundancy

    def fake_run(sim, seed, warmup, cap):
        c, steps = sim
        rng = random.Random(f"{c}|{seed}")
        times = [mean_of(c) * (1.0 + 0.1 * rng.uniform(-1, 1)) for _ in range(steps)]
        if (c.trainer_gpus, c.mapping) == best and seed == SEEDS[0]:
            times[1] = 45.0  # the first step after the warm-up: a long-tailed batch
        return _FakeRun(times)

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    monkeypatch.setattr(search, "run_capped", fake_run)
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    assert (res.best.candidate.trainer_gpus, res.best.candidate.mapping) == best
    assert (res.best.candidate.alpha, res.best.candidate.redundancy) == (2, 0)
    assert res.log.per_rung[-1] < res.log.space  # still a search: some never got that far


def test_refuses_too_few_gpus_for_one_engine_per_domain(tmp_path):
    # 1 H800 worker + 2 trainer ranks: Qwen3-8B's trainer needs 2 H800, leaving one engine
    # for two domains (the 2 H20 workers are dropped to h800 here by using one label).
    path = tmp_path / "s.toml"
    text = SCENARIO.format(fast=1, wide_hw="h800").replace(
        'name = "wide"\nhardware = "h800"\nnum_workers = 2', 'name = "wide"\nhardware = "h800"\n'
        'num_workers = 1')
    path.write_text(text.replace("num_processes = 2", "num_processes = 1"))
    with pytest.raises(PlanError, match=r"fewer than one per domain \(2\): short by 1 engine"):
        plan(path, budget_s=5.0, model="qwen3-8b")


def test_refuses_a_budget_too_small_for_one_candidate(tmp_path):
    with pytest.raises(PlanError, match=r"budget_s=0.001 is too small"):
        plan(write(tmp_path), budget_s=0.001, model="qwen3-8b")


@pytest.mark.parametrize(("budget", "message"), [
    ("0.001", "--budget-s 0.001 is too small: one simulated candidate"),
    ("1e12", "--budget-s must be > 0 and <= 604800 (a week), got 1e+12"),
])
def test_cli_budget_errors_name_the_budget_s_flag(tmp_path, capsys, budget, message):
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "p.toml"),
                     "--budget-s", budget, "--model", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert f"rollart plan: error: {message}" in err and "budget_s" not in err, err


def test_refuses_an_unknown_model_profile(tmp_path):
    path = tmp_path / "s.toml"
    # (tiny_warmup is the tiny model's own field: refused with a checkpoint path)
    path.write_text(SCENARIO.format(fast=3, wide_hw="h20").replace('"tiny"', '"/m/Llama-9"')
                    .replace("tiny_warmup = false\n", ""))
    with pytest.raises(PlanError, match=r"model.path '/m/Llama-9'.*'llama-9'.*pass model= "):
        plan(path, budget_s=5.0)


def test_cli_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(out), "--budget-s", "20",
                     "--model", "qwen3-8b", "--seeds", "1"]) == 0
    assert "SIMULATED" in capsys.readouterr().out
    assert validate_main([str(out), "--quiet"]) == 0
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(out), "--budget-s", "5",
                     "--force"]) == 2
    assert "rollart plan: error: model.path 'tiny' is the project's CPU test model" in \
        capsys.readouterr().err


@pytest.mark.parametrize("empty", ["", "  "])
def test_cli_refuses_an_empty_out_naming_it_empty(tmp_path, capsys, empty):
    # Path("") is ".": an empty --out must not read as "`.` is a directory"
    assert cli_main(["plan", str(write(tmp_path)), "--out", empty, "--budget-s", "1e-9",
                     "--model", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert err == ("rollart plan: error: --out is empty: name the file to write the planned "
                   "scenario to (e.g. --out plan.toml)\n")


@pytest.mark.parametrize(("out", "message"), [
    ("scenario", "is the input scenario"),
    ("existing", "exists; pass --force"),
    ("dir", "is a directory"),
    ("missing/p.toml", "does not exist"),
])
def test_cli_refuses_an_out_it_cannot_or_must_not_write_before_searching(
        tmp_path, capsys, out, message):
    scenario = write(tmp_path)
    before = scenario.read_text()
    (tmp_path / "existing").write_text("keep me")
    (tmp_path / "dir").mkdir()
    target = scenario if out == "scenario" else tmp_path / out
    # budget 1e-9: had the search run, it would have refused the budget instead
    assert cli_main(["plan", str(scenario), "--out", str(target), "--budget-s", "1e-9",
                     "--model", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert message in err and "budget" not in err, err
    assert scenario.read_text() == before and (tmp_path / "existing").read_text() == "keep me"


@pytest.mark.parametrize("budget", [float("inf"), 1e12, float("nan")])
def test_refuses_a_budget_that_is_not_a_finite_positive_number_of_seconds(tmp_path, budget):
    with pytest.raises(PlanError, match=r"budget_s must be > 0 and <= 604800"):
        plan(write(tmp_path), budget_s=budget, model="qwen3-8b")


def test_a_search_where_every_layout_stalls_is_refused_naming_it(tmp_path, monkeypatch):
    import rollart.planner as planner

    monkeypatch.setattr(planner, "successive_halving", lambda *a, **k: ([], SearchLog()))
    with pytest.raises(PlanError, match=r"no layout of .* could be simulated to the end"):
        plan(write(tmp_path), budget_s=5.0, model="qwen3-8b")


def test_a_run_past_its_cap_is_stopped_and_the_next_runs(tmp_path):
    inputs = read_inputs(load_scenario(write(tmp_path)), model="qwen3-8b")
    sim = sim_of(inputs, space(inputs)[0][0], steps=3)
    assert run_capped(sim, 0, 1, cap_s=1e-3) is None
    res = run_capped(sim, 0, 1, cap_s=600.0)
    assert res is not None and res.step_time_s > 0


def test_to_toml_round_trips_nested_tables_and_strings():
    raw = {"run": {"steps": 2, "seed": 1}, "model": {"path": "tiny"},
           "pools": [{"name": "a", "engine": {"max_num_seqs": 4}}],
           "domains": [{"name": "d", "env": "game:X", "pool": "a", "reward": "env_return",
                        "system_prompt": 'say "hi"\n\tthen \x7f stop',
                        "chat_template_kwargs": {"enable_thinking": False}}]}
    sc = parse_scenario(to_toml(raw))
    assert sc.domains[0].system_prompt == 'say "hi"\n\tthen \x7f stop'
    assert sc.domains[0].chat_template_kwargs == {"enable_thinking": False}
    assert sc.pools[0].engine.max_num_seqs == 4


# -- workload profiles measured from a run folder ------------------------------------------

def write_run(run_dir: Path, *, domains: tuple[str, ...] = ("guess", "arith")) -> Path:
    """A FIXTURE run folder: two steps of metrics.jsonl and a few transcripts, with the
    fields a real run writes (``StepMetrics.by_domain``, ``TranscriptRecorder.record``).
    guess: 3 turns of 10 generated tokens, a 100-token prompt and 20-token observations;
    arith: one turn of 8 tokens after a 42-token prompt (a transcript without per-turn
    context_tokens: its prompt is num_tokens - num_generated)."""
    import json

    run_dir.mkdir()
    counts = {"guess": {"finished": 4, "finished_tokens": 120, "finished_turns": 12,
                        "trained": 4, "started": 5},
              "arith": {"finished": 4, "finished_tokens": 32, "finished_turns": 4}}
    rows = [{"step": s, "by_domain": {d: counts[d] for d in domains}} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = []
    for gen in ((8, 12, 10), (10, 10, 10)):
        recs.append({"domain": "guess", "num_turns": 3, "num_tokens": 160 + sum(gen),
                     "num_generated": sum(gen),
                     "turns": [{"num_tokens": g, "context_tokens": c}
                               for g, c in zip(gen, (100, 20, 20), strict=True)]})
    recs.append({"domain": "arith", "num_turns": 1, "num_tokens": 50, "num_generated": 8,
                 "turns": [{"num_tokens": 8}]})
    (run_dir / "transcripts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_dir


def test_profiles_from_a_run_folder_measure_turns_tokens_and_context(tmp_path):
    from rollart.planner.inputs import default_profile
    from rollart.planner.measured import measure_profiles

    sc = load_scenario(write(tmp_path))
    m = measure_profiles(write_run(tmp_path / "run"), sc)
    guess, arith = m.profiles["guess"], m.profiles["arith"]
    assert guess.num_turns.mean == 3 and not guess.num_turns.draws  # every transcript: 3
    assert guess.response_tokens.mean == pytest.approx(10.0)
    assert guess.response_tokens.std == pytest.approx(statistics.pstdev([8, 12, 10, 10, 10, 10]))
    assert (guess.prompt_tokens.mean, guess.obs_tokens.mean) == (100, 20)
    assert (arith.prompt_tokens.mean, arith.num_turns.mean) == (42, 1)
    assert arith.response_tokens.mean == pytest.approx(8.0)
    # env latency is not in a run folder: it stays assumed
    assumed = default_profile("guess", "game:GuessTheNumber-v0-easy", 3, 16, 1100)
    assert guess.step_latency_s == assumed.step_latency_s
    assert m.measured["arith"] == ("num_turns", "response_tokens", "prompt_tokens")
    assert m.trajectories == {"guess": 8, "arith": 8}


class _Searched(Exception):
    pass


def _no_search(monkeypatch) -> list:
    """Stop plan() at the search, keeping the inputs it was given (the wiring, not the search)."""
    seen: list = []

    def stop(inputs, **kw):
        seen.append(inputs)
        raise _Searched

    monkeypatch.setattr("rollart.planner.successive_halving", stop)
    return seen


def test_plan_and_cli_take_profiles_from_a_run_folder(tmp_path, monkeypatch, capsys):
    seen = _no_search(monkeypatch)
    run_dir = write_run(tmp_path / "run", domains=("guess",))
    path = write(tmp_path)
    # a domain the run did not train is refused, naming it and what the run has
    with pytest.raises(PlanError, match=r"^profiles_from= .*domain\(s\) \['arith'\].*the run "
                       r"has \['guess'\]"):
        plan(path, budget_s=5.0, model="qwen3-8b", profiles_from=run_dir)
    assert cli_main(["plan", str(path), "--out", str(tmp_path / "p.toml"), "--model",
                     "qwen3-8b", "--profiles-from", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "rollart plan: error: --profiles-from " in err and "profiles_from=" not in err
    # profiles= covers it: the rest is measured
    given = read_inputs(load_scenario(path), model="qwen3-8b").profiles[1]
    with pytest.raises(_Searched):
        plan(path, budget_s=5.0, model="qwen3-8b", profiles_from=run_dir,
             profiles={"arith": given})
    assert seen[-1].profiles[0].prompt_tokens.mean == 100
    assert seen[-1].profiles[1] is given
    with pytest.raises(_Searched):
        cli_main(["plan", str(path), "--out", str(tmp_path / "p.toml"), "--model", "qwen3-8b",
                  "--profiles-from", str(write_run(tmp_path / "run2"))])
    assert [p.prompt_tokens.mean for p in seen[-1].profiles] == [100, 42]


def test_the_budget_counts_cpu_seconds_so_other_work_on_the_machine_does_not_shrink_it(
        tmp_path, monkeypatch):
    import rollart.planner.search as search

    # Every run takes 1 s of (fake) CPU while the wall clock jumps 100 s, as on a machine
    # busy with other work: the 5 s budget still covers two of the first round's layouts, as
    # it does on a quiet machine (test above).
    cpu, wall = [0.0], [0.0]
    monkeypatch.setattr(search, "cpu_s", lambda: cpu[0])
    monkeypatch.setattr(search.time, "perf_counter", lambda: wall[0])

    def one_cpu_second(sim, seed, warmup, cap):
        cpu[0] += 1.0
        wall[0] += 100.0
        return _FakeRun([30.0] * sim.steps)

    monkeypatch.setattr(search, "run_capped", one_cpu_second)
    res = plan(write(tmp_path), budget_s=5.0, model="qwen3-8b", seeds=(0,))
    assert res.log.per_rung[0] == 2
    assert res.log.cpu_s <= 5.0 and res.log.wall_s >= 200.0
    assert f"{res.log.cpu_s:.0f} CPU s of 5 s, {res.log.wall_s:.0f} s wall" in res.table()


def test_no_budget_decision_reads_the_wall_clock(tmp_path, monkeypatch):
    """The whole search (every rung, the race, a first layout that stalls with budget left)
    runs the same whether the wall clock stands still or jumps 1000 s per run."""
    import rollart.planner.search as search

    ran = []

    def fake_run(sim, seed, warmup, cap):  # two layouts within each other's noise: a race
        c, steps = sim
        ran.append(sim)
        mean = {(4, ("h800", "h800")): 20.0, (2, ("h800", "h800")): 20.5}.get(
            (c.trainer_gpus, c.mapping), 30.0)
        rng = random.Random(f"{c}|{seed}")
        return _FakeRun([mean * (1.0 + 0.3 * rng.uniform(-1, 1)) for _ in range(steps)])

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    cpu, wall, jump = [0.0], [0.0], [0.0]
    monkeypatch.setattr(search, "cpu_s", lambda: cpu[0])
    monkeypatch.setattr(search.time, "perf_counter", lambda: wall[0])

    def timed_run(sim, seed, warmup, cap):
        cpu[0] += 1.0
        wall[0] += jump[0]
        if not ran:  # the scenario's own layout stalls; the search goes on
            ran.append(sim)
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", timed_run)
    logs = []
    for jump[0] in (0.0, 1000.0):
        cpu[0] = wall[0] = 0.0
        ran.clear()
        res = plan(write(tmp_path), budget_s=400.0, seeds=SEEDS, model="qwen3-8b")
        logs.append((res.log.runs, res.log.per_rung, res.log.race_seeds, res.best.candidate,
                     list(ran)))
    assert logs[0] == logs[1]
    assert len(logs[0][1]) == len(RUNGS) and logs[0][2] > 0  # every rung and the race ran


def _runs_fake(monkeypatch, stall_first: int = 0) -> tuple[list, list, list]:
    """Fake runs for the ``max_runs`` tests: two layouts within each other's noise (a race),
    the first ``stall_first`` runs stalling; each run costs ``per_run[0]`` x 1, 1.5 or 2 fake
    CPU seconds. Returns (runs made, CPU clock, per-run cost)."""
    import rollart.planner.search as search

    ran: list = []
    cpu, per_run = [0.0], [1.0]

    def fake_run(sim, seed, warmup, cap):
        c, steps = sim
        ran.append(sim)
        cpu[0] += per_run[0] * (1.0 + 0.5 * (len(ran) % 3))  # uneven runs
        if len(ran) <= stall_first:
            return None
        mean = {(4, ("h800", "h800")): 20.0, (2, ("h800", "h800")): 20.5}.get(
            (c.trainer_gpus, c.mapping), 30.0)
        rng = random.Random(f"{c}|{seed}")
        return _FakeRun([mean * (1.0 + 0.3 * rng.uniform(-1, 1)) for _ in range(steps)])

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    monkeypatch.setattr(search, "cpu_s", lambda: cpu[0])
    monkeypatch.setattr(search, "run_capped", fake_run)
    return ran, cpu, per_run


def test_max_runs_makes_the_plan_the_same_however_long_each_run_takes(tmp_path, monkeypatch):
    """With ``max_runs`` the rounds stop on runs: two searches whose runs cost different CPU
    (a machine twice as fast, runs of uneven length) run the same layouts and choose the
    same plan, within the rounds' shares of the runs (0.45 / 0.75 / 0.95 of 40: 18, 30 and
    38, each round stopping before the run that would pass its share); without it, the CPU
    budget decides how far each gets."""
    ran, cpu, per_run = _runs_fake(monkeypatch)

    def search_once(cost: float, **kw) -> tuple:
        cpu[0], per_run[0] = 0.0, cost
        ran.clear()
        res = plan(write(tmp_path), seeds=SEEDS, model="qwen3-8b", **kw)
        return res.log.runs, res.log.per_rung, res.best.candidate, list(ran), res

    fast, slow = (search_once(cost, budget_s=10_000.0, max_runs=40) for cost in (1.0, 2.0))
    assert fast[:4] == slow[:4]
    res = fast[4]
    # 9 layouts (all of the first round, within 18), then 21 one-seed runs (to 30), then 4
    # candidates of 2 seeds (to 38): no room left for a racing seed of the leader and the 3
    # candidates not yet resolved against it
    assert (res.log.per_rung, res.log.runs, res.log.race_seeds) == ([9, 21, 4], 38, 0)
    assert res.log.limited_by == {"runs"}
    assert "searched 38 runs of 40 over" in res.table()
    # the later rounds and the race that N cut short are named, with what they left
    assert (res.log.later_rungs, res.log.race_cut_racers) == ([(24, 3, 21), (11, 7, 4)], 3)
    assert [w.split(" left ")[-1].split(" unrun")[0] for w in res.warnings[:2]] == [
        "3 of the 24 candidates of the second round", "7 of the 11 candidates of the third round"]
    assert "stopped the race on further seeds with 3 candidate(s) not yet resolved" in \
        res.warnings[2]
    assert all(w.endswith("give a larger max_runs") for w in res.warnings)
    # the budget only ends the search: one that holds the 38 runs (about 57 CPU s here) gives
    # the same search, though its rounds' shares of it would not have held them
    assert search_once(1.0, budget_s=60.0, max_runs=40)[:4] == fast[:4]
    # 100 runs: the race gets the runs the last round leaves
    res = search_once(1.0, budget_s=10_000.0, max_runs=100)[4]
    assert res.log.race_seeds > 0 and res.log.runs <= 100
    assert (res.log.later_rungs, res.log.race_cut_racers, res.warnings) == (
        [(24, 0, 24), (16, 0, 16)], 0, [])
    # the CPU budget alone: the slower machine gets less far
    fast, slow = (search_once(cost, budget_s=60.0) for cost in (1.0, 2.0))
    assert slow[0] < fast[0]
    # 60 CPU s on the slower machine: every round and the race are cut, each named
    assert (slow[4].log.later_rungs, slow[4].log.race_cut_racers) == (
        [(24, 18, 6), (6, 4, 2)], 1)
    assert [w.split(") ")[1].split(" ")[0] for w in slow[4].warnings] == [
        "simulated", "left", "left", "stopped"]


def test_max_runs_counts_stalled_runs_and_names_itself_when_it_binds(tmp_path, monkeypatch,
                                                                      capsys):
    ran, cpu, per_run = _runs_fake(monkeypatch, stall_first=5)
    # every run of the first round's share (0.45 x 4 = 1.8: the first run only) stalls
    with pytest.raises(PlanError, match=r"too small or max_runs 4 too few runs"):
        plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", max_runs=4)
    assert len(ran) == 1
    # a stall is not a limit: 5 of the 9 first-round layouts stall, all 9 start (within 0.45 x
    # 40 = 18 runs), and the warning says they stalled instead of asking for a larger limit
    ran.clear()
    cpu[0] = 0.0
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0,), max_runs=40)
    assert (res.log.first_rung_started, res.log.per_rung[0]) == (9, 4)
    assert any(w.startswith("5 of the 9 layouts of the first round stalled") for w in
               res.warnings)
    assert not any("first round" in w and "give a larger" in w for w in res.warnings)
    # every layout stalls and neither limit binds: the error does not blame max_runs
    _runs_fake(monkeypatch, stall_first=10_000)
    with pytest.raises(PlanError, match=r"too small$"):
        plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", max_runs=1000)
    # a limit that leaves first-round layouts unrun is named: 0.45 x 8 = 3.6 runs, one stalls
    ran, cpu, per_run = _runs_fake(monkeypatch, stall_first=1)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0,), max_runs=8)
    assert (res.log.first_rung_started, res.log.per_rung[0]) == (3, 2)
    assert any("simulated only 2 of the 9 layouts" in w and "(1 more started and was "
               "dropped)" in w and w.endswith("give a larger max_runs") for w in res.warnings)
    assert "(10000 CPU s, 8 runs)" in res.warnings[-1]
    # both limits bind at once: both are named
    ran, cpu, per_run = _runs_fake(monkeypatch)
    res = plan(write(tmp_path), budget_s=1.6, model="qwen3-8b", seeds=(0,), max_runs=2)
    assert res.log.limited_by == {"budget", "runs"}
    # each line names the limits that bound where it speaks of: both in the first round,
    # the runs alone in the second
    assert res.log.phase_limits == {"rung0": {"budget", "runs"}, "rung1": {"runs"}}
    first = next(w for w in res.warnings if "of the first round" in w)
    second = next(w for w in res.warnings if "of the second round" in w)
    assert first.endswith("give a larger budget_s or max_runs")
    assert second.endswith("give a larger max_runs")
    # on the command line, the flags: --max-runs when the runs bind, --budget-s when it does
    _runs_fake(monkeypatch)
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "q.toml"),
                     "--max-runs", "4", "--model", "qwen3-8b", "--seeds", "1"]) == 0
    assert "give a larger --max-runs\n" in capsys.readouterr().err
    _runs_fake(monkeypatch)
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "p.toml"),
                     "--budget-s", "6", "--max-runs", "400", "--model", "qwen3-8b",
                     "--seeds", "1"]) == 0
    err = capsys.readouterr().err
    assert "give a larger --budget-s\n" in err and "--max-runs" not in err


def test_a_first_round_layout_stopped_at_the_budgets_end_is_a_budget_warning_not_a_stall(
        tmp_path, monkeypatch):
    """The first round's last layout starts inside the budget's share and is stopped at its
    end: the warning asks for a larger budget, and says nothing stalled."""
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped

    def capped(sim, seed, warmup, cap):
        cost = 3.0 if len(ran) == 8 else 1.0  # the ninth run outlasts what is left
        if cost > cap:
            ran.append(sim)
            cpu[0] += cap
            return None
        before = cpu[0]
        res = fake_run(sim, seed, warmup, cap)
        cpu[0] = before + cost
        return res

    monkeypatch.setattr(search, "run_capped", capped)
    res = plan(write(tmp_path), budget_s=20.0, model="qwen3-8b", seeds=(0,))
    assert (res.log.first_rung_started, res.log.first_rung_cut, res.log.per_rung[0]) == (9, 1, 8)
    assert any("simulated only 8 of the 9 layouts" in w and "dropped" not in w
               and w.endswith("give a larger budget_s") for w in res.warnings)
    assert not any("stalled" in w for w in res.warnings)


def test_a_second_round_run_stopped_at_the_budgets_end_counts_as_left_by_the_budget(
        tmp_path, monkeypatch):
    """The second round's first run outlasts its share of the budget and is stopped at its
    end: none of its candidates ended, the warning counts that one among those the budget
    left (all 24, not 23), and says the plan is the first round's best, the later rounds
    unrun."""
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped

    def capped(sim, seed, warmup, cap):
        if sim[1] == search.RUNGS[1][0]:
            ran.append(sim)
            cpu[0] += cap
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", capped)
    res = plan(write(tmp_path), budget_s=100.0, model="qwen3-8b", seeds=(0,))
    assert (res.log.per_rung, res.log.later_rungs, res.log.cut_runs) == ([9], [(24, 24, 0)], 1)
    assert res.best.rung == 0
    assert any(w.startswith("the budget (100 CPU s) left all 24 candidates of the second round "
                            "unrun or stopped: the plan is the best of the first round, on its "
                            "shorter runs, and no later round or race ran")
               and w.endswith("give a larger budget_s") for w in res.warnings)
    assert not any("of the rest" in w or "first round (" in w for w in res.warnings)
    assert res.log.first_rung_cut == 0


@pytest.mark.parametrize("max_runs", range(4, 15))
def test_a_round_a_limit_left_wholly_unrun_names_the_round_the_plan_comes_from(
        tmp_path, monkeypatch, max_runs):
    """Where ``max_runs`` leaves every candidate of a later round unrun, the plan is the round
    before's best, and the warning says so (never "the best of the rest")."""
    _runs_fake(monkeypatch)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=SEEDS,
               max_runs=max_runs)
    for rung, (n, short, scored) in enumerate(res.log.later_rungs, 1):
        if not scored:
            assert short == n and res.best.rung == rung - 1, res.log.later_rungs
            assert any(f"left all {n} candidates of the {('second', 'third')[rung - 1]} round"
                       f" unrun or stopped: the plan is the best of the "
                       f"{('first', 'second')[rung - 1]} round" in w for w in res.warnings)
        else:
            assert res.best.rung >= rung


def test_a_later_round_that_stalls_with_budget_left_says_so_and_blames_no_limit(
        tmp_path, monkeypatch):
    """Every run of the second round stalls well inside the budget: the plan is the first
    round's best; the warning says none ended and asks for no larger limit, and the online
    affinity line does not blame the budget."""
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped

    def capped(sim, seed, warmup, cap):
        if sim[1] == search.RUNGS[1][0]:
            ran.append(sim)
            cpu[0] += 1.0
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", capped)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert (res.log.per_rung, res.log.later_rungs, res.best.rung) == ([9], [(24, 0, 0)], 0)
    assert res.warnings == [
        "none of the 24 candidates of the second round ended (24 stalled or overran their "
        "cap): the plan is the best of the first round, on its shorter runs, and no later "
        "round or race ran"]
    assert not res.log.online_affinity_short
    assert res.log.online_affinity.startswith("online affinity was not tried: the search ended")


def test_the_race_warning_counts_every_candidate_not_yet_resolved(tmp_path, monkeypatch):
    """Every layout is as fast as the others: when ``max_runs`` stops the race, the warning
    counts every candidate not yet resolved against the leader, not only the (at most
    ``RACE_WIDTH``) that race."""
    import rollart.planner.noise as noise
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)

    def same(sim, seed, warmup, cap):
        c, steps = sim
        ran.append(sim)
        cpu[0] += 1.0
        rng = random.Random(f"{c}|{seed}")
        return _FakeRun([20.0 * (1.0 + 0.3 * rng.uniform(-1, 1)) for _ in range(steps)])

    monkeypatch.setattr(search, "run_capped", same)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=SEEDS, max_runs=80)
    close = sum(noise.unresolved(s, res.ranked[0]) for s in res.ranked[1:])
    assert res.log.race_cut_racers == close > noise.RACE_WIDTH
    assert any(f"with {close} candidate(s) not yet resolved" in w for w in res.warnings)


def test_a_first_round_cut_and_a_straggling_race_warn_only_of_the_first_round(
        tmp_path, monkeypatch):
    """A first-round run stopped at its share's end is that round's; the later rounds run
    every candidate, and a race run stopped as a straggler (budget left) is no limit."""
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped
    first = []

    def capped(sim, seed, warmup, cap):
        if sim[1] == search.RUNGS[0][0]:
            first.append(sim)
            if len(first) == 9:  # the first round's last layout meets its share's end
                ran.append(sim)
                cpu[0] = search.RUNG_SHARES[0] * 10_000.0
                return None
        if seed >= 2:  # the race's seeds straggle, well inside the budget
            ran.append(sim)
            cpu[0] += cap
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", capped)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert res.log.first_rung_cut == 1 and len(res.log.per_rung) == len(search.RUNGS)
    assert all(short == 0 and scored == n for n, short, scored in res.log.later_rungs)
    assert res.log.race_cut_racers == 0
    assert [w.split(" ")[3] for w in res.warnings] == ["CPU"]  # the first round's line only
    assert "simulated only 8 of the 9 layouts" in res.warnings[0]


def _later_rounds_fake(monkeypatch, stop) -> None:
    """``_runs_fake`` where ``stop(sim, seed, cap, cpu)`` returning True makes that run end
    without a result (having set the fake CPU clock as it likes)."""
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped

    def capped(sim, seed, warmup, cap):
        if stop(sim, seed, cap, cpu):
            ran.append(sim)
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", capped)


def test_later_round_stalls_are_told_apart_from_limits(tmp_path, monkeypatch):
    """Every second second-round run stalls (1 CPU s each, the budget ample): 12 of 24 are
    dropped, a line says so and asks for no limit. With ``max_runs`` 30 the round is also
    cut: one line gives both counts and how many ended, and names ``max_runs``."""
    import rollart.planner.search as search

    count = [0]

    def stall_every_second(sim, seed, cap, cpu):
        if sim[1] != search.RUNGS[1][0]:
            return False
        count[0] += 1
        cpu[0] += 1.0
        return count[0] % 2 == 0

    _later_rounds_fake(monkeypatch, stall_every_second)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert res.log.later_rungs[0] == (24, 0, 12) and not res.log.limited_by
    assert res.warnings == ["12 of the 24 candidates of the second round stalled or overran "
                            "their cap and were dropped: the plan is the best of the rest"]
    count[0] = 0
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1), max_runs=30)
    assert res.log.later_rungs[0] == (24, 11, 7)
    assert res.warnings[0] == (
        "the budget (10000 CPU s, 30 runs) left 11 of the 24 candidates of the second round "
        "unrun or stopped (the round before's best, longer runs) and 6 stalled or overran "
        "their cap: the plan is the best of the 7 that ended; give a larger max_runs")


def test_a_later_round_cut_and_stalled_with_nothing_ended_gives_both_counts(
        tmp_path, monkeypatch):
    """``max_runs`` 12 leaves 5 first-round layouts run; of the second round's 12 candidates 4
    start and stall and 8 are left unrun: the plan is the first round's, and the line counts
    both (not "left all 12")."""
    import rollart.planner.search as search

    def stall_second(sim, seed, cap, cpu):
        cpu[0] += 1.0 if sim[1] == search.RUNGS[1][0] else 0.0
        return sim[1] == search.RUNGS[1][0]

    _later_rounds_fake(monkeypatch, stall_second)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1), max_runs=12)
    assert (res.log.later_rungs, res.best.rung) == ([(12, 8, 0)], 0)
    assert any(w.startswith("none of the 12 candidates of the second round ended (4 stalled "
                            "or overran their cap, 8 left unrun or stopped by the budget "
                            "(10000 CPU s, 12 runs)): the plan is the best of the first round")
               and w.endswith("give a larger max_runs") for w in res.warnings)
    assert not any("left all" in w for w in res.warnings)
    # a limit cut that round too: the online-affinity line asks for it, naming max_runs
    assert res.log.online_affinity_short
    assert any(w.startswith("online affinity was not tried on the best layout: the budget ran "
                            "out before it") and w.endswith("give a larger max_runs to have "
                                                           "it tried") for w in res.warnings)


def test_online_affinity_line_follows_why_its_round_did_not_run(tmp_path, monkeypatch):
    """A first-round run is stopped at its share's end, then every second-round run stalls:
    the online-affinity line says the search ended before its round, blaming no budget. A
    twin stopped at the budget's end in the last round is a limit, not a stall: the warning
    asks for a larger budget."""
    import rollart.planner.search as search

    first = []

    def cut_then_stall(sim, seed, cap, cpu):
        if sim[1] == search.RUNGS[0][0]:
            first.append(sim)
            if len(first) == 9:
                cpu[0] = search.RUNG_SHARES[0] * 10_000.0
                return True
        if sim[1] == search.RUNGS[1][0]:
            cpu[0] += 1.0
            return True
        return False

    _later_rounds_fake(monkeypatch, cut_then_stall)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert (res.log.limited_by, res.log.later_rungs) == ({"budget"}, [(24, 0, 0)])
    assert not res.log.online_affinity_short
    assert res.log.online_affinity.startswith("online affinity was not tried: the search ended")
    assert not any("online affinity" in w for w in res.warnings)

    def twin_cut(sim, seed, cap, cpu):
        c, steps = sim
        if steps == search.RUNGS[2][0] and c.online_affinity:
            cpu[0] = 1e9  # the budget ends during its first run
            return True
        return False

    _later_rounds_fake(monkeypatch, twin_cut)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert res.log.online_affinity_cut and res.log.online_affinity_short
    assert "stopped at the budget's end" in res.log.online_affinity
    assert any(w.startswith("online affinity on the best layouts of the second round: stopped "
                            "at the budget's end") and w.endswith("give a larger budget_s to "
                                                                 "have it tried")
               for w in res.warnings)
    assert not any("stalled" in w for w in res.warnings)


@pytest.mark.parametrize("budget_end", [True, False])
def test_a_race_run_stopped_at_the_budgets_end_is_named_a_straggler_is_not(
        tmp_path, monkeypatch, budget_end):
    """The race's first seed (2, after seeds 0 and 1) does not end: where the budget ran out
    during it, the warning says the race was stopped with the candidates not yet resolved;
    where it was a straggler (the budget left), the race ends without a limit to blame."""
    import rollart.planner.noise as noise
    import rollart.planner.search as search

    ran, cpu, _ = _runs_fake(monkeypatch)
    fake_run = search.run_capped

    def capped(sim, seed, warmup, cap):
        if seed >= 2:
            ran.append(sim)
            cpu[0] += 1e9 if budget_end else cap
            return None
        return fake_run(sim, seed, warmup, cap)

    monkeypatch.setattr(search, "run_capped", capped)
    res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=(0, 1))
    assert res.log.race_seeds == 0 and res.log.per_rung and len(res.log.later_rungs) == 2
    race = [w for w in res.warnings if "stopped the race" in w]
    if budget_end:
        close = sum(noise.unresolved(s, res.ranked[0]) for s in res.ranked[1:])
        assert res.log.race_cut_racers == close >= 1 and len(race) == 1
        assert f"with {res.log.race_cut_racers} candidate(s) not yet resolved" in race[0]
    else:
        assert res.log.race_cut_racers == 0 and not race


@pytest.mark.parametrize("seeds", [(0,), (0, 1), (0, 1, 2)])
def test_max_runs_is_never_passed(tmp_path, monkeypatch, seeds):
    """Whatever N and however many seeds the last round runs each candidate on, the search
    makes at most N runs (the first run of all, N = 1 included)."""
    for max_runs in range(1, 45):
        ran, _, _ = _runs_fake(monkeypatch)
        res = plan(write(tmp_path), budget_s=10_000.0, model="qwen3-8b", seeds=seeds,
                   max_runs=max_runs)
        assert len(ran) == res.log.runs <= max_runs, max_runs


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_max_runs_not_a_whole_number_of_at_least_one_is_refused(tmp_path, bad):
    with pytest.raises(PlanError, match=r"max_runs must be a whole number >= 1, got "):
        plan(write(tmp_path), budget_s=5.0, model="qwen3-8b", max_runs=bad)


def test_cli_max_runs_below_one_is_refused_naming_the_flag(tmp_path, capsys):
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "p.toml"),
                     "--max-runs", "0", "--model", "qwen3-8b"]) == 2
    assert capsys.readouterr().err == (
        "rollart plan: error: --max-runs must be a whole number >= 1, got 0\n")


def test_cpu_s_does_not_count_time_spent_waiting():
    from rollart.planner.search import cpu_s

    start = cpu_s()
    time.sleep(0.5)
    assert cpu_s() - start < 0.25


def test_a_profilers_sigprof_handler_and_timer_are_handed_back_after_a_run(monkeypatch):
    import signal

    import rollart.planner.search as search

    def profiler(signum, frame):  # a sampling profiler's handler, every 100 CPU s
        pass

    monkeypatch.setattr(search, "run_simulated", lambda sim, seed, warmup=1: "ran")
    previous = signal.signal(signal.SIGPROF, profiler)
    signal.setitimer(signal.ITIMER_PROF, 100.0, 100.0)
    try:
        assert run_capped(None, 0, 1, cap_s=5.0) == "ran"
        assert signal.getsignal(signal.SIGPROF) is profiler
        delay, interval = signal.getitimer(signal.ITIMER_PROF)
        # the kernel rounds the timer to its tick: a little above 100 s can come back
        assert 99.0 < interval < 101.0 and 90.0 < delay < 101.0
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def test_a_runs_cap_counts_its_cpu_seconds_not_its_wall_seconds(monkeypatch):
    import rollart.planner.search as search

    def waits(sim, seed, warmup=1):  # wall time passes, almost no CPU: not stopped
        time.sleep(0.5)
        return "waited"

    monkeypatch.setattr(search, "run_simulated", waits)
    assert run_capped(None, 0, 1, cap_s=0.05) == "waited"

    def spins(sim, seed, warmup=1):  # CPU past the cap: stopped
        start = search.cpu_s()
        while search.cpu_s() < start + 5.0:
            pass
        return "spun"

    monkeypatch.setattr(search, "run_simulated", spins)
    assert run_capped(None, 0, 1, cap_s=0.05) is None


@pytest.mark.parametrize("run_model", ["tiny", "/models/Qwen3-8B", None])
def test_profiles_from_a_run_of_another_model_warns_naming_both(tmp_path, capsys, monkeypatch,
                                                                run_model):
    import json

    import rollart.planner.search as search

    clock = [0.0]  # every simulated run takes 1 s of (fake) CPU clock
    monkeypatch.setattr(search, "cpu_s", lambda: clock[0])

    def one_second(sim, seed, warmup, cap):
        clock[0] += 1.0
        return _FakeRun([30.0] * sim.steps)

    monkeypatch.setattr(search, "run_capped", one_second)
    run_dir = write_run(tmp_path / "run")
    if run_model is not None:  # the resolved scenario `rollart run` writes
        (run_dir / "config.json").write_text(json.dumps({"model": {"path": run_model}}))
    out = tmp_path / "plan.toml"
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(out), "--budget-s", "100",
                     "--model", "qwen3-8b", "--seeds", "1", "--profiles-from",
                     str(run_dir)]) == 0
    err = capsys.readouterr().err
    line = (f"warning: the run folder {run_dir} ran model 'tiny' (its config.json), the plan "
            "is for model 'qwen3-8b': the turns per trajectory, generated tokens per turn, "
            "prompt tokens, observation tokens come from the run, counted in its model's "
            "tokens; the per-token costs (prefill, decode, training) come from the simulated "
            "'qwen3-8b' profile")
    if run_model == "tiny":
        assert f"rollart plan: {line}\n" in err and f"# {line}" in out.read_text()
    else:  # the same model, or a folder that does not say: nothing to warn about
        assert "ran model" not in err and "ran model" not in out.read_text()


@pytest.mark.parametrize(("metrics", "message"), [
    (None, "no metrics.jsonl"),
    ("", "holds no steps"),
    ('{"step": 1}\n', "no per-domain counters"),
    ('{"step": 1, "by_domain": {}}\nnot json\n{"step": 3}\n', "line 2 is not JSON"),
])
def test_profiles_from_a_folder_without_metrics_is_refused(tmp_path, metrics, message):
    from rollart.planner.measured import measure_profiles

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if metrics is not None:
        (run_dir / "metrics.jsonl").write_text(metrics)
    with pytest.raises(PlanError, match=message):
        measure_profiles(run_dir, load_scenario(write(tmp_path)))
    with pytest.raises(PlanError, match="not a folder"):
        measure_profiles(tmp_path / "nowhere", load_scenario(write(tmp_path)))


@pytest.mark.parametrize(("metrics", "message"), [
    ("[1, 2]\n", r"line 1 is a JSON list, not an object"),
    ('{"step": 1, "by_domain": [1]}\n', r"record 1: by_domain is a JSON list"),
    ('{"step": 1, "by_domain": {}}\n{"step": 2, "by_domain": {"guess": {"finished": null}}}\n',
     r"record 2: by_domain.guess.finished is None, not a count"),
    ('{"step": 1, "by_domain": {"guess": 5}}\n', r"record 1: by_domain.guess is 5, not a count"),
])
def test_profiles_from_metrics_of_another_shape_are_refused_naming_the_record(
        tmp_path, metrics, message):
    from rollart.planner.measured import measure_profiles

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(metrics)
    with pytest.raises(PlanError, match=rf"{run_dir / 'metrics.jsonl'}: {message}"):
        measure_profiles(run_dir, load_scenario(write(tmp_path)))


def test_profiles_from_files_that_are_not_text_or_not_objects_are_refused_naming_them(tmp_path):
    from rollart.planner.measured import measure_profiles

    sc = load_scenario(write(tmp_path))
    run_dir = write_run(tmp_path / "run")
    (run_dir / "transcripts.jsonl").write_text('{"domain": "guess"}\n[1]\n')
    with pytest.raises(PlanError, match=r"transcripts.jsonl: line 2 is a JSON list"):
        measure_profiles(run_dir, sc)
    (run_dir / "metrics.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(PlanError, match=r"metrics.jsonl: not UTF-8 text"):
        measure_profiles(run_dir, sc)


def test_profiles_from_transcripts_skip_turns_of_another_shape(tmp_path):
    from rollart.planner.measured import measure_profiles

    run_dir = write_run(tmp_path / "run")
    with (run_dir / "transcripts.jsonl").open("a") as f:
        f.write('{"domain": "guess", "turns": [5]}\n')  # a turn that is not an object
        f.write('{"domain": "guess", "num_turns": "3", "turns": [{"num_tokens": "x"}]}\n')
    m = measure_profiles(run_dir, load_scenario(write(tmp_path)))
    assert m.transcripts["guess"] == 3  # the two fixture records and the string-count one
    assert m.profiles["guess"].response_tokens.mean == pytest.approx(10.0)


def test_a_cpu_scenario_is_refused_before_its_profiles_folder_is_read(tmp_path):
    with pytest.raises(PlanError, match=r"pools \['wide'\] run on hardware 'cpu'"):
        plan(write(tmp_path, wide_hw="cpu"), budget_s=5.0, model="qwen3-8b",
             profiles_from=tmp_path / "nowhere")


def test_a_rung_of_fewer_candidates_than_it_keeps_reports_no_negative_count(
        tmp_path, monkeypatch):
    import rollart.planner.search as search

    one_layout = search.space
    monkeypatch.setattr(search, "space", lambda inputs: (one_layout(inputs)[0][:1], []))
    monkeypatch.setattr(search, "tp_variants", lambda inputs, c: [c])
    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: steps)
    monkeypatch.setattr(search, "run_capped",
                        lambda steps, seed, warmup, cap: _FakeRun([10.0 + seed] * steps))
    lines: list[str] = []
    plan(write(tmp_path), budget_s=60.0, seeds=SEEDS, model="qwen3-8b", progress=lines.append,
         try_online_affinity=False)
    rungs = [line for line in lines if line.startswith("rung ")]
    assert len(rungs) == len(RUNGS)
    assert all("kept the best 1 and 0 within their noise" in line for line in rungs), rungs


def test_tp_variants_double_each_pools_engines_where_a_node_holds_them(tmp_path):
    inputs = read_inputs(load_scenario(write(tmp_path)), model="qwen3-8b")
    assert inputs.tp == {"h800": 1, "h20": 1} and inputs.gpus == {"h800": 5, "h20": 2}
    c = dataclasses.replace(next(c for c in space(inputs)[0] if c.trainer_gpus == 2 and set(
        c.mapping) == {"h800", "h20"}), wide_tp=())
    variants = tp_variants(inputs, c)
    assert [v.wide_tp for v in variants] == [(), ("h20",), ("h800",), ("h20", "h800")]
    both = variants[-1]
    # 3 H800 and 2 H20 left after the trainer: tp 2 gives 1 engine each, the odd GPU idle
    assert both.pools(inputs) == {"h800": 1, "h20": 1}
    assert [(p.num_workers, p.tp) for p in sim_of(inputs, both, 3).pools] == [(1, 2), (1, 2)]
    assert both.cost(inputs) < c.cost(inputs)  # the idle H800 is not paid for
    assert "(tp 2)" in both.describe(inputs)
    # a pool that would be left without an engine gets no wider TP
    one_h20 = dataclasses.replace(inputs, gpus={"h800": 5, "h20": 1})
    assert [v.wide_tp for v in tp_variants(one_h20, c)] == [(), ("h800",)]
    # engines already at 8 GPUs (one node) stay there
    eight = dataclasses.replace(inputs, tp={"h800": 8, "h20": 1}, gpus={"h800": 18, "h20": 2})
    assert [v.wide_tp for v in tp_variants(eight, c)] == [(), ("h20",)]


def test_a_plan_with_wider_engines_writes_their_tensor_parallel_size(tmp_path):
    from rollart.planner.layout import layout_dict

    path = write(tmp_path)
    inputs = read_inputs(load_scenario(path), model="qwen3-8b")
    c = next(c for c in space(inputs)[0] if c.trainer_gpus == 2 and set(c.mapping) == {
        "h800", "h20"})
    import tomllib

    raw = tomllib.loads(path.read_text())
    out = layout_dict(raw, inputs, dataclasses.replace(c, wide_tp=("h20",)))
    assert {p["name"]: (p["num_workers"], p["engine"]["tensor_parallel_size"])
            for p in out["pools"]} == {"fast": (3, 1), "wide": (1, 2)}


def _spec(name: str, *, prompt: float, resp: float, turns: float = 1.0):
    from rollart.sim.workload import DomainSpec, const

    return DomainSpec(name, prompt_tokens=const(prompt), obs_tokens=const(64.0),
                      response_tokens=const(resp), num_turns=const(turns))


def test_the_cost_model_predicts_wider_engines_faster_only_while_the_batch_fits():
    from rollart.planner.tpchoice import predicted_pool_s
    from rollart.sim.hardware import get_hardware
    from rollart.sim.models import get_model

    model, h800 = get_model("qwen3-8b"), get_hardware("h800")
    long_cot = [(_spec("reasoning", prompt=200, resp=8000), 32.0)]

    def pred(tp: int, max_batch: int, domains=long_cot) -> float:
        return predicted_pool_s(model, h800, gpus=4, tp=tp, max_batch=max_batch,
                                domains=domains, max_tokens_per_turn=16384)

    # Light load, decode-bound: one weight read per step serves the batch, at twice the
    # bandwidth, so the wider engine is faster per token.
    assert pred(2, 256) < pred(1, 256)
    # Batch slots for 8 sequences: 4 engines of 1 GPU hold the 32 trajectories in one wave,
    # 2 engines of 2 GPUs need two waves.
    assert pred(2, 8) > pred(1, 8)
    # No engine: 4 GPUs make no engine of 8; no work: no time.
    assert pred(8, 256) == float("inf")
    assert pred(1, 256, domains=[]) == 0.0
    # Compute-bound prefill of long prompts gains nothing from TP and pays the all-reduce.
    prefill_only = [(_spec("agentic", prompt=30000, resp=1), 64.0)]
    assert pred(2, 256, prefill_only) >= pred(1, 256, prefill_only)


def test_each_first_rung_layout_carries_its_predicted_tp_and_the_own_layout_runs_as_is(
        tmp_path):
    from rollart.planner import search
    from rollart.planner.tpchoice import predicted_pool_s

    inputs = read_inputs(load_scenario(write(tmp_path)), model="qwen3-8b")
    first, _ = space(inputs)
    own = first[0]
    assert (own.trainer_gpus, own.mapping, own.wide_tp) == (2, ("h800", "h20"), ())
    run = inputs.scenario.run
    for c in first[1:]:
        assert c == search.with_predicted_tp(inputs, c)
        for label in c.pools(inputs):
            base = inputs.tp[label]
            gpus = inputs.gpus[label] - (c.trainer_gpus if label == inputs.trainer_label
                                         else 0)
            served = [(spec, run.batch_size / 2) for spec, lb in zip(
                inputs.profiles, c.mapping, strict=True) if lb == label]

            def pred(tp, label=label, gpus=gpus, served=served):
                return predicted_pool_s(inputs.model, inputs.hardware(label), gpus=gpus,
                                        tp=tp, max_batch=inputs.max_batch[label],
                                        domains=served,
                                        max_tokens_per_turn=run.max_tokens_per_turn)

            if label in c.wide_tp:
                assert pred(2 * base) < pred(base)
            elif gpus >= 2 * base:
                assert pred(2 * base) >= pred(base)
    # every first-rung layout is one the exhaustive sweep runs too
    assert set(first) <= set(full_space(inputs))


def test_a_stalled_layout_is_dropped_without_the_controllers_error_lines(tmp_path, caplog):
    import logging

    inputs = read_inputs(load_scenario(write(tmp_path)), model="qwen3-8b")
    # every trajectory past its timeout: the controller stalls on failures in a row
    sim = sim_of(inputs, space(inputs)[0][0], steps=3).replace(trajectory_timeout_s=1e-3)
    with caplog.at_level(logging.INFO):
        assert run_capped(sim, 0, 1, cap_s=600.0) is None
    assert any("simulated layout stalled, dropped" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-500:]
    assert logging.getLogger("rollart.controller.rollout.tasks").level == logging.NOTSET


def test_the_first_rung_runs_the_cost_models_fastest_predicted_layouts_first(
        tmp_path, monkeypatch):
    """After the scenario's own layout, rung 0 runs in the order of the predicted step time,
    so that a budget covering part of the rung spends it on the layouts ranked best."""
    import rollart.planner.search as search

    ran: list = []

    def fake_run(sim, seed, warmup, cap):
        c, steps = sim
        if steps == RUNGS[0][0]:
            ran.append(c)
        return _FakeRun([30.0] * steps)

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    monkeypatch.setattr(search, "run_capped", fake_run)
    path = write(tmp_path)
    plan(path, budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    inputs = read_inputs(load_scenario(path), model="qwen3-8b")
    first, _ = space(inputs)
    assert ran[0] == first[0] and len(ran) == len(first) and set(ran) == set(first)
    predicted = [search.predicted_step_s(inputs, c) for c in ran[1:]]
    assert predicted == sorted(predicted)
    assert len(set(predicted)) > 1  # the order is the prediction's, not a tie


@pytest.mark.parametrize("seeds", ["0", "-1"])
def test_cli_refuses_fewer_than_one_seed_in_one_line(tmp_path, capsys, seeds):
    assert cli_main(["plan", str(write(tmp_path)), "--out", str(tmp_path / "p.toml"),
                     "--seeds", seeds, "--model", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert err == f"rollart plan: error: --seeds must be >= 1, got {seeds}\n", err



def _fake_search(monkeypatch, online_speedup: float) -> list:
    """The search over fake runs: every layout's steps are its mean +-5% (seeded), the
    layout (trainer 4, both domains on h800) fastest at 20 s; with online affinity on, a
    layout's steps are ``online_speedup`` times its static ones. Returns the candidates
    run."""
    import rollart.planner.search as search

    ran = []

    def mean_of(c) -> float:
        return 20.0 if (c.trainer_gpus, c.mapping) == (4, ("h800", "h800")) else 30.0

    def fake_run(sim, seed, warmup, cap):
        c, steps = sim
        ran.append((c, steps))
        rng = random.Random(f"{dataclasses.replace(c, online_affinity=False)}|{seed}")
        scale = online_speedup if c.online_affinity else 1.0
        return _FakeRun([mean_of(c) * scale * (1.0 + 0.05 * rng.uniform(-1, 1))
                         for _ in range(steps)])

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    monkeypatch.setattr(search, "run_capped", fake_run)
    return ran


def test_online_affinity_faster_on_the_best_layout_is_turned_on_in_the_plan(
        tmp_path, monkeypatch):
    """With online affinity on, the best layout runs 20% faster: the plan puts it first and
    writes ``[run.adaptive_affinity] enabled = true``; the same layout static ranks below. The
    variant runs only on the last rung's horizon (and the race's), as every candidate there."""
    ran = _fake_search(monkeypatch, 0.8)
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    best = res.best.candidate
    assert best.online_affinity and (best.trainer_gpus, best.mapping) == (4, ("h800", "h800"))
    static = [s.candidate for s in res.ranked[1:]]
    assert dataclasses.replace(best, online_affinity=False) in static
    assert not any(c.online_affinity for c in static)
    online_runs = [steps for c, steps in ran if c.online_affinity]
    assert set(online_runs) == {RUNGS[-1][0]}
    # second in the last round, right after the static layout it varies
    last = [c for c, steps in ran if steps == RUNGS[-1][0]]
    assert last[len(SEEDS)] == dataclasses.replace(last[0], online_affinity=True)
    assert len(online_runs) == len(res.best.step_times_s) >= len(SEEDS)
    assert res.scenario.run.adaptive_affinity.enabled
    assert "the plan turns it on ([run.adaptive_affinity] enabled = true)" in res.table()
    assert "online affinity on the best layout of the second round: " in res.table()
    assert "online affinity on" in res.toml.splitlines()[1 + len(res.warnings)]


def test_online_affinity_is_also_tried_on_the_best_layout_with_a_larger_trainer(
        tmp_path, monkeypatch):
    """Static, the 2-GPU trainer with both domains on h800 is fastest (20 s) and the 4-GPU one
    next (22 s); with online affinity on, the 4-GPU layout runs 30% faster (15.4 s), the
    2-GPU one not at all: the plan is the 4-GPU layout with online affinity on, which trying
    the best layout alone would miss."""
    import rollart.planner.search as search

    ran = []

    def mean_of(c) -> float:
        base = {(2, ("h800", "h800")): 20.0, (4, ("h800", "h800")): 22.0}.get(
            (c.trainer_gpus, c.mapping), 30.0)
        base += 0.0 if (c.alpha, c.redundancy) == (1, 0) else 5.0  # the scenario's own
        return base * (0.7 if c.online_affinity and c.trainer_gpus == 4 else 1.0)

    def fake_run(sim, seed, warmup, cap):
        c, steps = sim
        ran.append((c, steps))
        rng = random.Random(f"{dataclasses.replace(c, online_affinity=False)}|{seed}")
        return _FakeRun([mean_of(c) * (1.0 + 0.02 * rng.uniform(-1, 1))
                         for _ in range(steps)])

    monkeypatch.setattr(search, "sim_of", lambda inputs, c, steps: (c, steps))
    monkeypatch.setattr(search, "run_capped", fake_run)
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    best = res.best.candidate
    assert (best.trainer_gpus, best.mapping, best.online_affinity) == (4, ("h800", "h800"), True)
    tried = {(c.trainer_gpus, c.mapping) for c, _ in ran if c.online_affinity}
    assert tried == {(2, ("h800", "h800")), (4, ("h800", "h800"))}
    assert ("online affinity on the second round's best layout with a larger trainer (4 GPUs)"
            in res.table())
    assert res.scenario.run.adaptive_affinity.enabled and res.scenario.trainer.num_processes == 4


def test_with_online_twins_follows_the_leader_and_the_best_larger_trainer_only():
    from rollart.planner.search import Candidate, with_online_twins

    a, b, c, d = (Candidate(t, ("h800",), 1, 0) for t in (4, 2, 8, 16))
    on = [dataclasses.replace(x, online_affinity=True) for x in (a, c)]
    assert with_online_twins([a, b, c, d]) == [a, on[0], b, c, on[1], d]
    # no survivor with a larger trainer: the leader alone
    assert with_online_twins([d, a]) == [d, dataclasses.replace(d, online_affinity=True), a]


def test_online_affinity_slower_is_left_off_and_can_be_skipped(tmp_path, monkeypatch):
    """Online affinity that runs 25% slower stays off; with ``try_online_affinity=False``
    it is never run."""
    ran = _fake_search(monkeypatch, 1.25)
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    assert not res.best.candidate.online_affinity
    assert not res.scenario.run.adaptive_affinity.enabled
    assert "not the plan's choice: left off" in res.table()
    assert any(c.online_affinity for c, _ in ran)
    ran.clear()
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b",
               try_online_affinity=False)
    assert ran and not any(c.online_affinity for c, _ in ran)
    assert "online affinity" not in res.table()


def test_a_scenario_with_online_affinity_on_is_planned_with_it_and_not_flipped(
        tmp_path, monkeypatch):
    ran = _fake_search(monkeypatch, 0.8)
    path = write(tmp_path)
    path.write_text(path.read_text().replace(
        "[model]", "[run.adaptive_affinity]\nenabled = true\n\n[model]"))
    res = plan(path, budget_s=600.0, seeds=SEEDS, model="qwen3-8b")
    assert ran and not any(c.online_affinity for c, _ in ran)
    assert res.scenario.run.adaptive_affinity.enabled and not res.log.online_affinity


def test_online_affinity_not_reached_by_the_budget_is_a_warning(tmp_path, monkeypatch):
    """The last rung's share of the budget ran out before the variant ran: a warning naming
    the budget option."""
    import rollart.planner.search as search

    _fake_search(monkeypatch, 0.8)
    inputs = read_inputs(load_scenario(write(tmp_path)), model="qwen3-8b")
    ranked, log = search.successive_halving(inputs, budget_s=600.0, seeds=SEEDS,
                                            try_online_affinity=False)
    search._note_online_affinity(ranked, log)
    assert log.online_affinity_short
    res = PlanResult(ranked=ranked, scenario=load_scenario(write(tmp_path)), toml="", log=log,
                     inputs=inputs, budget_s=600.0, budget_option="--budget-s")
    assert any("online affinity was not tried on the best layout: the budget ran out before "
               "it (600 CPU s); give a larger --budget-s to have it tried" in w
               for w in res.warnings)


def test_a_simulated_runs_affinity_decisions_are_not_logged_as_the_users(monkeypatch, caplog):
    """The planner's runs with online affinity on spill and hold: their "affinity: ..."
    WARNING lines would read as the user's run's; they are kept quiet during the run only."""
    import logging

    import rollart.planner.search as search

    def noisy_run(sim, seed, warmup, cap_s):
        for name in search.QUIET_LOGGERS:
            logging.getLogger(name).warning("affinity: from %s", name)
        return "ran"

    monkeypatch.setattr(search, "_run_timed", noisy_run)
    with caplog.at_level(logging.WARNING):
        assert run_capped(None, 0, 1, cap_s=1.0) == "ran"
    assert not [r for r in caplog.records if r.getMessage().startswith("affinity:")]
    spill = logging.getLogger("rollart.controller.routing.spill")
    with caplog.at_level(logging.WARNING):
        spill.warning("affinity: after the run")
    assert [r.getMessage() for r in caplog.records] == ["affinity: after the run"]


def test_the_cli_flag_static_affinity_never_tries_online_affinity(tmp_path, monkeypatch, capsys):
    ran = _fake_search(monkeypatch, 0.8)
    args = ["plan", str(write(tmp_path)), "--model", "qwen3-8b", "--budget-s", "600"]
    assert cli_main([*args, "--out", str(tmp_path / "a.toml"), "--static-affinity"]) == 0
    assert ran and not any(c.online_affinity for c, _ in ran)
    assert "enabled = true" not in (tmp_path / "a.toml").read_text()
    ran.clear()
    assert cli_main([*args, "--out", str(tmp_path / "b.toml")]) == 0
    assert any(c.online_affinity for c, _ in ran)
    assert load_scenario(tmp_path / "b.toml").run.adaptive_affinity.enabled


def test_an_online_variant_that_stalls_is_left_off_without_a_budget_warning(
        tmp_path, monkeypatch):
    """Its run stalled (or overran its cap): dropped like any such layout, and the plan does
    not blame the budget."""
    import rollart.planner.search as search

    _fake_search(monkeypatch, 0.8)
    static_run = search.run_capped
    monkeypatch.setattr(search, "run_capped", lambda sim, seed, warmup, cap: None
                        if sim[0].online_affinity else static_run(sim, seed, warmup, cap))
    res = plan(write(tmp_path), budget_s=600.0, seeds=SEEDS, model="qwen3-8b",
               budget_option="--budget-s")
    assert not res.best.candidate.online_affinity
    # the stall is a stall of the third round, not a limit
    assert res.warnings == ["1 of the 17 candidates of the third round stalled or overran "
                            "their cap and were dropped: the plan is the best of the rest"]
    assert "no run with it on ended (one stalled or overran its cap" in \
        res.table()
