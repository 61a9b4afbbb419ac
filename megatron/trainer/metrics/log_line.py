"""The one line a training step prints: the step, its loss, reward, pipeline state and timings,
then the metrics of the options that are on (``format_log_line``)."""

from __future__ import annotations

from typing import Any

from megatron.rl.grpo.terms import loss_terms


def format_duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_log_line(m: dict[str, Any], train_iters: int, timing: str = "") -> str:
    """One human-readable line per step (``timing``: elapsed and ETA)."""
    return (
        f"step {m['step']:>5}/{train_iters} | loss {m['loss']:+.4e} | "
        f"reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f} | "
        + (
            f"zero-var groups {m['zero_variance_group_fraction']:.2f} | "
            if "zero_variance_group_fraction" in m
            else ""
        )
        + f"grad-norm {m['grad_norm']:.3f} | "
        f"lr {m['lr']:.2e} | lag {m['lag']} | staleness {m['staleness_min']}/"
        f"{m['staleness_mean']:.2f}/{m['staleness_max']} | token-staleness "
        f"{m['token_staleness_min']}/{m['token_staleness_mean']:.2f}/{m['token_staleness_max']} | "
        f"in-flight {m['in_flight_batches']} | queue {m['queue_depth']} | "
        f"gen {m['generated_tokens_per_s']:.0f} tok/s | train {m['trained_tokens_per_s']:.0f} tok/s"
        f" | step {m['step_seconds'] * 1000:.0f} ms{timing}"
        + (f" | failed rollouts {m['placeholder_rollouts']}" if m["placeholder_rollouts"] else "")
        + _optional_log_fields(m)
    )


def _optional_log_fields(m: dict[str, Any]) -> str:
    """Log-line fields of the optional features that are on."""
    parts = [
        f"{term.name.replace('_', '-')} {m[term.name]:.3e}"
        for term in loss_terms()
        if term.name in m
    ]
    if "is_kl" in m:
        parts.append(
            f"train/inference |dp| {m['is_abs_delta_p']:.2e} kl {m['is_kl']:.2e} "
            f"truncated {m['is_truncated_fraction']:.3f}"
        )
    if "seq_mult_prob_error_max" in m:
        parts.append(
            f"seq prob error {m['seq_mult_prob_error_min']:.3f}/"
            f"{m['seq_mult_prob_error_mean']:.3f}/{m['seq_mult_prob_error_max']:.3f}"
            + (
                f" masked {m['seq_logprob_error_masked_sequences']}"
                if "seq_logprob_error_masked_sequences" in m
                else ""
            )
        )
    if "dynamic_sampling_rounds" in m:
        parts.append(
            f"kept groups after {m['dynamic_sampling_rounds']} round(s), dropped "
            f"{m['dynamic_sampling_dropped_groups']}"
        )
    if "overlong_penalty_mean" in m or "truncated_masked_rollouts" in m:
        parts.append(
            f"truncated rollouts {m['truncated_fraction']:.2f}"
            + (
                f" overlong penalty {m['overlong_penalty_mean']:+.3f}"
                if "overlong_penalty_mean" in m
                else ""
            )
            + (
                f" masked {m['truncated_masked_rollouts']}"
                if "truncated_masked_rollouts" in m
                else ""
            )
        )
    if "moe_load_imbalance" in m:
        aux = f"aux loss {m['moe_aux_loss']:.3e} " if "moe_aux_loss" in m else ""
        routing = (
            f" routing mismatch {m['moe_routing_mismatch']:.4f}"
            if "moe_routing_mismatch" in m
            else ""
        )
        parts.append(f"moe {aux}load imbalance {m['moe_load_imbalance']:.2f}{routing}")
    if "eval/greedy_reward" in m:
        passk = " ".join(
            f"{k[5:]} {v:.3f}"
            for k, v in m.items()
            if k.startswith("eval/pass@") and k.count("/") == 1
        )
        parts.append(f"eval greedy {m['eval/greedy_reward']:.3f} {passk}")
    return "".join(f" | {p}" for p in parts)
