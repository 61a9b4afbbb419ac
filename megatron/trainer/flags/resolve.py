"""``resolve``: the parsed values -> a ``RunConfig`` (``run.py``) and every problem, each naming
its flags. A section's own checks are its ``problems()``; the checks across sections are here:
the model against the parallel layout and the world, the experts, the batch sizes, the intervals,
exports and output paths.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron.trainer.flags.distill import distill_problems
from megatron.trainer.flags.lora import resolve_lora
from megatron.trainer.flags.model import (
    Model,
    architecture_flags,
    checkpoint_conflicts,
    gpt_architecture,
    read_checkpoint_config,
    tokenizer_directory_problem,
    with_defaults,
)
from megatron.trainer.flags.option import bounds_problems, dest_of
from megatron.trainer.flags.output import OUTPUT_PATHS, output_path_problem
from megatron.trainer.flags.refit import refit_problems
from megatron.trainer.flags.run import SECTIONS, RunConfig, sections_of
from megatron.trainer.flags.streaming import streaming_problems
from megatron.trainer.flags.training import parallelism_with_defaults, training_with_defaults


def resolve(
    values: Mapping[str, Any],
    world_size: int,
    cuda: bool,
    explicit: frozenset[str] = frozenset(),
) -> tuple[RunConfig | None, list[str]]:
    """The run config of parsed ``values`` (argparse dests) on ``world_size`` ranks, or None, and
    every problem, each naming its flags. ``explicit``: the dests the user gave (for the
    conflicts of ``--hf-checkpoint`` with architecture flags)."""
    s = sections_of(values)
    errors: list[str] = []
    for name, _ in SECTIONS:
        errors += bounds_problems(s[name]) + s[name].problems()
    model: Model = s["model"]
    hf = None
    unreadable: list[str] = []
    if model.make_vocab_size_divisible_by >= 1:
        hf, unreadable = read_checkpoint_config(model)
        errors += unreadable
        if hf is not None:
            errors += checkpoint_conflicts(model, hf, explicit)
    model = with_defaults(model)
    if not unreadable and (missing := tokenizer_directory_problem(model)) is not None:
        errors.append(missing)
    arch = architecture_flags(model, hf)
    lora, lora_errors = resolve_lora(s["lora"], explicit, gated=bool(arch["swiglu"]))
    errors += lora_errors
    rollouts = s["grpo"].prompts_per_step * s["grpo"].group_size
    training = training_with_defaults(s["training"], rollouts)
    parallelism = parallelism_with_defaults(
        s["parallelism"], s["training"].watchdog_timeout_minutes
    )
    inference_ranks = 0
    if parallelism.refit_mode == "non-collocated":  # Megatron-LM's split: training ranks first
        replicas = parallelism.rl_inference_replicas
        inference_ranks = replicas * (
            parallelism.rl_inference_tensor_model_parallel_size
            or parallelism.tensor_model_parallel_size
        )
        if world_size <= inference_ranks:
            errors.append(
                f"--refit-mode non-collocated: the world of {world_size} ranks leaves none to "
                f"train beside the {inference_ranks} inference ranks ({replicas} "
                f"{'replica' if replicas == 1 else 'replicas'} of "
                "--rl-inference-tensor-model-parallel-size): launch more processes"
            )
            inference_ranks = 0
    run = RunConfig(
        **{**s, "model": model, "lora": lora, "training": training, "parallelism": parallelism},
        world_size=world_size - inference_ranks,
        inference_ranks=inference_ranks,
        started=time.strftime("%Y%m%d-%H%M%S"),
        hf=hf,
        architecture_flags=MappingProxyType(arch),
        explicit=explicit,
    )
    model_parallel = (
        parallelism.tensor_model_parallel_size * parallelism.pipeline_model_parallel_size
    )
    run = replace(run, data_parallel_size=max(1, run.world_size // max(1, model_parallel)))
    errors += _layout_problems(run, cuda) + _batch_problems(run)
    if not _batch_problems(run):
        run = replace(run, iterations_per_collection=_iterations_per_collection(run))
        errors += _interval_problems(run)
    errors += _across_sections(run, cuda)
    if not errors:  # probe the file system only for an otherwise valid command
        errors += _output_path_problems(run)
    return (None if errors else run), errors


def _layout_problems(run: RunConfig, cuda: bool) -> list[str]:
    """The model against the parallel layout and the world size."""
    errors = []
    arch, p = run.architecture_flags, run.parallelism
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if arch["ffn_hidden_size"] < 1:
        errors.append("--ffn-hidden-size must be >= 1")
    if run.model.seq_length > arch["max_position_embeddings"]:
        errors.append(
            f"--seq-length ({run.model.seq_length}) must not exceed {_positions_source(run)}"
        )
    heads = arch["num_attention_heads"]
    if heads >= 1 and arch["hidden_size"] % heads != 0:
        errors.append(
            f"--hidden-size ({arch['hidden_size']}) must be divisible by --num-attention-heads "
            f"({heads})"
        )
    if tp < 1 or pp < 1:
        return errors
    if run.world_size % (tp * pp) != 0:
        errors.append(
            f"world size {run.world_size} must be divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size ({tp} x {pp})"
        )
    if not cuda and pp != 1:
        errors.append(
            f"--pipeline-model-parallel-size {pp} is not supported on CPU: megatron-core's "
            "pipeline schedules are CUDA-only, use 1"
        )
    elif cuda and arch["num_layers"] >= 1 and arch["num_layers"] % pp != 0:
        errors.append(
            f"--num-layers ({arch['num_layers']}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    for flag, value in (
        ("--num-attention-heads", heads),
        ("--ffn-hidden-size", arch["ffn_hidden_size"]),
        ("--make-vocab-size-divisible-by", run.model.make_vocab_size_divisible_by),
    ):
        if value % tp != 0:
            errors.append(
                f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp})"
            )
    if run.inference.max_requests % run.data_parallel_size != 0:
        errors.append(
            f"--inference-max-requests ({run.inference.max_requests}) must be divisible by the "
            f"data-parallel size ({run.data_parallel_size})"
        )
    errors += _expert_problems(run, cuda)
    errors += _routing_problems(run)
    errors += refit_problems(run, cuda)
    if p.use_distributed_optimizer and not cuda:
        errors.append(
            "--use-distributed-optimizer is not supported on CPU: it needs the CUDA tier "
            "(megatron-core's distributed optimizer is CUDA-only)"
        )
    return errors


def _routing_problems(run: RunConfig) -> list[str]:
    """Recorded routes against the model and the layout."""
    flag = next(
        (
            f"--{n.replace('_', '-')}"
            for n in ("use_rollout_routing_replay", "record_rollout_routing")
            if getattr(run.model, n)
        ),
        None,
    )
    if flag is None:
        return []
    if run.architecture_flags["num_experts"] is None:
        return [f"{flag} needs an MoE model (--num-experts or an MoE --hf-checkpoint)"]
    if run.parallelism.pipeline_model_parallel_size > 1:
        return [
            f"{flag} is not supported with --pipeline-model-parallel-size > 1: a token's routing "
            "is compared over all MoE layers, which pipeline stages split"
        ]
    return []


def _expert_problems(run: RunConfig, cuda: bool) -> list[str]:
    """Experts against the layout and the tier."""
    errors = []
    arch, ep = run.architecture_flags, run.parallelism.expert_model_parallel_size
    experts = arch["num_experts"]
    if ep > 1 and experts is None:
        errors.append(f"--expert-model-parallel-size {ep} needs --num-experts")
    elif ep > 1 and experts % ep:
        errors.append(
            f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep})"
        )
    if ep > 1 and run.data_parallel_size % ep:
        errors.append(
            f"--expert-model-parallel-size ({ep}) must divide the data-parallel size "
            f"({run.data_parallel_size}): expert-parallel ranks are data-parallel ranks"
        )
    if experts is not None and not arch["disable_bias_linear"]:
        errors.append(
            "--num-experts needs --disable-bias-linear: experts with linear biases are not "
            "supported (megatron-core's expert MLP adds its bias in place on a view, which fails "
            "in the backward pass; Qwen3-MoE and Mixtral have none)"
        )
    if run.model.moe_grouped_gemm and not cuda:
        errors.append(
            "--moe-grouped-gemm is not supported on CPU: the grouped GEMM is Transformer "
            "Engine's (CUDA); the CPU tier runs one MLP per expert"
        )
    return errors


def _batch_problems(run: RunConfig) -> list[str]:
    """The global batch against a collection and the micro-batches."""
    errors = []
    rollouts, gbs = run.rollouts_per_collection, run.training.global_batch_size
    passes, micro = run.grpo.iterations, run.training.micro_batch_size
    if not 1 <= gbs <= rollouts:
        errors.append(
            f"--global-batch-size ({gbs}) must be in [1, --grpo-prompts-per-step x "
            f"--grpo-group-size ({rollouts})]: a training iteration uses at most one collection"
        )
    elif passes >= 1 and rollouts * passes % gbs != 0:
        errors.append(
            f"--grpo-prompts-per-step x --grpo-group-size x --grpo-iterations ({rollouts} x "
            f"{passes}) must be a multiple of --global-batch-size ({gbs})"
        )
    if micro >= 1 and gbs % (micro * run.data_parallel_size) != 0:
        errors.append(
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size x "
            f"data-parallel size ({micro} x {run.data_parallel_size})"
        )
    return errors


def _iterations_per_collection(run: RunConfig) -> int:
    """--grpo-iterations passes of ``P x G / --global-batch-size`` global batches."""
    passes = max(1, run.grpo.iterations)
    return run.rollouts_per_collection * passes // run.training.global_batch_size


def _interval_problems(run: RunConfig) -> list[str]:
    """Run length, saves and exits fall between collections."""
    k = run.iterations_per_collection
    return [
        f"{flag} ({value}) must be a multiple of the iterations per collection ({k}: "
        "--grpo-iterations x prompts x group size / --global-batch-size); checkpoints and exits "
        "happen between collections"
        for flag, value in (
            ("--train-iters", run.training.train_iters),
            ("--save-interval", run.checkpointing.save_interval),
            ("--exit-interval", run.training.exit_interval),
        )
        if value is not None and value % k != 0
    ]


def _across_sections(run: RunConfig, cuda: bool) -> list[str]:
    """The remaining checks that read more than one section."""
    errors = []
    budget, seq = run.rollouts.default_max_tokens, run.model.seq_length
    if budget >= seq:
        errors.append(
            f"--rl-default-max-tokens ({budget}) must be smaller than --seq-length ({seq}) to "
            "leave room for the prompt"
        )
    if run.grpo.mask_truncated_completions and run.rollouts.ignore_eos:
        errors.append(
            "--mask-truncated-completions with --rl-ignore-eos would mask every rollout (each "
            "one runs to its budget)"
        )
    if run.grpo.ref_load is not None and not Path(run.grpo.ref_load).is_dir():
        errors.append(f"--ref-load: no such directory {run.grpo.ref_load!r}")
    if (problem := run.checkpointing.format_problem(cuda)) is not None:
        errors.append(problem)
    if run.model.save_hf is not None:
        errors += _export_problems(run)
    errors += _lora_problems(run) + distill_problems(run.distillation, run.model, run.grpo)
    errors += streaming_problems(run)
    if cuda and run.training.use_sequence_packing:
        from megatron.rl.models.gpt_spec import transformer_engine_importable

        if transformer_engine_importable():
            errors.append(
                "--rl-use-sequence-packing is not supported with the Transformer Engine layer "
                "spec the CUDA tier uses when transformer_engine imports: its causal attention "
                "ignores the block-diagonal mask of packed rows"
            )
    return errors


def _export_problems(run: RunConfig) -> list[str]:
    """Why ``--save-hf`` cannot write this run's model (nothing when it can)."""
    errors = []
    if run.model.tokenizer_type != "HuggingFaceTokenizer":
        errors.append(
            "--save-hf needs a Hugging Face tokenizer (--tokenizer-model or --hf-checkpoint)"
        )
    if run.parallelism.pipeline_model_parallel_size != 1:
        errors.append("--save-hf supports --pipeline-model-parallel-size 1 only")
    if run.hf is None:
        from megatron.rl.models.hf.config import exportable

        why = exportable(gpt_architecture(run.model, None, vocab_size=1))
        if why is not None:
            errors.append(f"--save-hf: this model has no Hugging Face equivalent: {why}")
    return errors


def _lora_problems(run: RunConfig) -> list[str]:
    """LoRA against the model and the exports."""
    lora = run.lora
    if not lora.enabled:
        return []
    errors = []
    mlp = [t for t in lora.lora_target_modules if t in ("gate_proj", "up_proj", "down_proj")]
    if run.architecture_flags["num_experts"] is not None and mlp:
        errors.append(
            f"--lora-target-modules: the MLP projections ({', '.join(mlp)}) of a "
            "mixture-of-experts model are experts, which take no adapters; give "
            "--lora-target-modules linear_qkv linear_proj (the attention)"
        )
    if lora.save_lora is not None:
        if run.parallelism.pipeline_model_parallel_size != 1:
            errors.append("--save-lora supports --pipeline-model-parallel-size 1 only")
        if run.hf is None:
            from megatron.rl.models.hf.config import exportable

            why = exportable(gpt_architecture(run.model, None, vocab_size=1))
            if why is not None:
                errors.append(
                    f"--save-lora: this model has no Hugging Face equivalent for PEFT to load "
                    f"the adapters onto: {why}"
                )
    return errors


def _output_path_problems(run: RunConfig) -> list[str]:
    values = run.flat()
    return [
        problem
        for flag, kind in OUTPUT_PATHS
        if values[dest_of(flag)] is not None
        and (problem := output_path_problem(flag, values[dest_of(flag)], kind))
    ]


def _positions_source(run: RunConfig) -> str:
    """Where the model's position count comes from, with the value: config.json or the flag."""
    positions = run.architecture_flags["max_position_embeddings"]
    if run.hf is not None:
        return (
            f"max_position_embeddings ({positions}) of --hf-checkpoint's "
            f"{Path(run.model.hf_checkpoint) / 'config.json'}"
        )
    return f"--max-position-embeddings ({positions})"
