"""What a run says about itself: the start-up header, the closing summary and the curves PNG.

* megatron-core's "Transformer Engine / Apex is not installed" warnings, collected while it loads
  (``kernels.kernel_warnings``), become one header line; its other known notices
  (``kernels.notices``: a missing absl-py, 0.19's ``GPTModel`` deprecation) another.
* ``header(...)``: model (parameters, architecture), tokenizer, environments with their weights,
  forced lag, batch shape, tier and parallel layout, where metrics and checkpoints go.
* ``summary(...)``: steps, wall time, first/last-10 reward, whether every step kept its exact
  submission staleness (token staleness is measured per step, not fixed), and the paths written
  (metrics, checkpoints, Hugging Face export, the PNG of the reward and loss curves, written by
  ``write_curves``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron.rl.agent.api import Agent
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.rollout.granularity import group_staleness, staleness_bounds
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.flags.streaming import header as streaming_header, streaming
from megatron.trainer.runtime import kernels


def parameter_count(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None, trainable: bool = False
) -> int:
    """Parameters of the whole model (``trainable``: only those with a gradient, the adapters of
    a LoRA model): each tensor-parallel shard once, summed over TP and PP (collective)."""
    count = sum(
        p.numel()
        for p in model.parameters()
        if param_is_not_tensor_parallel_duplicate(p, tp_group)
        and (p.requires_grad or not trainable)
    )
    total = torch.tensor([count], dtype=torch.long)
    groups = [tp_group] if tp_group is not None and dist.get_world_size(tp_group) > 1 else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_pipeline_model_parallel_group())
    for group in groups:
        dist.all_reduce(total, group=group)
    return int(total)


def describe_architecture(arch: GPTArchitecture) -> str:
    """One line: layers x width, heads (GQA), positions, norm, MLP, biases, embeddings."""
    heads = f"{arch.num_attention_heads} heads"
    if arch.query_groups != arch.num_attention_heads:
        heads += f" ({arch.query_groups} KV groups)"
    rope = "RoPE" + (" (Llama 3 scaling)" if arch.rope_scaling else "")
    positions = rope if arch.position_embedding_type == "rope" else "learned positions"
    bias = "biases" if arch.add_bias_linear else ("QKV bias" if arch.add_qkv_bias else "no biases")
    return (
        f"{arch.num_layers} x {arch.hidden_size}, {heads}, {positions}, {arch.normalization}"
        f"{' + QK norm' if arch.qk_layernorm else ''}, {'SwiGLU' if arch.swiglu else 'GELU'} MLP "
        f"{arch.ffn_hidden_size}, {bias}, vocab {arch.vocab_size}"
        f"{', untied output' if arch.untie_embeddings_and_output_weights else ''}"
    )


def _reward_functions(agent: Agent) -> str:
    """``; reward 1 correct + 0.1 number`` for an environment scored by reward functions."""
    functions = getattr(getattr(agent, "reward_functions", None), "functions", None)
    if not functions:
        return ""
    return "; reward " + " + ".join(f"{f.weight:g} {f.name}" for f in functions)


def header(
    cfg: RunConfig,
    arch: GPTArchitecture,
    parameters: int,
    tokenizer: Any,
    agent: Agent,
    tier_line: str,
    missing_kernels: set[str],
    plot_file: Path | None,
    trainable: int | None = None,
) -> str:
    """The lines printed before the first step (``trainable``: the parameters trained, when
    not all of them)."""
    agents = agent.agents if isinstance(agent, MixtureAgent) else [agent]
    weights = agent.weights if isinstance(agent, MixtureAgent) else (1.0,)
    total = sum(weights) or 1.0
    envs = ", ".join(
        f"{a.env_id} ({w / total:.0%}{_reward_functions(a)})" for a, w in zip(agents, weights)
    )
    source = f"from {cfg.model.hf_checkpoint}" if cfg.model.hf_checkpoint else "random init"
    tok = type(tokenizer).__name__ + (
        f" {cfg.model.tokenizer_model}" if cfg.model.tokenizer_model else ""
    )
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    dp = cfg.data_parallel_size
    lines = [
        f"model        {parameters / 1e6:.2f}M parameters ({source}): {describe_architecture(arch)}",
        f"tokenizer    {tok}, {tokenizer.vocab_size} ids",
        f"environments {envs}"
        + (f" (config {cfg.rollouts.env_config})" if cfg.rollouts.env_config else ""),
        f"rollouts     {streaming_header(cfg)}, {cfg.grpo.prompts_per_step} prompts x "
        f"{cfg.grpo.group_size} samples = {rollouts} per collection, {cfg.iterations_per_collection}"
        f" iteration(s) per collection of {cfg.training.global_batch_size} (micro-batch "
        f"{cfg.training.micro_batch_size}), {cfg.training.train_iters} iterations",
        f"parallelism  {tier_line}; world {cfg.world_size} = TP {cfg.parallelism.tensor_model_parallel_size}"
        f" x PP {cfg.parallelism.pipeline_model_parallel_size} x DP {dp}"
        + (
            f" training, + {cfg.inference_ranks} inference ranks (--refit-mode non-collocated)"
            if cfg.inference_ranks
            else ""
        ),
        f"outputs      metrics {cfg.logging.metrics_file or '(log only)'}, checkpoints "
        f"{cfg.checkpointing.save or '(none)'}"
        + (f", Hugging Face export {cfg.model.save_hf}" if cfg.model.save_hf else "")
        + (f", PEFT adapters {cfg.lora.save_lora}" if cfg.lora.save_lora else "")
        + (f", curves {plot_file}" if plot_file else ""),
    ]
    if cfg.distillation.enabled:  # after the rollouts line
        lines.insert(4, distill_line(cfg))
    if cfg.lora.enabled:
        lines.insert(1, lora_line(cfg, parameters, trainable))
    if missing_kernels:
        lines.append(kernels_line(missing_kernels))
    if kernels.notices():
        lines.append(notices_line(kernels.notices()))
    return "\n".join(lines)


def distill_line(cfg: RunConfig) -> str:
    """The header line of a distilling run: the teacher and each token's advantage."""
    distill = cfg.distillation
    head = f"distill      teacher {distill.distill_teacher} (frozen); "
    k = distill.distill_topk_logits_k
    if k is not None:
        reward = "A_env" if distill.reward else "no reward"
        return (
            f"{head}advantage {reward}, token loss + {distill.coef:g} x KL on the teacher's top-{k}"
        )
    term = "(log pi_teacher - log pi_old)"
    advantage = f"A_env + {distill.coef:g} x {term}" if distill.reward else f"{term}, no reward"
    return f"{head}token advantage {advantage}"


def lora_line(cfg: RunConfig, parameters: int, trainable: int | None) -> str:
    """The header line of a LoRA run: rank, scale, targets, what trains and what is frozen."""
    lora = cfg.lora
    share = f" ({trainable / parameters:.2%} of all)" if trainable and parameters else ""
    count = f"{trainable / 1e6:.3f}M trainable{share}" if trainable is not None else "adapters"
    base = "bf16" if cfg.training.bf16 else "fp32"
    start = f", from {lora.lora_checkpoint}" if lora.lora_checkpoint else f", init {lora.lora_init}"
    scale = lora.lora_alpha / (lora.lora_rank**0.5 if lora.lora_use_rslora else lora.lora_rank)
    rule = "alpha / sqrt(rank)" if lora.lora_use_rslora else "alpha / rank"
    return (
        f"lora         rank {lora.lora_rank}, alpha {lora.lora_alpha:g} (scale {rule} = "
        f"{scale:g}) on {' '.join(lora.lora_target_modules)}{start}: "
        f"{count}; base frozen ({base} linear weights), reference = base"
    )


def kernels_line(missing_kernels: set[str]) -> str:
    """The header line naming the kernel packages megatron-core runs without."""
    names = " and ".join(sorted(missing_kernels))
    return f"kernels      {names} not installed: megatron-core's local implementations"


def notices_line(notices: list[str]) -> str:
    """The header line of megatron-core's folded notices (``kernels.notices()``)."""
    return "megatron     " + "; ".join(notices)


def summary(
    records: list[dict[str, Any]],
    lag: int,
    seconds: float,
    cfg: RunConfig,
    plot_file: Path | None,
) -> str:
    """The lines printed after the last step."""
    if not records:
        return f"run ended after {seconds:.1f} s without training a step"
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    lines = [
        f"done         {len(records)} steps ({records[0]['step']}..{records[-1]['step']}) in "
        f"{seconds:.1f} s; reward first-10 {first:.3f}, last-10 {last:.3f}",
        staleness_line(records, lag, cfg),
    ]
    written = [("metrics", cfg.logging.metrics_file), ("checkpoints", cfg.checkpointing.save)]
    written += [("Hugging Face export", cfg.model.save_hf), ("PEFT adapters", cfg.lora.save_lora)]
    written += [("curves", plot_file)]
    lines += [f"{name:<12} {path}" for name, path in written if path]
    return "\n".join(lines)


def staleness_line(records: list[dict[str, Any]], lag: int, cfg: RunConfig) -> str:
    """The summary's check of the streaming mode's contract over every trained batch."""
    mode = streaming(cfg)
    if not mode.is_batch:
        P, C = cfg.grpo.prompts_per_step, mode.capacity
        exact = all(
            (r["group_staleness_min"], r["batch_staleness"])
            == (
                min(
                    group_staleness(u, C, P)
                    for u in range(r["batch_id"] * P, (r["batch_id"] + 1) * P)
                ),
                max(
                    group_staleness(u, C, P)
                    for u in range(r["batch_id"] * P, (r["batch_id"] + 1) * P)
                ),
            )
            for r in records
        )
        least, most = staleness_bounds(C, P)
        return (
            f"staleness    {'exact' if exact else 'NOT exact'}: every group u trained "
            f"u // {P} - max(0, (u - {C}) // {P}) collections after its submission ({mode.name}, "
            f"gate of {C} groups: between {least} and {most} once the gate is full)"
        )
    behind = cfg.inference_ranks > 0  # non-collocated: its generator runs at L - 1
    lag += 1 if behind else 0
    exact = all(r["batch_staleness"] == min(r["batch_id"], lag) for r in records)
    return (
        f"staleness    {'exact' if exact else 'NOT exact'}: every batch trained "
        f"min(batch, {lag}) collections after its submission"
        + (" (non-collocated: generation runs one collection behind)" if behind else "")
    )


def write_curves(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Reward (mean, and last-10 mean) and loss per step as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    smooth = [statistics.fmean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, rewards, alpha=0.35, label="reward (batch mean)")
    top.plot(steps, smooth, label="reward (last 10)")
    top.set_ylabel("reward")
    top.legend(loc="lower right")
    bottom.plot(steps, [r["loss"] for r in records], color="tab:red")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("iteration")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_file(cfg: RunConfig) -> Path | None:
    """Where the reward/loss curves go: ``--plot-file``, else next to ``--metrics-file``, else
    ``runs/curves-<start time>.png``; None for ``--plot-file none``."""
    if cfg.logging.plot_file is not None:
        return None if cfg.logging.plot_file.lower() == "none" else Path(cfg.logging.plot_file)
    if cfg.logging.metrics_file is not None:
        return Path(cfg.logging.metrics_file).with_suffix(".png")
    return Path("runs") / f"curves-{cfg.started}.png"
