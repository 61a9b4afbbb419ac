"""Per-step metrics: what they mean, the JSONL file and TensorBoard (the log line: ``log_line.py``)."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.rl.grpo.filtering import has_reward_variance
from megatron.rl.rollout.generator import RolloutBatch
from megatron.rl.wire import RolloutGroup, TokenRollout
from megatron.trainer.generation.rollouts import CollectedBatch
from megatron.trainer.metrics.log_line import format_duration, format_log_line
from megatron.trainer.train.step import StepResult


def rollout_metrics(batch: RolloutBatch, step: int) -> dict[str, Any]:
    """Reward, staleness and pipeline statistics of the batch trained at ``step``.

    ``batch_id`` is the id of the trained batch (the generator's prompt cursor; ``step`` //
    iterations per collection), ``complete_groups`` counts its groups with no
    placeholder rollout and ``batch_complete`` says whether that is every group.

    Submission staleness of a rollout = step - policy version at its submission (exactly
    min(step, L) under the forced-lag contract). Token staleness = step - policy version that
    generated the token, over every generated token: measured, between 0 and the submission
    staleness (a rollout's generation can span updates), not fixed by L.

    ``reward/<env_id>/<name>``: the mean value (before its weight) of each reward function of an
    environment whose entry lists ``reward_funcs``, over the non-placeholder rollouts it scored.
    ``episode/<name>_mean``: ``episode_metric_means`` of the non-placeholder rollouts.
    """
    rollouts = [r for g in batch.groups for r in g.rollouts]
    real = [r for r in rollouts if not r.is_placeholder]
    rewards = [r.reward for r in real] or [0.0]
    submission = [step - r.submission_policy_version for r in rollouts]
    tokens = [step - v for r in real for v in r.policy_versions] or [0]
    lengths = [len(r.policy_versions) for r in real] or [0]
    per_env: dict[str, list[float]] = {}
    per_function: dict[str, list[float]] = {}
    for r in real:
        per_env.setdefault(r.env_id, []).append(r.reward)
        for name, value in (r.reward_components or {}).items():
            per_function.setdefault(f"reward/{r.env_id}/{name}", []).append(value)
    complete = sum(not any(r.is_placeholder for r in g.rollouts) for g in batch.groups)
    return {
        "batch_id": batch.batch_id,
        "complete_groups": complete,
        "batch_complete": complete == len(batch.groups),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "staleness_min": min(submission),
        "staleness_mean": statistics.fmean(submission),
        "staleness_max": max(submission),
        "token_staleness_min": min(tokens),
        "token_staleness_mean": statistics.fmean(tokens),
        "token_staleness_max": max(tokens),
        "in_flight_batches": batch.in_flight,
        "queue_depth": batch.queue_depth,
        "placeholder_rollouts": len(rollouts) - len(real),
        "completion_tokens_mean": statistics.fmean(lengths),
        **{f"reward_mean/{env}": statistics.fmean(v) for env, v in sorted(per_env.items())},
        **{key: statistics.fmean(v) for key, v in sorted(per_function.items())},
        **episode_metric_means(real),
        **zero_variance_metrics(batch.groups),
        **gate_metrics(batch),
        **megatron_lm_staleness(real, step),
    }


def megatron_lm_staleness(rollouts: list[TokenRollout], step: int) -> dict[str, float]:
    """Megatron-LM's staleness metrics, over the generated tokens of ``rollouts``: policy
    staleness (step - the version that sampled the token: our ``token_staleness_*``), KV-cache
    staleness (step - the oldest version in the cache the token attended to: the version of the
    rollout's first token, whose step filled the prompt's cache; the cache is kept across
    updates), and both for each rollout's last token alone."""
    policy = [step - v for r in rollouts for v in r.policy_versions] or [0]
    kv = [step - r.policy_versions[0] for r in rollouts for _ in r.policy_versions] or [0]
    last = [r for r in rollouts if r.policy_versions]
    last_policy = [step - r.policy_versions[-1] for r in last] or [0]
    last_kv = [step - r.policy_versions[0] for r in last] or [0]
    out = {}
    for name, values in (
        ("policy_staleness", policy),
        ("kv_cache_staleness", kv),
        ("last_token_policy_staleness", last_policy),
        ("last_token_kv_cache_staleness", last_kv),
    ):
        out |= {
            f"min_{name}": min(values),
            f"mean_{name}": statistics.fmean(values),
            f"max_{name}": max(values),
        }
    return out


def gate_metrics(batch: RolloutBatch) -> dict[str, Any]:
    """The group gate at hand-over (G submission only): its capacity, the units it holds and
    their share, in groups; none for whole batches (``in_flight_batches`` says it)."""
    if batch.gate_capacity is None:
        return {}
    held = batch.gate_held if batch.gate_held is not None else batch.in_flight
    return {
        "gate_capacity": batch.gate_capacity,
        "gate_held": held,
        "gate_utilization": held / batch.gate_capacity,
    }


def episode_metric_means(rollouts: list[TokenRollout]) -> dict[str, float]:
    """``episode/<name>_mean``: the mean of each ``episode_metrics`` entry (a chat episode's
    turns, tool calls, tool errors, truncated) over the rollouts that carry it."""
    values: dict[str, list[float]] = {}
    for r in rollouts:
        for name, value in (r.episode_metrics or {}).items():
            values.setdefault(name, []).append(value)
    return {f"episode/{name}_mean": statistics.fmean(v) for name, v in sorted(values.items())}


def zero_variance_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """``zero_variance_group_fraction``: the share of ``groups`` without two non-placeholder
    rollouts of different rewards (``has_reward_variance``), whose advantages, loss and gradient
    are therefore 0 (a group with fewer than two non-placeholder rollouts counts); and
    ``zero_variance_group_fraction/<env_id>`` over each environment's groups."""
    per_env: dict[str, list[bool]] = {}
    for group in groups:
        per_env.setdefault(group.rollouts[0].env_id, []).append(not has_reward_variance(group))
    flags = [flag for env_flags in per_env.values() for flag in env_flags]
    return {
        "zero_variance_group_fraction": statistics.fmean(flags) if flags else 0.0,
        **{
            f"zero_variance_group_fraction/{env}": statistics.fmean(env_flags)
            for env, env_flags in sorted(per_env.items())
        },
    }


def constant_reward_warnings(groups: list[RolloutGroup], batch_id: int) -> dict[str, str]:
    """The warning of each environment none of whose groups in ``groups`` has differing rewards
    (environments without a non-placeholder rollout are left to the failure reports)."""
    rewards: dict[str, set[float]] = {}
    counts: dict[str, int] = {}
    varied: set[str] = set()
    for group in groups:
        env = group.rollouts[0].env_id
        real = [r.reward for r in group.rollouts if not r.is_placeholder]
        rewards.setdefault(env, set()).update(real)
        counts[env] = counts.get(env, 0) + 1
        if has_reward_variance(group):
            varied.add(env)
    warnings = {}
    for env, values in sorted(rewards.items()):
        if env in varied or not values:
            continue
        shown = " or ".join(f"{v:g}" for v in sorted(values))
        each = "all" if len(values) == 1 else "each all"
        warnings[env] = (
            f"warning: environment {env!r}: no group of batch {batch_id} has differing rewards "
            f"({counts[env]} groups, {each} {shown}): its advantages, policy-gradient loss and "
            f"gradient are 0 for this batch: the task may be too hard or too easy for the model; "
            f"see zero_variance_group_fraction/{env}"
        )
    return warnings


class ConstantRewardWarning:
    """Warns (rank 0 prints) once per environment when, in one of the first ``batches`` batches
    this process collects, none of the environment's groups has differing rewards."""

    def __init__(self, batches: int = 4) -> None:
        self.batches = batches
        self.checked = 0
        self.warned: set[str] = set()

    def check(self, batch: RolloutBatch) -> list[str]:
        """The warnings ``batch`` raises (printed by the caller); none after the first batches."""
        if self.checked >= self.batches:
            return []
        self.checked += 1
        found = constant_reward_warnings(batch.groups, batch.batch_id)
        lines = [line for env, line in found.items() if env not in self.warned]
        self.warned.update(found)
        return lines


def engine_metrics(collected: CollectedBatch) -> dict[str, Any]:
    """What the engine did in the collection window: ``generated_tokens`` (every batch in
    flight) and their rate, ``engine_steps``, ``engine_rows_per_step`` (mean requests decoded per
    step), ``engine_seconds`` (inside steps) and ``engine_idle_seconds``: the rest of the window,
    spent waiting for rewards, announced requests or agents. At a reward-wait budget K, about
    ``engine_idle_seconds / (engine_seconds / engine_steps)`` more steps would fit in the wait."""
    e, seconds = collected.engine, collected.seconds
    assert e is not None, "only rank 0 collects, and only rank 0 logs"
    return {
        "generated_tokens": e.generated_tokens,
        "generated_tokens_per_s": e.generated_tokens / max(seconds, 1e-9),
        "engine_steps": e.steps,
        "engine_rows_per_step": e.rows / max(e.steps, 1),
        "engine_seconds": e.step_seconds,
        "engine_idle_seconds": max(seconds - e.step_seconds, 0.0),
    }


def step_metrics(
    step: int,
    lag: int,
    collected: CollectedBatch,
    result: StepResult,
    step_seconds: float,
    extra: dict[str, Any] | None = None,
    iterations_per_collection: int = 1,
) -> dict[str, Any]:
    """Everything logged for one step (training iteration), as a flat JSON-serializable dict.

    ``batch_id`` (``rollout_metrics``) is the collection the iteration trains on and
    ``batch_staleness`` how many
    collections before it that collection was submitted: exactly min(batch_id, L). Submission and
    token staleness count policy versions (iterations), ``iterations_per_collection`` per batch.

    ``result.metrics`` adds ``clip_fraction``, ``ratio_mean``, ``mismatch_kl`` and, when enabled,
    each loss term's metric (``ref_kl``, ``entropy``, ...) and the train/inference mismatch
    (``is_abs_delta_p``, ``is_kl``, ``is_weight_mean``, ``is_truncated_fraction``,
    ``is_truncated_sequence_fraction``, and in the IS mask modes ``is_masked_fraction``,
    ``is_masked_sequence_fraction``), and the policy-loss variants' (``gspo_ratio_mean``,
    ``gspo_clipped_sequence_fraction``, ``cispo_weight_mean``,
    ``opsm_masked_sequence_fraction``); ``extra`` from the loop adds dynamic sampling
    (``dynamic_sampling_*``), the sequence-level logprob error (``seq_mult_prob_error_*``,
    ``seq_logprob_error_*``), evaluation (``eval/*``) and, with another advantage estimator,
    scale or the overlong shaping, ``advantages_*``, ``overlong_*`` and ``truncated_*``. MoE
    models add ``moe_aux_loss`` (with --moe-aux-loss-coeff > 0) and ``moe_load_imbalance``.
    """
    k = iterations_per_collection
    submitted = [r.submission_policy_version for g in collected.batch.groups for r in g.rollouts]
    return {
        "step": step,
        "loss": result.loss,
        "batch_staleness": collected.batch.batch_id - min(submitted) // k,
        "group_staleness_min": collected.batch.batch_id - max(submitted) // k,
        **rollout_metrics(collected.batch, step),
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "lag": lag,
        **engine_metrics(collected),
        "trained_tokens_per_s": result.trained_tokens / max(result.seconds, 1e-9),
        "collect_seconds": collected.seconds,
        "train_seconds": result.seconds,
        "step_seconds": step_seconds,
        **result.metrics,
        **(extra or {}),
    }


def _drop_records_from(path: Path, first_step: int) -> None:
    """Rewrite the JSONL file at ``path`` without records of steps >= ``first_step``."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
        if record.get("step", -1) < first_step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class WandbConfig:
    """Where Weights & Biases logging goes (``--wandb-*``)."""

    project: str
    name: str | None
    """Run name (None: wandb picks one)."""
    directory: str
    """Local wandb directory."""
    config: dict[str, Any]
    """The run's scalar flags, stored with the run."""


class MetricsWriter:
    """Writes metrics on rank 0: stdout every ``log_interval`` steps; JSONL, TensorBoard and
    wandb always.

    The JSONL file is appended to, and created with the first record (a run that fails before
    its first step leaves none). A run resumed at ``first_step`` first drops the records of
    steps >= ``first_step`` (logged after the checkpoint by the run that stopped, and trained
    again now) and a torn last line, so the file holds each step once.
    """

    def __init__(
        self,
        train_iters: int,
        log_interval: int,
        metrics_file: str | None = None,
        tensorboard_dir: str | None = None,
        first_step: int = 0,
        wandb: WandbConfig | None = None,
    ) -> None:
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.first_step = first_step
        self.started = time.monotonic()
        self.records: list[dict[str, Any]] = []
        """Every step's metrics, for the closing summary and the curves."""
        self._jsonl = None
        self._jsonl_path = None if metrics_file is None else Path(metrics_file)
        if self._jsonl_path is not None and first_step > 0:
            _drop_records_from(self._jsonl_path, first_step)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # availability checked by the flags

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        self._wandb = None
        if wandb is not None:
            import wandb as wandb_module  # availability checked by the flags

            Path(wandb.directory).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb_module.init(
                project=wandb.project, name=wandb.name, dir=wandb.directory, config=wandb.config
            )

    def write(self, metrics: dict[str, Any]) -> None:
        """Record one step's metrics."""
        step = metrics["step"]
        self.records.append(metrics)
        if step % self.log_interval == 0 or step == self.train_iters - 1:
            print(format_log_line(metrics, self.train_iters, self._timing(step)), flush=True)
        if self._jsonl_path is not None:
            if self._jsonl is None:  # created with the first record: a run that fails first
                self._jsonl_path.parent.mkdir(parents=True, exist_ok=True)  # leaves no file
                self._jsonl = open(self._jsonl_path, "a", encoding="utf-8")
            self._jsonl.write(json.dumps(metrics) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if key not in ("step", "batch_id"):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def _timing(self, step: int) -> str:
        """`` | elapsed 1m02s | eta 3m10s`` after ``step`` (ETA: the mean step time so far)."""
        elapsed = time.monotonic() - self.started
        done = step - self.first_step + 1
        eta = elapsed / max(done, 1) * (self.train_iters - step - 1)
        return f" | elapsed {format_duration(elapsed)} | eta {format_duration(eta)}"

    def close(self) -> None:
        """Flush and close the outputs."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
