"""The scenario's tables as msgspec Structs (``rollart.config`` re-exports them).

Every Struct rejects unknown fields and bounds are ``msgspec.Meta`` constraints; the
``#:`` comment above a field is its documentation (``rollart.configdoc`` reads it into
the class docstrings and docs/scenario-reference.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rollart.envhost.latency import LatencyConfig

Mode = Literal["sync", "sync_plus", "one_off", "areal", "rollart"]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
#: A Ray custom resource name (``rollart run --cluster ray``: ``rollart.launcher.placement``);
#: Ray's own ``CPU`` / ``GPU`` / ``memory`` are reserved per service already. One ``:`` is
#: allowed so Ray's automatic accelerator resources (``accelerator_type:H100``) can be named.
RayResource = Annotated[str, msgspec.Meta(min_length=1, max_length=64,
                                          pattern=r"^(?!(CPU|GPU|memory|object_store_memory)$)"
                                                  r"[A-Za-z_][A-Za-z0-9_.\-]*"
                                                  r"(:[A-Za-z0-9_.\-]+)?$")]

class _Cfg(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base: unknown fields are errors; instances are immutable.

    Subclasses repeat ``frozen=True``: msgspec inherits it at run time, type checkers do not.
    """


class RetryConfig(_Cfg, frozen=True):
    """Per-trajectory retry policy after a failure (env error, generation or reward failure:
    every reason is counted; a staleness restart does not use up an attempt)."""

    #: attempts per group slot, first one included (1 = never retry).
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    #: this many trajectory failures in a row, with no success in between, stop the run
    #: (fatal): a broken env or reward endpoint must not spin forever.
    max_failures_in_a_row: PosInt = 100
    #: failures per group (all its slots together) before the group is dropped with reason
    #: ``failure_budget`` and a warning, so an always-failing prompt cannot loop (``None``:
    #: only ``max_attempts`` per slot bounds it).
    max_failures_per_group: PosInt | None = None
    #: seconds generate calls may keep timing out under overload before the run stops: a
    #: timeout whose worker answered other calls meanwhile (busy), or while no worker answered
    #: anything (the controller's loop stalled, every engine slow), does not count toward
    #: ``max_failures_in_a_row``; the run stops only when such timeouts went on, with no
    #: trajectory finishing, for this long (``ControllerStalledError`` naming it).
    max_overload_s: PosFloat = 3600.0


class AdaptiveAffinityConfig(_Cfg, frozen=True):
    """Online hardware affinity (``rollart.controller.routing.spill``): when a domain's pool
    saturates while another pool has room, that domain's *new* trajectories start on the pool
    with room (a live trajectory never moves: its prefix lives on its worker), and come back
    when the home pool has room again. A pool's pressure is the share of the requests its
    engines hold that wait (no KV room or batch slot; the controller's send-window queue
    counted too) and its KV-cache usage where workers report it. Every move is logged and
    counted per step (``num_spilled_by_domain``). With ``kv_working_set``, a pool also holds
    new trajectories' first turns while its KV cache could not keep their working sets beside
    its live trajectories' between turns (``rollart.controller.routing.workingset``;
    ``num_kv_admission_waits``), on one pool as on several."""

    #: route by pressure (and hold by KV working set); ``false``: each domain always uses its
    #: scenario pool and every new trajectory starts at once.
    enabled: bool = False
    #: a pool whose waiting share reaches this is saturated (0, 1].
    saturated_waiting_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.25
    #: a pool whose waiting share is at most this has room; below ``saturated_waiting_share``
    #: (the gap between the two is the hysteresis).
    room_waiting_share: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.05
    #: mean KV-cache usage at which a pool is saturated, (0, 1] (workers that report it).
    kv_usage_high: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    #: seconds a spill lasts at least before its domain may return home.
    min_hold_s: NonNegFloat = 10.0
    #: hold a new trajectory's first turn while its pool's KV cache cannot keep the working
    #: sets (expected KV footprints) of the trajectories live on it plus its own, so their
    #: prefixes are not evicted between turns and recomputed (thrashing; the working-set rule,
    #: Denning 1968); such a pool counts as saturated, so the domain spills first where another
    #: pool has room. A trajectory's expected footprint before its domain's first finish is
    #: projected from its turns and the domain's ``max_turns``, and before its domain's first
    #: turn returned is ``run.max_tokens_per_trajectory`` (for a one-turn domain, ``max_turns``
    #: 1 or a reasoning-gym env without an agent, its prompt plus ``run.max_tokens_per_turn``
    #: when less; an agent's prompt is not known then). Needs workers that report their KV
    #: capacity (vLLM and simulated ones do).
    #: Unset: on in every mode but ``sync``, whose turn barrier makes every live trajectory
    #: wait for a held first turn (refused there when set; ``RunConfig.effective_kv_working_set``).
    #: ``true`` with ``enabled = false`` is refused (the hold is part of online affinity).
    kv_working_set: bool | None = None
    #: share of a pool's KV capacity the working sets may fill, (0, 1].
    kv_working_set_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0


class WorkerChecksConfig(_Cfg, frozen=True):
    """What the controller does with inference workers whose output is wrong.

    Every ``GenerateResult`` is checked where it arrives (``rollart.controller.routing.workercheck``);
    a violation fails that trajectory (reason ``invalid_worker_output``, retried, never scored).
    A request the worker's engine failed (``engine_error``; not one refused as bad input) fails
    its trajectory (``generation_error``) and counts as a violation too, unless the worker
    marks it transient (refused for now: overloaded, paused), which is sent again after a
    pause and never counted. A worker with
    ``max_invalid_replies`` violations among its last ``invalid_window`` replies is quarantined: taken out of its pool (its trajectories go to the pool's other workers; the
    run stops when that would empty the pool).

    Engine/trainer agreement, checked per batch from the trainer's recompute: for each serving
    worker, over the tokens of the batch samples it served that were generated under the
    weights the trainer recomputes with when it has at least ``min_current_tokens`` of them
    (older tokens also differ by the policy's own change), else over all of them (always so
    after the first step under ``weight_apply = "at_batch"`` in an overlapped mode: the
    trainer's version is applied only once its batch was taken), the token-weighted mean
    ``|logp_trainer - logp_behaviour|`` (nats per token) above ``max_logprob_mismatch``, or
    the fraction of those tokens whose importance weight ``exp(logp_trainer -
    logp_behaviour)`` exceeds the trainer's ``iw_cap`` above ``max_iw_capped_fraction``,
    triggers ``agreement_policy``: ``off`` (not checked),
    ``warn`` (a log line naming the worker), ``quarantine`` (that worker leaves its pool) or
    ``stop`` (the run stops with an error naming it).
    """

    #: violations among a worker's last ``invalid_window`` replies that quarantine it.
    max_invalid_replies: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 3
    #: replies of one worker over which violations are counted.
    invalid_window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 100
    #: what a worker over an agreement threshold gets: ``off`` (not checked), ``warn`` (a log
    #: line), ``quarantine`` (it leaves its pool), ``stop`` (the run stops naming it).
    agreement_policy: Literal["off", "warn", "quarantine", "stop"] = "warn"
    #: nats per generated token (bf16 engines typically agree to ~0.01-0.05).
    max_logprob_mismatch: Annotated[float, msgspec.Meta(gt=0, le=100)] = 0.5
    #: fraction of a worker's judged tokens in the batch whose importance weight is over
    #: ``iw_cap``.
    max_iw_capped_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.05
    #: tokens a worker generated under the trainer's version, in one batch, needed to judge it
    #: on those alone (fewer: on all its tokens of the batch, the policy's change included).
    min_current_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000_000)] = 64
    #: a worker whose generate call timed out with nothing answered since it was sent, while
    #: other workers answered, is probed with a one-token ``Generate`` (``max_tokens = 1``)
    #: under this timeout, seconds; no answer (and no other reply from it meanwhile)
    #: quarantines it as hung and its requests go to the pool's other workers
    #: (``rollart.controller.routing.hangcheck``).
    hang_probe_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0


#: ``RunConfig.apply_waves`` unless set (any other value needs ``weight_apply = "eager"``)
_DEFAULT_APPLY_WAVES = 2
#: ``RunConfig.hold_batch_max_s`` unless set (any other value needs ``hold_batch_for_groups``).
#: A group outlives its batches when one member decodes near ``max_tokens_per_turn`` (the
#: length distribution's tail): in the simulated ``staleness_waste`` benchmark (alpha 1) such a
#: group still needed 70-150 s after the hold began, so a 60 s bound released the batch and the
#: whole group went stale (up to 0.23 of generated tokens; 9 runs in 24 above 0.05); 180 s kept
#: it at 0 in all 24 (12 seeds x 2 regimes), rollout-bound steps 2-9% longer on average.
_DEFAULT_HOLD_BATCH_MAX_S = 180.0

#: modes whose rollout overlaps training (``rollart.controller.modes``: ``ModeSpec.overlap``)
OVERLAP_MODES = ("one_off", "areal", "rollart")


class RunConfig(_Cfg, frozen=True):
    """What to run: algorithm shape, asynchrony mode, staleness bound and per-trajectory limits.

    Staleness policy: a scenario that sets none of its fields gets the one that wastes no
    generated tokens as stale at alpha = 1 (docs/staleness.md): weights applied as soon as they
    are pushed, in ``apply_waves`` waves (``weight_apply``), a trajectory's first token only on a
    version with headroom (``fresh_start``), version-aware admission (``admission =
    "capacity"``), a yield-corrected domain mix (``domain_mix = "yield"``) and, in mode
    ``rollart``, a ready batch held for a group it would make stale (``hold_batch_for_groups``).
    The fields that only apply in some modes are unset (``None``) by default and mean "on where
    it applies" (the ``effective_*`` properties); a value written in the scenario is checked
    against the mode, never changed. The previous default, spelled out: ``weight_apply =
    "at_batch"``, ``fresh_start = false``, ``admission = "greedy"``, ``domain_mix = "weight"``,
    ``hold_batch_for_groups = false``.
    """

    #: master seed: domain mixing, env seeds per group, unbiased selection.
    seed: NonNegInt = 0
    #: training steps (one batch each); ``rollart run --steps`` overrides it on the command line.
    steps: PosInt = 10
    #: sync: batch-barrier rollout, no overlap; sync_plus: trajectory-level rollout, no overlap;
    #: one_off: one-step off-policy at batch level; areal: staleness checked at admission only;
    #: rollart: per-turn staleness check, full overlap of rollout and training.
    mode: Mode = "rollart"
    #: staleness bound: a sample trained into version v+1 has every token from version >= v-alpha.
    alpha: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1
    #: samples per training batch (a multiple of ``group_size``).
    batch_size: PosInt = 8
    #: GRPO group size: trajectories sharing one prompt / env seed.
    group_size: PosInt = 4
    #: extra trajectories launched per group; the slowest are cancelled once ``group_size`` finish.
    redundancy: NonNegInt = 0
    #: ``first``: keep the first ``group_size`` finishers (the paper's); ``unbiased``: wait up to
    #: ``selection_deadline_s`` after ``group_size`` finished and keep a random ``group_size``.
    selection: Literal["first", "unbiased"] = "first"
    #: unbiased selection deadline, seconds after the group_size-th member finished.
    selection_deadline_s: NonNegFloat = 30.0
    #: a trajectory that can no longer meet the staleness bound: ``restart`` it, or ``drop`` it.
    on_stale: Literal["restart", "drop"] = "restart"
    #: recompute the KV cache of in-flight requests after a weight update (else keep it, and
    #: requests in flight at the update decode on over KV of the older weights). The
    #: quickstart sets it: its runs that kept the KV lost guess10's held-out gain in the
    #: second half, the runs that recomputed it kept theirs (README "What the quickstart
    #: learns").
    reprefill: bool = False
    #: overlap modes: when a trained version reaches the workers. ``at_batch``: at the pause of
    #: the next step, once its batch is taken (the paper's §6.2 order); ``eager``: as soon as its
    #: push completes, in ``apply_waves`` waves, so tokens generated while the next batch fills
    #: are already of the new version (fewer go stale at alpha = 1). Unset: ``eager`` in the
    #: overlap modes (``one_off``, ``areal``, ``rollart``), ``at_batch`` in ``sync`` /
    #: ``sync_plus`` (which apply while generation is paused anyway); ``effective_weight_apply``.
    weight_apply: Literal["at_batch", "eager"] | None = None
    #: eager apply: workers of each pool are paused and updated in this many successive waves,
    #: so a pool never stops generating all at once (1 = every worker together).
    apply_waves: Annotated[int, msgspec.Meta(ge=1, le=64)] = _DEFAULT_APPLY_WAVES
    #: a trajectory generates its first token only once the workers serve a version with one
    #: version of headroom (``> trainer version - alpha``); otherwise it waits for the next
    #: apply instead of starting work that could only join the very next batch and is mostly
    #: wasted. Needs ``weight_apply = "eager"`` (the wait must not depend on a batch). Unset:
    #: on wherever the weights are applied eagerly (``effective_fresh_start``).
    fresh_start: bool | None = None
    #: modes with the per-turn check (``rollart``, ``sync``, ``sync_plus``) and
    #: ``on_stale = "restart"`` only: when a version bump makes a running
    #: trajectory stale, abort its generation at once and restart its slot (else it runs on
    #: until its next turn start, generating tokens that can never be trained).
    abort_stale: bool = False
    #: mode ``rollart`` only: while a batch is ready but an open, incomplete group has a token
    #: that the batch's update would make stale (older than ``version + 1 - alpha``), the
    #: trainer waits for that group instead of the rollout throwing it away (fewer wasted
    #: tokens at alpha = 1; ``SampleBuffer.holds_batch``). Off: the batch goes at once. Unset:
    #: on in mode ``rollart``, off in the others (``effective_hold_batch``).
    hold_batch_for_groups: bool | None = None
    #: longest a ready batch is held for ``hold_batch_for_groups``, seconds: past it the batch
    #: goes ahead and the group it waited for goes stale as without the option, so a hung
    #: group never stalls training longer.
    hold_batch_max_s: Annotated[float, msgspec.Meta(gt=0, le=86400.0)] = (
        _DEFAULT_HOLD_BATCH_MAX_S)
    #: ``greedy``: start a group whenever the in-flight bound allows; ``paced``: hold a group
    #: back until the next weight apply when, by the measured batch period and the domain's
    #: measured group completion time, it would miss its staleness deadline now but meet it
    #: then (``rollart.controller.rollout.pacing``); ``capacity``: start a group only while fewer
    #: still-admissible groups are in flight than the batches it could join can take
    #: (``SampleBuffer.has_capacity``); a complete group that went stale whole is then
    #: dropped (``groups_dropped_by_reason`` ``stale``) and replaced through that check, not
    #: refilled in place.
    admission: Literal["greedy", "paced", "capacity"] = "capacity"
    #: domain of each admitted group: ``weight`` draws by ``domain.weight``; ``yield`` divides
    #: each weight by the domain's measured yield (samples trained per trajectory slot started),
    #: so domains whose trajectories are more often wasted (long horizon) are started more often
    #: and reach their configured share of trained samples.
    domain_mix: Literal["weight", "yield"] = "yield"
    #: maximum assistant turns per trajectory.
    max_turns: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8
    #: generated tokens per turn (the engine's ``max_tokens``). A turn that reaches it ends the
    #: episode: the env still scores that cut-off action, then the trajectory finishes with
    #: ``finish_reason = "length"``.
    max_tokens_per_turn: PosInt = 256
    #: total tokens of one training sequence (prompt + generated + observations).
    max_tokens_per_trajectory: PosInt = 2048
    #: timeout of one generate call, seconds.
    generate_timeout_s: PosFloat = 600.0
    #: generate requests outstanding on one inference worker at most; more wait in the
    #: controller in arrival order, and each one's ``generate_timeout_s`` starts when it is sent,
    #: so a burst (a run's start, thousands of trajectories released at once) is not failed by
    #: its own queue and retried into it (``num_window_waits`` in the step metrics). Keep it
    #: above what the engine runs at once: the default is 4x vLLM 0.32's largest default
    #: ``max_num_seqs`` (1024, ``EngineArgs`` on H100-class GPUs).
    max_generate_in_flight: PosInt = 4096
    #: timeout of one env open / step call, seconds (env hosts and in-process envs).
    env_timeout_s: PosFloat = 120.0
    #: an inference worker or env host that answers no heartbeat (sent every 2 s) for this
    #: long is declared dead: its trajectories are re-routed, and the last worker of a pool or
    #: the only env host stops the run. Raise it on a heavily shared machine, where a live
    #: worker's event loop can stall for seconds.
    liveness_timeout_s: Annotated[float, msgspec.Meta(ge=4.0, le=3600.0)] = 10.0
    #: per-trajectory retries after a failure (``[run.retry]``).
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    #: run every ZeroMQ service without authentication (no CURVE key). Alone (or ``rollart run
    #: --insecure`` alone) it is allowed only when every service is on this machine's loopback;
    #: with services elsewhere it needs both (README "Security").
    insecure: bool = False
    #: the run's key file (``.key_secret``, mode 0600) when the scenario names services started
    #: by hand with ``--key-file``; ``None``: ``rollart run`` makes a new key per launch.
    key_file: str | None = None
    #: checks of inference workers' output and of engine/trainer agreement.
    worker_checks: WorkerChecksConfig = msgspec.field(default_factory=WorkerChecksConfig)
    #: online hardware affinity: saturated pools spill new trajectories (``[run.adaptive_affinity]``).
    adaptive_affinity: AdaptiveAffinityConfig = msgspec.field(
        default_factory=AdaptiveAffinityConfig)
    #: wall-clock limit of one trajectory, seconds (env open to reward, less the time its first
    #: turn waited for KV room under the working-set hold), ``None``: none; past it the
    #: trajectory fails with reason ``trajectory_timeout`` (retried like any failure).
    #: The default bounds a trajectory stuck on a call that never ends (with
    #: ``max_group_attempts`` and ``group_timeout_s``, every group finishes).
    trajectory_timeout_s: PosFloat | None = 3600.0
    #: trajectories one group may start, per member slot (first attempts, failure retries,
    #: staleness restarts and stale replacements together): past it the group is dropped
    #: (``groups_dropped_by_reason`` ``group_attempts``, its members cancelled) and admission
    #: starts another. A group whose members finish out of phase (one was slow once) would
    #: otherwise see them go stale one after another and be refilled forever.
    max_group_attempts: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 8
    #: wall-clock limit of a group that is not complete, seconds from its admission (>=
    #: ``trajectory_timeout_s``): past it the group is dropped (``groups_dropped_by_reason``
    #: ``group_timeout``, its members cancelled, a warning) and admission starts another. A
    #: complete group waiting for the trainer is not dropped (it is checked again every tenth
    #: of this limit); a trained or dropped group's members still running then are cancelled.
    #: ``None``: no limit.
    group_timeout_s: PosFloat | None = 10800.0
    #: threads running sync in-process (``Cluster.register_env`` / ``register_reward``) env
    #: and reward calls off the event loop, at once (per kind).
    local_threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    #: deadline of one in-process reward call, seconds.
    local_reward_timeout_s: PosFloat = 60.0
    #: your own Python file (relative to the scenario file) whose module-level ``REWARDS``
    #: (reward name -> function) and ``ENVS`` (env name -> factory) ``rollart run`` and
    #: ``open_cluster`` register in-process (``rollart.launcher.localmodule``); ``None``: none.
    local_module: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    #: the training loop waiting this long for a batch logs what it waits on (groups,
    #: trajectories, what each is doing and since when), and again every as long, seconds.
    stall_log_s: PosFloat = 60.0

    @property
    def effective_weight_apply(self) -> Literal["at_batch", "eager"]:
        """``weight_apply`` as set, else ``eager`` in an overlap mode, ``at_batch`` otherwise."""
        if self.weight_apply is not None:
            return self.weight_apply
        return "eager" if self.mode in OVERLAP_MODES else "at_batch"

    @property
    def effective_fresh_start(self) -> bool:
        """``fresh_start`` as set, else whether the weights are applied eagerly."""
        if self.fresh_start is not None:
            return self.fresh_start
        return self.effective_weight_apply == "eager" and self.mode in OVERLAP_MODES

    @property
    def effective_kv_working_set(self) -> bool:
        """Whether online affinity holds first turns for KV room: ``adaptive_affinity.enabled``
        and ``kv_working_set`` as set, else in every mode but ``sync``."""
        aa = self.adaptive_affinity
        if not aa.enabled:
            return False
        return aa.kv_working_set if aa.kv_working_set is not None else self.mode != "sync"

    @property
    def effective_hold_batch(self) -> bool:
        """``hold_batch_for_groups`` as set, else whether the mode is ``rollart``."""
        if self.hold_batch_for_groups is not None:
            return self.hold_batch_for_groups
        return self.mode == "rollart"


class ModelConfig(_Cfg, frozen=True):
    """The policy checkpoint: ``"tiny"`` builds the project's tiny model, else a local HF dir.
    The ``tiny_*`` fields apply to the tiny model only: set to anything but their default with
    a checkpoint directory, the scenario is refused."""

    #: ``"tiny"`` or a local Hugging Face checkpoint directory (no downloads).
    path: Annotated[str, msgspec.Meta(min_length=1)] = "tiny"
    #: seed of the tiny model's weights.
    tiny_seed: NonNegInt = 0
    #: run the tiny model's supervised warm-up on env demonstrations before RL.
    tiny_warmup: bool = True
    #: warm up ``rg:basic_arithmetic`` domains on the calculator agent's conversation instead
    #: of gym turns: a hermes ``<tool_call>`` of the ``calculator`` tool, its result, then the
    #: ``\\boxed{}`` answer (``rollart.models.tooldemos``; ``examples/agent_calculator.py``).
    #: Its model's tokenizer has ``<tool_call>`` / ``</tool_call>`` as one token each. Measured:
    #: 13 of 16 sampled first replies parse as a call; ~3 min of warm-up on a 2-core machine
    #: (docs/agents.md).
    tiny_warmup_tool_calls: bool = False
    #: warm-up size: solver-played episodes per domain (a multi-turn episode gives one
    #: demonstration per turn); ``None``: 100. A changed recipe builds (and caches) another model.
    tiny_warmup_episodes: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    #: passes of the warm-up over its demonstrations; ``None``: 1 (16 with
    #: ``tiny_warmup_tool_calls``).
    tiny_warmup_epochs: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    #: the warm-up's learning rate (AdamW); ``None``: 3e-3 (1e-2 with ``tiny_warmup_tool_calls``).
    tiny_warmup_lr: Annotated[float, msgspec.Meta(gt=0, le=1.0)] | None = None
    #: share of the warm-up's demonstrated moves replaced by an exploring one (GuessTheNumber: a
    #: guess drawn uniformly from the game's whole range, hints ignored; other envs have none):
    #: the warmed-up policy then keeps a random-guessing habit that RL can teach it to drop,
    #: and groups whose members differ (GRPO learns nothing from a group of equal rewards).
    #: Measured on the quickstart's domains with 0.3 and three warm-up epochs (the quickstart
    #: now takes two): the 2-layer policy wins 0.47 / 0.10
    #: greedy and 0.33 / 0.22 sampled (200 held-out games), below the best fixed guess
    #: sequence (0.46 / 0.28): the random moves cost it the skill, not only those moves.
    tiny_warmup_explore: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    #: exploring moves replace only the first N moves of each demonstrated episode (the later
    #: moves stay the solver's); ``None``: any move. With ``tiny_warmup_explore = 1.0`` and 1,
    #: every demonstrated game opens with a uniformly random guess and then bisects. Measured on
    #: the quickstart's domains with three warm-up epochs: the warmed policy then plays worse
    #: after the opening too
    #: (sampled win rate 0.27 / 0.19 against 0.62 / 0.53 with bisection openings), and 75 RL
    #: steps did not teach it to open in the middle.
    tiny_warmup_explore_turns: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    #: the tiny model's width (`rollart.models.tiny.TinyModelSpec.hidden_size`); ``None``: 128.
    #: The head size ``tiny_hidden_size / tiny_num_heads`` must be one the vLLM CPU attention
    #: runs (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512). A changed architecture builds
    #: (and caches) another model.
    tiny_hidden_size: Annotated[int, msgspec.Meta(ge=32, le=1024)] | None = None
    #: the tiny model's number of decoder layers; ``None``: 2. Measured on the quickstart's
    #: games: 4 layers and 4 heads, warmed up for three epochs with ``tiny_warmup_explore =
    #: 0.3``, played one guess sequence on 90% of guess10's held-out games (greedy win rate
    #: 0.20 against 0.59 for the 2-layer model after the same three epochs without
    #: exploring) after a warm-up of ~1 h on a busy 2-core machine.
    tiny_num_layers: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None
    #: the tiny model's attention heads; ``None``: 2 (see ``tiny_hidden_size`` for the head size).
    tiny_num_heads: Annotated[int, msgspec.Meta(ge=1, le=32)] | None = None
    #: data type of the weights in trainer and engine.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EngineConfig(_Cfg, frozen=True):
    """vLLM engine options of every worker of a pool (names follow the worker's
    ``rollart.inference.engine.EngineOptions``; the engine's seed is ``run.seed`` + worker index,
    its dtype ``model.dtype``)."""

    #: KV cache size in bytes (vLLM ``kv_cache_memory_bytes``); 256 MiB suits the tiny model.
    kv_cache_bytes: PosInt = 256 << 20
    #: context length; ``None`` keeps the model's.
    max_model_len: PosInt | None = None
    #: concurrent sequences per engine; ``None`` keeps vLLM's default.
    max_num_seqs: PosInt | None = None
    #: trajectory prefix tokens a worker holds for delta prompts (the tokens of each
    #: trajectory it served, least recently used evicted first): a trajectory whose prefix was
    #: evicted resends its whole context on its next turn (``num_prefix_resends`` in the step
    #: metrics). Size it for every trajectory the worker serves, including those waiting on an
    #: env step; ``None``: 16 Mi tokens (64 MiB of host memory: 512 trajectories at 32k).
    max_prefix_tokens: PosInt | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    #: GPU pools: tensor-parallel degree and memory fraction (ignored by CPU workers).
    tensor_parallel_size: PosInt = 1
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None


class PoolConfig(_Cfg, frozen=True):
    """A pool of identical inference workers on one kind of hardware."""

    name: Name
    #: hardware label, e.g. ``h800`` (compute-strong), ``h20`` (bandwidth), ``cpu``; under
    #: ``--cluster ray`` a GPU pool's workers go to nodes carrying it as a custom resource.
    hardware: Annotated[str, msgspec.Meta(min_length=1, max_length=32)] = "cpu"
    num_workers: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    #: addresses of already running workers (``tcp://host:port``), one per worker; empty: the
    #: launcher starts ``num_workers`` workers locally.
    addresses: list[str] = msgspec.field(default_factory=list)
    #: ``--cluster ray``: the Ray custom resource a node must carry to host these workers
    #: (``tensor_parallel_size`` units per GPU worker, 1 per CPU worker); ``None``: the
    #: ``hardware`` label for GPU pools, none (any node with a free CPU) for ``cpu`` pools.
    ray_resource: RayResource | None = None


class SamplingConfig(_Cfg, frozen=True):
    """Sampling parameters of a domain's generations (vLLM names).

    The trainer recomputes logprobs under ``logits / temperature`` only, so ``top_p`` and
    ``top_k`` must stay disabled: a truncated sampling distribution would make the behaviour
    logprobs and the trainer's disagree (measured: 1.2 nats per token at top_p 0.3) and bias the
    importance-weighted gradient. ``temperature`` must be one value across domains.
    """

    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1


class DomainConfig(_Cfg, frozen=True):
    """A task domain: which env, which pool serves it, how it is rewarded, how often sampled."""

    name: Name
    #: env name as the env host knows it, e.g. ``game:GuessTheNumber-v0-easy``,
    #: ``rg:basic_arithmetic``, or one registered with ``Cluster.register_env``.
    env: Annotated[str, msgspec.Meta(min_length=1)]
    #: pool (by name) whose workers generate for this domain (hardware affinity).
    pool: Name
    #: reward function name: a function of the reward service (``reasoning_gym``, ``math``, ...),
    #: or a local one (``env_return`` = the env's summed step rewards, shaping included;
    #: ``env_success`` = the game's outcome, 1 won, 0 lost, a negative return kept; or one
    #: registered with ``Cluster.register_reward``).
    reward: Annotated[str, msgspec.Meta(min_length=1)]
    #: ``"service"``: the scenario's reward service; ``"local"``: in-process; or an http(s) URL
    #: of any endpoint speaking the reward contract (``{name}`` is replaced by the function name).
    reward_url: Annotated[str, msgspec.Meta(min_length=1)] = "service"
    #: bearer token of an http(s) ``reward_url``: the *name* of the environment variable that
    #: holds it (never the token itself: this file is copied into the run's config.json).
    reward_token_env: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    #: or the path of a file (mode 0600) holding it.
    reward_token_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    #: extra JSON metadata sent with every reward call of this domain.
    reward_metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    #: relative frequency of this domain's groups (normalised over all domains).
    weight: PosFloat = 1.0
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    #: system message (omitted when empty).
    system_prompt: str = ""
    #: first user message; ``{observation}`` is the env's first observation.
    prompt_template: str = "{observation}"
    #: later user messages; ``{observation}`` is the env's new observation.
    turn_template: str = "{observation}"
    #: extra keyword arguments of the tokenizer's chat template (e.g. enable_thinking = false).
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    #: options the env is built with (env hosts: ``gem.make`` / ``Attr(**options)`` / the
    #: dataset config; in-process envs: ``factory(**options)``). For ``game:`` and ``rg:``
    #: envs the scenario is refused when a name is not one the env takes (reasoning-gym:
    #: also values its config refuses, or that no entry can be drawn with on any of several
    #: seeds within 10 s), before anything starts.
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    #: when the env rejects an action (raises ``InvalidActionError``, e.g. broken tool-call
    #: JSON): ``observe``: the model gets the error message as the next observation and the
    #: trajectory goes on; ``penalty``: the trajectory ends with reward
    #: ``invalid_action_penalty`` (the reward function is not called); ``fail``: the trajectory
    #: fails (reason ``invalid_action``) and is re-drawn, like an env failure. The first two
    #: are trained on (model-caused, counted in ``num_invalid_actions``).
    invalid_action: Literal["observe", "penalty", "fail"] = "observe"
    #: reward of a trajectory ended by an invalid action under ``invalid_action = "penalty"``.
    invalid_action_penalty: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] = -1.0
    #: per-domain cap on turns (defaults to ``run.max_turns``; must not exceed it).
    max_turns: PosInt | None = None
    #: this domain's staleness bound (``areal`` / ``rollart`` only; >= ``run.alpha``; ``None``
    #: = ``run.alpha``): a long-horizon domain whose trajectories outlive ``run.alpha + 1``
    #: training steps can never be trained under the run's bound. Its samples still obey this
    #: bound strictly; the in-flight bound stays ``run.alpha``'s.
    alpha: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None


class EnvHostConfig(_Cfg, frozen=True):
    """One environment host process (``rollart serve-env``; names follow its ``HostConfig``)."""

    name: Name
    #: ``tcp://host:port`` of a running host; ``None``: the launcher starts it locally.
    address: str | None = None
    #: wall-clock limit of one env step inside the host, seconds (injected latency excluded).
    step_timeout_s: PosFloat = 60.0
    #: limit of building and resetting an env, seconds.
    open_timeout_s: PosFloat = 120.0
    #: sessions open at once (opens beyond are refused, failing that trajectory).
    max_sessions: PosInt = 1024
    #: threads running env code.
    threads: PosInt = 8
    #: injected latency / failures: env name, family (``game``, ``rg``, ``py``) or ``"*"``
    #: -> distribution (``rollart.envhost.latency.LatencyConfig``).
    latency: dict[str, LatencyConfig] = msgspec.field(default_factory=dict)
    #: ``--cluster ray``: the Ray custom resource (1 unit) of the nodes that may host it, e.g.
    #: ``cpu_env``; ``None``: any node with a free CPU.
    ray_resource: RayResource | None = None


class RewardServiceConfig(_Cfg, frozen=True):
    """The HTTP reward service (``rollart serve-reward``) and the controller's client limits."""

    #: service root URL of a running service; ``None``: the launcher starts one locally.
    url: str | None = None
    host: str = "127.0.0.1"
    #: port of a locally launched service (0: any free port).
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: import paths of user reward modules the service loads.
    modules: list[str] = msgspec.field(default_factory=list)
    max_concurrency: PosInt = 64
    timeout_s: PosFloat = 30.0
    max_retries: NonNegInt = 3
    backoff_s: NonNegFloat = 0.5
    #: also retry timeouts (HTTP 504, no reply within ``timeout_s``): off, since a function
    #: that hung once usually hangs again and each retry starts it again.
    retry_timeouts: bool = False
    #: largest reward reply body the controller reads, bytes (larger: ``reward_too_large``).
    max_reply_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 1 << 20
    #: largest JSON-encoded ``details`` kept in a sample's metadata, bytes.
    max_details_bytes: Annotated[int, msgspec.Meta(ge=2, le=1 << 26)] = 64 << 10
    #: bearer token of the running service at ``url``: the environment variable holding it, or
    #: a file (mode 0600) holding it. A service the launcher starts gets a fresh token per run.
    token_env: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    token_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    #: ``--cluster ray``: the Ray custom resource (1 unit) of the nodes that may host a
    #: launched service; ``None``: any node with a free CPU.
    ray_resource: RayResource | None = None


class TrainerConfig(_Cfg, frozen=True):
    """Optimisation (GRPO / decoupled PPO) and checkpointing; names mirror the trainer's."""

    lr: PosFloat = 1e-5
    weight_decay: NonNegFloat = 0.0
    clip_eps: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.2
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0, le=10)] | None = None
    kl_coef: NonNegFloat = 0.0
    max_grad_norm: PosFloat = 1.0
    #: padded tokens per micro-batch (forward/backward memory budget).
    max_tokens_per_microbatch: Annotated[int, msgspec.Meta(ge=2)] = 8192
    #: optimizer steps per batch, each on an equal share of its samples; with 1 the trainer
    #: reads the proximal logprobs off its training forward (no extra no-grad pass).
    num_minibatches: PosInt = 1
    #: save a checkpoint every N steps (0: only at the planned last step, and on an
    #: interrupt under `--checkpoint-on-interrupt`).
    checkpoint_every: NonNegInt = 0
    #: bytes per weight bucket sent to the inference workers.
    weight_bucket_bytes: PosInt = 1 << 30
    #: ``cpu``, or ``cuda``: the launcher gives a local trainer the first ``num_processes`` GPUs
    #: after the local GPU workers' (``CUDA_VISIBLE_DEVICES``); the parameters use
    #: ``model.dtype``. The launcher cannot count the machine's GPUs: with too few, each rank
    #: without one fails at start, naming CUDA_VISIBLE_DEVICES.
    device: Literal["cpu", "cuda"] = "cpu"
    #: how each version reaches the workers: ``zmq`` (CRC-checked buckets pushed in the
    #: background while rollout continues, applied at the pause point; works across clusters),
    #: ``nccl`` (GPU trainer and GPU workers: one NCCL group, vLLM's weight-transfer engine,
    #: broadcast at the pause point) or ``gloo`` (the same over a gloo group of CPU tensors).
    weight_transfer: Literal["zmq", "nccl", "gloo"] = "zmq"
    #: host the workers reach the trainer's group rendezvous at (nccl / gloo).
    weight_transfer_address: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    #: rendezvous and per-call limit of a collective broadcast, seconds.
    weight_transfer_timeout_s: PosFloat = 600.0
    #: dtype of the weights sent to the workers: ``model`` (the trainer's parameter dtype, as
    #: resolved from ``model.dtype``), ``bf16``, ``fp16`` or ``fp32``. With ``bf16`` / ``fp16``
    #: the trainer keeps float32 master parameters (whatever ``model.dtype``) and rounds each
    #: version to the wire dtype once, after the step: small updates accumulate in the masters
    #: and only elements whose rounded value changed travel as a delta.
    weight_wire_dtype: Literal["model", "bf16", "fp16", "fp32"] = "model"
    #: ``off``: every version in full. ``xor``: zstd of (new XOR base) bit patterns; ``sparse``:
    #: zstd of changed elements' indices and values; both against the exact version the worker
    #: holds (``rollart.weights``), with a CRC32 of each rebuilt bucket. zmq transfer only.
    weight_delta: Literal["off", "xor", "sparse"] = "off"
    #: with ``weight_delta``: versions that are multiples of this go in full to every worker
    #: (new, restarted or lagging workers always get a full version).
    weight_full_every: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10
    #: trainer ranks (data-parallel FSDP2 under torchrun, one node): one GPU each with ``cuda``,
    #: CPU processes over gloo with ``cpu``. 1: a single plain process.
    num_processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    #: ``--cluster ray``: the Ray custom resource of the node that hosts the trainer (one
    #: node: ``num_processes`` units with ``cuda``, 1 with ``cpu``), e.g. ``h800``; ``None``:
    #: any node with the GPUs (``cuda``) or a free CPU.
    ray_resource: RayResource | None = None


class OutputConfig(_Cfg, frozen=True):
    """What a run writes beside ``metrics.jsonl`` (``rollart.launcher.rundir``)."""

    #: decoded trajectories written per step to ``transcripts.jsonl`` at most (0: none).
    transcripts_per_step: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 8
    #: probability that a finished trajectory is considered for a transcript (seeded by
    #: ``run.seed``); the first ``transcripts_per_step`` of those resolved in a step are written.
    transcript_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    #: characters kept of each decoded text (prompt, response, observation); longer ones are cut.
    transcript_max_chars: Annotated[int, msgspec.Meta(ge=16, le=1_000_000)] = 4000
    #: write TensorBoard event files under ``RUN_DIR/tensorboard``.
    tensorboard: bool = True
    #: also log step metrics to Weights & Biases (needs ``wandb`` installed; not a dependency).
    wandb: bool = False
    #: W&B project name.
    wandb_project: Annotated[str, msgspec.Meta(min_length=1)] = "rollart"
    #: let the group read the run folder (umask 0o027: folders 0750, files 0640); off: only
    #: the user who runs it (folders 0700, files 0600). Key and token files stay 0600.
    share_with_group: bool = False


class EvalConfig(_Cfg, frozen=True):
    """Held-out evaluation during a run (``rollart.controller.evaluation.runner``).

    Each domain gets a fixed eval set of ``size`` env seeds drawn from ``[2**31, 2**32)``, a
    range training never draws from (group seeds are below ``2**31``). Every task is played
    once greedily (temperature 0) and ``pass_k`` times with the domain's own sampling, through
    the same inference workers as rollout (the eval's trajectories are never trained). An eval
    runs before the first step, every ``every`` steps and after the last step.
    """

    #: evaluate at all (off: no eval sets, no eval rows).
    enabled: bool = False
    #: evaluate after every this many training steps (0: only before the first step and after
    #: the last one).
    every: NonNegInt = 10
    #: held-out tasks (env seeds) per domain; 400 makes the 95% interval of an accuracy at most
    #: +-0.049 wide.
    size: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 400
    #: seed of the draw of each domain's eval seeds (fixed for the run).
    seed: NonNegInt = 0
    #: sampled trajectories per task for pass@k (k = this; 0: greedy only).
    pass_k: Annotated[int, msgspec.Meta(ge=0, le=64)] = 4
    #: the accuracy a run is judged by (``summary.json``'s ``eval`` first / last / last_ci95,
    #: the collapse check): ``"greedy"`` (temperature 0) or ``"sampled"`` (pass@1 of the
    #: ``pass_k`` samples at the domain's own sampling: the policy as it is trained; needs
    #: ``pass_k >= 1``). Both are always recorded.
    headline: Literal["greedy", "sampled"] = "greedy"
    #: a trajectory with a reward at least this is correct (accuracy, pass@k, baseline).
    success_threshold: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] = 1.0 - 1e-6
    #: eval trajectories running at once, all domains together.
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    #: distinct greedy answers per task below this is reported as collapse (a warning line and
    #: ``summary.json``).
    collapse_distinct_floor: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.01
    #: constant answers (actions) tried per turn when measuring the majority baseline: the
    #: most frequent reference answers and model actions of the first eval and of the first
    #: trained batch.
    baseline_candidates: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8


class Scenario(_Cfg, frozen=True):
    """A whole run. Use :func:`load_scenario`; a hand-built one goes through
    :func:`validate_scenario` before use."""

    pools: list[PoolConfig]
    domains: list[DomainConfig]
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    env_hosts: list[EnvHostConfig] = msgspec.field(default_factory=list)
    reward: RewardServiceConfig = msgspec.field(default_factory=RewardServiceConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)


def _attach_docs() -> None:
    # `#:` comments above each field become a "Fields:" section of the class docstrings, so
    # help(DomainConfig) shows them (rollart.configdoc).
    import sys

    from rollart.configdoc import attach_field_docs

    attach_field_docs(sys.modules[__name__])


_attach_docs()
