"""The one cross-field validation of ``pretrain_grpo.py``'s flags.

``validate_args`` fills the derived values on the parsed namespace and returns every problem
found, each message naming the flag(s) at fault; the flags themselves are declared in the
``*_flags`` modules (``arguments.build_parser`` puts them together). ``validate_env_config``
checks the flags against the entries of the loaded ``--env-config`` (naming the file, the entry
and the flag), once the environments are built.
"""

from __future__ import annotations

import argparse
import decimal
import importlib.util
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.rl.auth import read_api_key
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.terms import loss_terms
from megatron.rl.models.gpt_spec import transformer_engine_importable
from megatron.trainer.allocator import MAX_MMAP_THRESHOLD_KIB
from megatron.trainer.eval_flags import evaluation_requested
from megatron.trainer.model_flags import validate_model_args
from megatron.trainer.output_flags import OUTPUT_PATHS, ckpt_format_problem, output_path_problem
from megatron.trainer.training_flags import validate_timeouts

if TYPE_CHECKING:
    from megatron.rl.agent.mixture import MixtureAgent


def validate_args(
    args: argparse.Namespace, world_size: int, cuda: bool, explicit: frozenset[str] = frozenset()
) -> list[str]:
    """Fill derived values on ``args`` and return every problem found, each naming its flags.

    ``explicit``: the flags (attribute names) given on the command line, for the conflicts of
    ``--hf-checkpoint`` with architecture flags.
    """
    errors: list[str] = []
    args.run_started = time.strftime("%Y%m%d-%H%M%S")

    def check(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    for flag in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "micro_batch_size",
        "train_iters",
        "log_interval",
        "grpo_prompts_per_step",
        "inference_max_requests",
        "make_vocab_size_divisible_by",
        "rl_default_max_tokens",
    ):
        check(
            getattr(args, flag) >= 1,
            f"--{flag.replace('_', '-')} must be >= 1, got " f"{getattr(args, flag)}",
        )
    check(args.rl_forced_lag >= 0, f"--rl-forced-lag must be >= 0, got {args.rl_forced_lag}")
    errors += validate_timeouts(args)
    check(
        args.rl_reward_wait_steps >= 0,
        f"--rl-reward-wait-steps must be >= 0, got {args.rl_reward_wait_steps}",
    )
    check(
        args.rl_reward_wait_steps == 0 or args.rl_deterministic_schedule,
        "--rl-reward-wait-steps is a budget of the deterministic schedule: it has no effect with "
        "--no-rl-deterministic-schedule (every batch in flight already steps the whole window)",
    )
    check(
        args.grpo_group_size >= 2,
        f"--grpo-group-size must be >= 2 (GRPO normalizes within a group), got "
        f"{args.grpo_group_size}",
    )

    if args.make_vocab_size_divisible_by >= 1:
        errors += validate_model_args(args, explicit)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    check(args.ffn_hidden_size >= 1, "--ffn-hidden-size must be >= 1")
    check(
        args.seq_length <= args.max_position_embeddings,
        f"--seq-length ({args.seq_length}) must not exceed {_positions_source(args)}",
    )
    if args.num_attention_heads >= 1:
        check(
            args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
            f"({args.num_attention_heads})",
        )

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp >= 1 and pp >= 1:
        check(
            world_size % (tp * pp) == 0,
            f"world size {world_size} must be divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size ({tp} x {pp})",
        )
        if not cuda:
            why = "is not supported on CPU: megatron-core's pipeline schedules are CUDA-only, use 1"
            check(pp == 1, f"--pipeline-model-parallel-size {pp} {why}")
        elif args.num_layers >= 1:
            check(
                args.num_layers % pp == 0,
                f"--num-layers ({args.num_layers}) must be divisible by "
                f"--pipeline-model-parallel-size ({pp})",
            )
        check(
            args.num_attention_heads % tp == 0,
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        check(
            args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        check(
            args.make_vocab_size_divisible_by % tp == 0,
            f"--make-vocab-size-divisible-by ({args.make_vocab_size_divisible_by}) must be "
            f"divisible by --tensor-model-parallel-size ({tp})",
        )
    dp = max(1, world_size // max(1, tp * pp))
    args.world_size, args.data_parallel_size = world_size, dp

    check(
        args.inference_max_requests % dp == 0,
        f"--inference-max-requests ({args.inference_max_requests}) must be divisible by the "
        f"data-parallel size ({dp})",
    )
    rollouts = args.grpo_prompts_per_step * args.grpo_group_size
    if args.global_batch_size is None:
        args.global_batch_size = rollouts
    check(
        1 <= args.global_batch_size <= rollouts,
        f"--global-batch-size ({args.global_batch_size}) must be in [1, --grpo-prompts-per-step "
        f"x --grpo-group-size ({rollouts})]: a training iteration uses at most one collection",
    )
    if 1 <= args.global_batch_size <= rollouts and args.grpo_iterations >= 1:
        check(
            rollouts * args.grpo_iterations % args.global_batch_size == 0,
            f"--grpo-prompts-per-step x --grpo-group-size x --grpo-iterations "
            f"({rollouts} x {args.grpo_iterations}) must be a multiple of --global-batch-size "
            f"({args.global_batch_size})",
        )
        per_collection = iterations_per_collection(args)
        args.iterations_per_collection = per_collection
        for flag in ("train_iters", "save_interval", "exit_interval"):
            value = getattr(args, flag)
            check(
                value is None or value % per_collection == 0,
                f"--{flag.replace('_', '-')} ({value}) must be a multiple of the iterations per "
                f"collection ({per_collection}: --grpo-iterations x prompts x group size / "
                "--global-batch-size); checkpoints and exits happen between collections",
            )
    if args.micro_batch_size >= 1:
        check(
            args.global_batch_size % (args.micro_batch_size * dp) == 0,
            f"--global-batch-size ({args.global_batch_size}) must be divisible by "
            f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dp})",
        )

    if args.use_distributed_optimizer and not cuda:
        errors.append(
            "--use-distributed-optimizer is not supported on CPU: it needs the CUDA tier "
            "(megatron-core's distributed optimizer is CUDA-only)"
        )

    check(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    if args.min_lr is None:  # --lr / 10 in decimal: 3e-3 gives 3e-4, not 3.0000000000000003e-4
        args.min_lr = float(decimal.Decimal(repr(args.lr)) / 10)
    check(0 <= args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be in [0, --lr]")
    check(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_decay_iters is not None:
        check(args.lr_decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.exit_interval is not None:
        check(args.exit_interval >= 1, f"--exit-interval must be >= 1, got {args.exit_interval}")
    check(args.weight_decay >= 0, "--weight-decay must be >= 0")
    check(args.clip_grad >= 0, "--clip-grad must be >= 0")
    check(
        0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1,
        "--adam-beta1 and --adam-beta2 must be in [0, 1)",
    )
    check(args.adam_eps > 0, "--adam-eps must be > 0")
    check(
        0 < args.grpo_clamp_eps_lower < 1,
        f"--grpo-clamp-eps-lower must be in (0, 1), got {args.grpo_clamp_eps_lower}",
    )
    check(
        args.grpo_clamp_eps_upper > 0,
        f"--grpo-clamp-eps-upper must be > 0, got {args.grpo_clamp_eps_upper}",
    )
    check(
        0 <= args.rl_inference_server_port < 65536,
        "--rl-inference-server-port must be in [0, 65535]",
    )
    check(args.rl_default_temperature >= 0, "--rl-default-temperature must be >= 0")
    check(0 <= args.rl_default_top_p <= 1, "--rl-default-top-p must be in [0, 1] (0 = off)")
    check(args.rl_default_top_k >= -1, "--rl-default-top-k must be >= -1 (-1 or 0 = off)")
    check(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    for flag in ("no_load_optim", "no_load_rng", "finetune"):
        if getattr(args, flag):
            check(args.load is not None, f"--{flag.replace('_', '-')} needs --load")
    check(
        args.rl_default_max_tokens < args.seq_length,
        f"--rl-default-max-tokens ({args.rl_default_max_tokens}) must be smaller than "
        f"--seq-length ({args.seq_length}) to leave room for the prompt",
    )
    if args.malloc_mmap_threshold_kib is not None:
        check(
            1 <= args.malloc_mmap_threshold_kib <= MAX_MMAP_THRESHOLD_KIB,
            f"--malloc-mmap-threshold-kib ({args.malloc_mmap_threshold_kib}) must be between 1 "
            f"and {MAX_MMAP_THRESHOLD_KIB} (glibc's largest threshold, 32 MiB)",
        )
    if args.env_config is not None:
        check(Path(args.env_config).is_file(), f"--env-config: no such file {args.env_config!r}")
    if args.wandb_project is not None:
        check(
            importlib.util.find_spec("wandb") is not None,
            "--wandb-project needs the wandb package: pip install wandb",
        )
        check(args.wandb_exp_name != "", "--wandb-exp-name must not be empty")
    if args.rl_api_key_file is not None:
        try:
            read_api_key(args.rl_api_key_file, {}, "--rl-api-key-file")
        except ValueError as err:
            errors.append(str(err))
    if args.tensorboard_dir is not None:
        check(
            importlib.util.find_spec("tensorboard") is not None,
            "--tensorboard-dir needs the tensorboard package: pip install tensorboard",
        )
    if args.save_interval is not None:
        check(args.save_interval >= 1, "--save-interval must be >= 1")
        check(args.save is not None, "--save-interval needs --save")
    if args.load is not None:
        check(Path(args.load).is_dir(), f"--load: no such directory {args.load!r}")
    if args.ckpt_step is not None:
        check(args.load is not None, "--ckpt-step needs --load")
        check(args.ckpt_step >= 1, f"--ckpt-step must be >= 1, got {args.ckpt_step}")
    check(
        0 <= args.rl_max_failed_rollout_fraction <= 1,
        f"--rl-max-failed-rollout-fraction must be in [0, 1], got "
        f"{args.rl_max_failed_rollout_fraction}",
    )
    errors += validate_algorithm_args(args, cuda)
    errors += [problem] if (problem := ckpt_format_problem(args, cuda)) else []
    if not errors:  # probe the file system only for an otherwise valid command
        errors += [
            problem
            for flag, kind in OUTPUT_PATHS
            if getattr(args, _dest(flag)) is not None
            and (problem := output_path_problem(flag, getattr(args, _dest(flag)), kind))
        ]
    return errors


def validate_algorithm_args(args: argparse.Namespace, cuda: bool) -> list[str]:
    """Checks of the optional GRPO terms, dynamic sampling, packing and evaluation flags.

    Dynamic sampling never refills a batch later or from a later batch (either would break the
    exact forced lag, and borrowing could deadlock the submission gate); it over-submits rounds
    instead (``megatron/rl/grpo/filtering.py``), so the only combinations to refuse here are
    rounds without the filter and values out of range.
    """
    errors: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    for term in loss_terms():
        weight = getattr(args, _dest(term.flag))
        try:
            term(weight)
        except ValueError as err:
            errors.append(f"{term.flag} {err}")
    if args.ref_load is not None:
        users = [t.flag for t in loss_terms() if "ref_logprobs" in t.requires]
        check(
            any(getattr(args, _dest(f)) != 0 for f in users),
            f"--ref-load needs {' or '.join(f + ' > 0' for f in users)} (only loss terms that "
            "use the reference policy read it)",
        )
        check(Path(args.ref_load).is_dir(), f"--ref-load: no such directory {args.ref_load!r}")
    check(args.grpo_iterations >= 1, f"--grpo-iterations must be >= 1, got {args.grpo_iterations}")
    check(
        args.grpo_max_generation_rounds >= 1,
        f"--grpo-max-generation-rounds must be >= 1, got {args.grpo_max_generation_rounds}",
    )
    check(
        args.grpo_max_generation_rounds == 1 or args.grpo_filter_groups_with_same_reward,
        "--grpo-max-generation-rounds > 1 needs --grpo-filter-groups-with-same-reward (extra "
        "rounds are only generated to replace groups that filter drops)",
    )
    coef = args.rl_importance_sampling_truncation_coef
    check(
        coef == ImportanceConfig.truncation_coef or args.rl_inference_logprobs_is_correction,
        "--rl-importance-sampling-truncation-coef needs --rl-inference-logprobs-is-correction",
    )
    check(
        coef is None or (math.isfinite(coef) and coef > 0),
        f"--rl-importance-sampling-truncation-coef must be > 0 or none, got {coef}",
    )
    threshold = args.rl_seq_logprob_error_threshold
    check(
        threshold is None or (math.isfinite(threshold) and threshold >= 1),
        f"--rl-seq-logprob-error-threshold must be >= 1 (a sequence's error is >= 1, exactly 1 "
        f"where the trainer's and the engine's logprobs agree) or none, got {threshold}",
    )
    if args.eval_interval is not None:
        check(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")
    check(args.eval_prompts >= 1, f"--eval-prompts must be >= 1, got {args.eval_prompts}")
    check(args.eval_samples >= 1, f"--eval-samples must be >= 1, got {args.eval_samples}")
    bad_k = [k for k in args.eval_pass_k if not 1 <= k <= args.eval_samples]
    check(
        not bad_k,
        f"--eval-pass-k values must be in [1, --eval-samples ({args.eval_samples})], got {bad_k}",
    )
    evaluating = evaluation_requested(args)
    check(
        0.0 <= args.val_split_fraction < 1.0,
        f"--val-split-fraction must be in [0, 1), got {args.val_split_fraction}",
    )
    check(
        args.val_split_fraction == 0.0 or evaluating,
        "--val-split-fraction holds problems out for evaluation: give --eval-interval, "
        "--eval-iters, --val-at-start or --val-at-end",
    )
    check(
        args.val_dump_dir is None or evaluating,
        "--val-dump-dir needs evaluation: give --eval-interval, --eval-iters, --val-at-start or "
        "--val-at-end",
    )
    if cuda and args.rl_use_sequence_packing and transformer_engine_importable():
        errors.append(
            "--rl-use-sequence-packing is not supported with the Transformer Engine layer spec "
            "the CUDA tier uses when transformer_engine imports: its causal attention ignores "
            "the block-diagonal mask of packed rows"
        )
    return errors


def validate_env_config(args: argparse.Namespace, agent: MixtureAgent) -> list[str]:
    """The flags against the env config's entries, each problem naming the file, the entry and
    the flag: an entry's own generation budget (``agent_args.max_tokens``, where its agent
    declares one) must leave room in ``--seq-length`` for a prompt of at least one token, as
    ``--rl-default-max-tokens`` must."""
    errors = []
    for entry in agent.evaluated:
        budget = getattr(entry.args, "max_tokens", None)
        if budget is not None and budget >= args.seq_length:
            errors.append(
                f"--env-config {args.env_config}, entry {entry.env_id!r}: agent_args.max_tokens "
                f"({budget}) must be smaller than --seq-length ({args.seq_length}) to leave room "
                "for the prompt"
            )
    return errors


def iterations_per_collection(args: argparse.Namespace) -> int:
    """Training iterations each collection is trained for: --grpo-iterations passes of
    ``P x G / --global-batch-size`` global batches."""
    rollouts = args.grpo_prompts_per_step * args.grpo_group_size
    return rollouts * args.grpo_iterations // args.global_batch_size


def _positions_source(args: argparse.Namespace) -> str:
    """Where the model's position count comes from, with the value: config.json or the flag."""
    if getattr(args, "hf_config", None) is not None:
        return (
            f"max_position_embeddings ({args.max_position_embeddings}) of --hf-checkpoint's "
            f"{Path(args.hf_checkpoint) / 'config.json'}"
        )
    return f"--max-position-embeddings ({args.max_position_embeddings})"


def _dest(flag: str) -> str:
    """The attribute of ``--some-flag`` on the parsed namespace: ``some_flag``."""
    return flag.lstrip("-").replace("-", "_")
