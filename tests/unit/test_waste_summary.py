"""The run summary's waste and selection-bias totals, and the progress table's waste cell."""

from __future__ import annotations

import msgspec

from rollart.controller.observe.metrics import DomainStepMetrics, StepMetrics
from rollart.launcher.progress import _waste_word, step_waste, waste_summary, waste_text


def step(n: int, gen: int, trained: int, in_flight: int, wasted: dict[str, int],
         domains: dict[str, DomainStepMetrics]) -> StepMetrics:
    return StepMetrics(
        step=n, mode="rollart", policy_version=n, reward_mean=0.0, reward_mean_by_domain={},
        num_samples=sum(d.trained for d in domains.values()), step_time_s=1.0,
        rollout_time_s=1.0, train_time_s=1.0, weight_sync_total_s=0.0,
        weight_sync_exposed_s=0.0, trainer_idle_s=0.0, staleness_max=0, staleness_mean=0.0,
        num_aborted=0, num_failed=0, num_failed_by_reason={}, num_retries=0, num_rerouted=0,
        num_generated_tokens=gen, wasted_tokens=sum(wasted.values()),
        response_len_kept_mean=0.0, response_len_all_mean=0.0, num_turns_mean=0.0,
        wasted_tokens_by_reason=wasted, buffer_generated_tokens=gen, trained_tokens=trained,
        in_flight_tokens=in_flight, by_domain=domains)


def test_summary_totals_add_up_and_show_each_domains_share_and_length_bias() -> None:
    rows = [
        step(1, 100, 30, 40, {"stale": 30}, {
            "a": DomainStepMetrics(groups_started=2, started=4, finished=2, trained=2,
                                   finished_tokens=30, trained_tokens=30, finished_turns=2,
                                   trained_turns=2, generated_tokens=60,
                                   wasted_tokens={"stale": 30}),
            "b": DomainStepMetrics(groups_started=1, started=2, generated_tokens=40)}),
        step(2, 50, 50, 30, {"stale": 5, "redundancy": 5}, {
            "a": DomainStepMetrics(finished=2, trained=1, finished_tokens=50, trained_tokens=20,
                                   finished_turns=4, trained_turns=1, generated_tokens=10,
                                   wasted_tokens={"redundancy": 5}),
            "b": DomainStepMetrics(finished=1, trained=1, finished_tokens=30,
                                   trained_tokens=30, finished_turns=3, trained_turns=3,
                                   generated_tokens=40, wasted_tokens={"stale": 5})}),
    ]
    out = waste_summary([msgspec.to_builtins(r) for r in rows], {"a": 3.0, "b": 1.0})
    assert (out["generated_tokens"], out["trained_tokens"], out["wasted_tokens"]) == (150, 80, 40)
    assert out["in_flight_tokens"] == 30
    assert out["generated_tokens"] == out["trained_tokens"] + out["wasted_tokens"] \
        + out["in_flight_tokens"]
    assert out["wasted_tokens_by_reason"] == {"redundancy": 5, "stale": 35}
    assert out["wasted_share_by_reason"] == {"redundancy": round(5 / 150, 6),
                                             "stale": round(35 / 150, 6)}
    a, b = out["domains"]["a"], out["domains"]["b"]
    assert (a["trained"], a["started"], a["groups_started"]) == (3, 4, 2)
    assert a["trained_share"] == 0.75 and a["configured_share"] == 0.75
    assert a["trained_share_vs_configured"] == 1.0
    assert b["trained_share_vs_configured"] == 1.0
    assert a["mean_generated_trained"] == round(50 / 3, 3)
    assert a["mean_generated_finished"] == 20.0
    assert a["length_bias"] == round((50 / 3) / 20 - 1, 6)
    assert (a["mean_turns_trained"], a["mean_turns_finished"]) == (1.0, 1.5)
    assert a["wasted_tokens"] == {"stale": 30, "redundancy": 5}
    assert b["length_bias"] == 0.0


def test_waste_cell_of_the_progress_table() -> None:
    # 200 generated, 120 trained + 80 wasted settled: nothing carried from before the step
    m = step(1, 200, 120, 0, {"stale": 60, "redundancy": 20}, {})
    assert waste_text(m) == "40% stale 30 red 10"
    assert waste_text(step(1, 0, 0, 0, {}, {})) == "-"


def test_a_step_settling_tokens_of_earlier_steps_keeps_its_share_within_one() -> None:
    # The first step after a resume: 100 tokens generated in it, but 406 wasted (held samples
    # of the checkpoint gone stale) and 64 trained: 406 / 100 read "406%".
    m = step(1, 100, 64, 0, {"stale": 406}, {})
    share, by_reason, carried = step_waste(m)
    assert share == 406 / 470 and by_reason == {"stale": 406 / 470} and carried == 370
    assert waste_text(m) == "86% stale 86 +370 carried"
    assert _waste_word(m) == "86%(stale:86)+370_carried"  # one word in a log line
    big = step(2, 1000, 4000, 0, {"stale": 1000}, {})
    assert waste_text(big) == "20% stale 20 +4.0k carried"
    # in flight at the step's end: not settled, not in the share, not carried
    assert step_waste(step(3, 500, 100, 300, {"redundancy": 100}, {})) == (
        0.5, {"redundancy": 0.5}, 0)
