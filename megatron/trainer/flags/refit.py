"""The checks of a refit (``--rl-inference-tensor-model-parallel-size``, ``--refit-mode``,
``--refit-method``, ``--rl-delta-refit``, declared with the parallel layout in ``training.py``)
against the model, the world and the tier."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.trainer.flags.run import RunConfig

FLAG = "--rl-inference-tensor-model-parallel-size"


def refit_problems(run: RunConfig, cuda: bool) -> list[str]:
    """What a refit cannot do with the rest of the run, each naming its flags."""
    p = run.parallelism
    errors = []
    separate = p.refit_mode == "non-collocated"
    if p.refit_method == "nccl" and not cuda:
        errors.append("--refit-method nccl needs CUDA: the CPU tier's ranks talk over gloo")
    if p.refit_method == "nccl" and cuda and separate:
        errors.append(
            "--refit-method nccl with --refit-mode non-collocated: the weights travel over gloo "
            "through host memory (the two sides share no NCCL communicator); use gloo"
        )
    if p.rl_inference_replicas > 1 and not separate:
        errors.append(
            "--rl-inference-replicas needs --refit-mode non-collocated (a collocated copy has "
            f"world size / {FLAG} replicas)"
        )
    if p.rl_delta_refit and not separate:
        errors.append(
            "--rl-delta-refit needs --refit-mode non-collocated (a collocated refit copies "
            "in place and sends nothing to delta)"
        )
    t = p.rl_inference_tensor_model_parallel_size
    if separate and t is None:
        t = p.tensor_model_parallel_size
    errors += _copy_layout_problems(p, t)
    if t is None or t < 1:
        return errors
    mode = "--refit-mode non-collocated" if separate else FLAG
    if p.refit_method == "gloo" and cuda and not separate:
        errors.append(
            f"--refit-method gloo with {FLAG}: a collocated refit on CUDA gathers each weight "
            "over the training tensor-parallel group's NCCL; use nccl (the default on CUDA)"
        )
    if not separate and p.pipeline_model_parallel_size > 1 and p.expert_model_parallel_size > 1:
        errors.append(
            f"{FLAG} with --pipeline-model-parallel-size {p.pipeline_model_parallel_size} and "
            f"--expert-model-parallel-size {p.expert_model_parallel_size}: a copy gathers "
            "pipeline stages or expert-parallel ranks, not both; drop one of them"
        )
    if not separate and run.world_size % t != 0:
        errors.append(f"world size {run.world_size} must be divisible by {FLAG} ({t})")
    arch = run.architecture_flags
    groups = arch["num_query_groups"] or arch["num_attention_heads"]
    for what, value in (
        ("--num-attention-heads", arch["num_attention_heads"]),
        ("--num-query-groups", groups),
        ("--ffn-hidden-size", arch["ffn_hidden_size"]),
        ("--make-vocab-size-divisible-by", run.model.make_vocab_size_divisible_by),
    ):
        if value % t != 0:
            errors.append(f"{what} ({value}) must be divisible by {FLAG} ({t})")
    replicas = p.rl_inference_replicas if separate else max(1, run.world_size // t)
    if run.inference.max_requests % replicas != 0:
        errors.append(
            f"--inference-max-requests ({run.inference.max_requests}) must be divisible by the "
            f"{replicas} inference replicas of {FLAG} {t}"
            + (" (--rl-inference-replicas)" if separate else "")
        )
    if arch["num_experts"] is not None and separate:
        errors.append(f"{mode} supports dense models only: drop it or --num-experts")
    elif arch["num_experts"] is not None:
        errors += _moe_copy_problems(run, t)
    if run.lora.lora_rank > 0:
        errors.append(
            f"{mode} copies whole weights: with --lora-rank the engine generates with the "
            "adapters on the trained model itself (drop the flag)"
        )
    return errors


def _copy_layout_problems(p, t: int | None) -> list[str]:
    """Megatron-LM's layout flags of the inference copy against what is implemented: one whole
    stage, every expert, the experts split over the copy's TP ranks."""
    rows = (  # flag, its value, the size implemented, why
        (
            "--rl-inference-pipeline-model-parallel-size",
            p.rl_inference_pipeline_model_parallel_size,
            1,
            "an inference copy is one whole stage",
        ),
        (
            "--rl-inference-expert-model-parallel-size",
            p.rl_inference_expert_model_parallel_size,
            1,
            "an inference copy holds every expert",
        ),
        (
            "--rl-inference-expert-tensor-model-parallel-size",
            p.rl_inference_expert_tensor_model_parallel_size,
            t,
            f"the copy's experts are split over its {FLAG} ({t}) ranks",
        ),
    )
    given = [row for row in rows if row[1] is not None]
    if given and t is None:
        return [f"{', '.join(row[0] for row in given)} describe the copy of {FLAG}: set it too"]
    return [
        f"{flag} {value}: {why} ({implemented}, the only size implemented)"
        for flag, value, implemented, why in given
        if value != implemented
    ]


def _moe_copy_problems(run: RunConfig, t: int) -> list[str]:
    """What an MoE model's collocated copy at TP ``t`` cannot do."""
    errors, arch = [], run.architecture_flags
    if run.model.moe_grouped_gemm:
        errors.append(
            f"{FLAG} with --moe-grouped-gemm: the refit copies megatron-core's sequential "
            "experts (one MLP per expert) only; drop one of them"
        )
    for what, value in (
        ("--moe-ffn-hidden-size", arch.get("moe_ffn_hidden_size")),
        ("--moe-shared-expert-intermediate-size", arch.get("moe_shared_expert_intermediate_size")),
    ):
        if value is not None and value % t != 0:
            errors.append(f"{what} ({value}) must be divisible by {FLAG} ({t})")
    return errors


def inference_run_config(cfg: RunConfig) -> RunConfig:
    """What the inference ranks of ``--refit-mode non-collocated`` run with: ``--rl-inference-
    replicas`` data-parallel replicas at the inference TP degree, generating on their own model
    (no copy of their own)."""
    replicas = cfg.parallelism.rl_inference_replicas
    parallelism = dataclasses.replace(
        cfg.parallelism,
        tensor_model_parallel_size=cfg.inference_ranks // replicas,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        rl_inference_tensor_model_parallel_size=None,
    )
    return dataclasses.replace(
        cfg, parallelism=parallelism, world_size=cfg.inference_ranks, data_parallel_size=replicas
    )
