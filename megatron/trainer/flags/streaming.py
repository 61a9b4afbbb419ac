"""The streaming mode of a run from its flags: Megatron-LM's granularities and lag, or our exact
``--rl-forced-lag`` (B/B), resolved once (``streaming``) and checked once (``streaming_problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.rl.rollout.granularity import (
    Streaming,
    autotuned_lag,
    gate_capacity,
    lag_from_inflight,
    pair_problems,
    units_per_batch,
)

if TYPE_CHECKING:
    from megatron.trainer.flags.run import RunConfig


def streaming(run: RunConfig) -> Streaming:
    """The units, the lag and where it came from, and the gate's capacity."""
    r, P, G = run.rollouts, run.grpo.prompts_per_step, run.grpo.group_size
    if r.generation_lag is not None:
        lag, source = r.generation_lag, f"--rl-generation-lag {r.generation_lag:g}"
    elif r.max_inflight_requests is not None:
        lag = lag_from_inflight(r.max_inflight_requests, P, G)
        source = f"--rl-max-inflight-requests {r.max_inflight_requests}"
    elif r.partial_rollouts and r.forced_lag == 0:
        lag = autotuned_lag(run.inference.max_requests, P, G)
        source = f"autotuned from --inference-max-requests {run.inference.max_requests}"
    else:
        lag, source = float(r.forced_lag), f"--rl-forced-lag {r.forced_lag}"
    capacity = gate_capacity(max(lag, -1.0), units_per_batch(r.submission_granularity, P, G))
    return Streaming(r.submission_granularity, r.consumption_granularity, lag, capacity, source)


def forced_lag(run: RunConfig) -> int:
    """The generator's whole-batch lag: the gate's capacity less one (``--rl-forced-lag`` itself,
    or the integer lag Megatron-LM's flags round to), less the collection that non-collocated
    generation runs behind training (so the lag a user sets is the staleness the run has in
    both refit modes); 0 in the modes that stream groups."""
    mode = streaming(run)
    if not mode.is_batch:
        return 0
    return mode.capacity - 1 - (1 if non_collocated(run) else 0)


def non_collocated(run: RunConfig) -> bool:
    """Generation on ranks of its own, one collection behind training."""
    return run.parallelism.refit_mode == "non-collocated"


def logged_lag(run: RunConfig) -> float:
    """The lag in each step's record: B/B's whole-batch lag, else the generation lag."""
    mode = streaming(run)
    return mode.capacity - 1 if mode.is_batch else mode.lag


def streaming_problems(run: RunConfig) -> list[str]:
    """What is wrong with the streaming flags, each message naming its flags."""
    r = run.rollouts
    errors = pair_problems(r.submission_granularity, r.consumption_granularity, r.partial_rollouts)
    if r.generation_lag is not None and r.max_inflight_requests is not None:
        errors.append(
            "--rl-generation-lag and --rl-max-inflight-requests are two spellings of the lag: "
            "give one"
        )
    if r.forced_lag != 0 and (r.generation_lag is not None or r.max_inflight_requests is not None):
        errors.append(
            "--rl-forced-lag and --rl-generation-lag / --rl-max-inflight-requests are two "
            "spellings of the lag: give one"
        )
    if r.generation_lag is not None and r.generation_lag < -1:
        errors.append(f"--rl-generation-lag must be >= -1, got {r.generation_lag:g}")
    if errors:
        return errors
    mode = streaming(run)
    if mode.is_batch:
        if non_collocated(run) and mode.capacity == 1:
            errors.append(
                f"--refit-mode non-collocated with {mode.source}: generation on ranks of its own "
                "runs one collection behind training, so its lag is at least 1; use "
                "--rl-forced-lag 1 or more (or the collocated refit for on-policy L = 0)"
            )
        return errors
    if r.forced_lag != 0:
        errors.append(
            f"--rl-forced-lag is the exact lag of whole batches (B/B); with "
            f"--rl-submission-granularity {mode.submission} give --rl-generation-lag"
        )
    P = run.grpo.prompts_per_step
    if mode.consumption == "B" and mode.capacity < P:
        errors.append(
            f"{mode.name} with {mode.source} holds {mode.capacity} groups in flight, fewer than "
            f"the {P} of a batch (--grpo-prompts-per-step), which B consumption waits for: "
            "raise the lag or consume groups (--rl-consumption-granularity G)"
        )
    if run.grpo.filter_groups_with_same_reward:
        errors.append(
            "--grpo-filter-groups-with-same-reward needs whole batches (--rl-submission-"
            "granularity B): a batch's extra generation rounds are submitted with it"
        )
    if run.parallelism.refit_mode == "non-collocated":
        errors.append(
            f"--rl-submission-granularity {mode.submission} is not supported with --refit-mode "
            "non-collocated yet: its inference ranks generate whole batches"
        )
    return errors


def header(run: RunConfig) -> str:
    """The run header's words for the streaming mode."""
    mode = streaming(run)
    if mode.is_batch and mode.source.startswith("--rl-forced-lag"):
        return f"forced lag {run.rollouts.forced_lag}"
    unit = "batches" if mode.submission == "B" else "groups"
    timing = (
        ""
        if run.inference.deterministic_schedule
        else " (--no-rl-deterministic-schedule: units released as generations really end, so "
        "which tokens a step trains depends on timing)"
    )
    return (
        f"streaming {mode.name}, lag {mode.lag:g} ({mode.source}): gate of {mode.capacity} "
        f"{unit}, consumed in submission order{timing}"
    )
