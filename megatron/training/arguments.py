"""Command-line flags of ``pretrain_grpo.py`` (Megatron-style names) and their validation.

Each flag is declared once, here, with its help text. ``validate_args`` holds every cross-field
check; each message names the flag(s) at fault. ``parse_args`` exits with status 2 and all the
messages when validation fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag, grouped as in Megatron-LM."""
    p = argparse.ArgumentParser(
        prog="pretrain_grpo.py",
        description="GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=64, help="Model width.")
    g.add_argument("--num-attention-heads", type=int, default=4, help="Attention heads.")
    g.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP width (default 4x hidden)."
    )
    g.add_argument(
        "--seq-length",
        type=int,
        default=32,
        help="Longest prompt + completion, in tokens (also the KV-cache length).",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position table (default: --seq-length).",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding table to a multiple of this; padded ids are never "
        "sampled and get probability 0 in the loss.",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree.")
    g.add_argument(
        "--pipeline-model-parallel-size", type=int, default=1, help="PP degree (must be 1 on CPU)."
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of collective operations.",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=32, help="Rollouts per micro-batch.")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Rollouts per optimizer step; must equal --grpo-prompts-per-step x "
        "--grpo-group-size (the default).",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=3e-4, help="Learning rate at the end of decay.")
    g.add_argument("--lr-warmup-iters", type=int, default=10, help="Linear warmup steps.")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="cosine",
        help="Decay after warmup, down to --min-lr at --train-iters.",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="AdamW weight decay (not applied to biases and norms).",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    g.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip the global gradient norm to this (0 disables).",
    )
    g.add_argument("--train-iters", type=int, default=1000, help="Training steps (batches).")
    g.add_argument("--seed", type=int, default=1234, help="Seed of init, prompts and sampling.")
    g.add_argument("--log-interval", type=int, default=1, help="Print a log line every N steps.")

    g = p.add_argument_group("GRPO")
    g.add_argument("--grpo-prompts-per-step", type=int, default=8, help="Groups per batch.")
    g.add_argument("--grpo-group-size", type=int, default=8, help="Rollouts per prompt (>= 2).")
    g.add_argument(
        "--grpo-clamp-eps-lower",
        type=float,
        default=0.2,
        help="Clip importance ratios below 1 - eps.",
    )
    g.add_argument(
        "--grpo-clamp-eps-upper",
        type=float,
        default=0.28,
        help="Clip importance ratios above 1 + eps.",
    )

    g = p.add_argument_group("RL")
    g.add_argument(
        "--rl-forced-lag",
        type=int,
        default=0,
        help="L: step N+L trains on rollouts submitted at step N (0 = on-policy).",
    )
    g.add_argument(
        "--rl-default-temperature",
        type=float,
        default=1.0,
        help="Sampling temperature (0 = greedy).",
    )
    g.add_argument("--rl-default-top-p", type=float, default=1.0, help="Nucleus mass (1 = off).")
    g.add_argument("--rl-default-top-k", type=int, default=0, help="Top-k (0 = off).")
    g.add_argument(
        "--rl-default-max-tokens",
        type=int,
        default=16,
        help="Generation budget when the environment sets none.",
    )
    g.add_argument(
        "--env-config",
        type=str,
        default=None,
        help="Env-config YAML (list of {agent_type, agent_args, weight}); default: the "
        "built-in digit-copy task.",
    )
    g.add_argument(
        "--rl-inference-server-host",
        type=str,
        default="127.0.0.1",
        help="Interface of the inference server that remote environments (agent_type: remote) "
        "generate through; 0.0.0.0 to reach it from other hosts.",
    )
    g.add_argument(
        "--rl-inference-server-port",
        type=int,
        default=0,
        help="Port of that inference server (0: a free port).",
    )
    g.add_argument(
        "--inference-max-requests",
        type=int,
        default=64,
        help="Concurrent generation requests (KV-cache slots) of the whole job, split "
        "evenly over the data-parallel replicas; keeping it fixed keeps the generation "
        "schedule, and so the results, independent of the parallel layout.",
    )

    g = p.add_argument_group("output")
    g.add_argument("--metrics-file", type=str, default=None, help="Append per-step JSONL here.")
    g.add_argument(
        "--tensorboard-dir",
        type=str,
        default=None,
        help="Write TensorBoard scalars here (needs the tensorboard package).",
    )
    g.add_argument("--save", type=str, default=None, help="Checkpoint directory to write.")
    g.add_argument("--save-interval", type=int, default=None, help="Save every N steps.")
    g.add_argument("--load", type=str, default=None, help="Checkpoint directory to resume from.")
    return p


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> list[str]:
    """Fill derived values on ``args`` and return every problem found, each naming its flags."""
    errors: list[str] = []

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
        "distributed_timeout_minutes",
        "rl_default_max_tokens",
    ):
        check(
            getattr(args, flag) >= 1,
            f"--{flag.replace('_', '-')} must be >= 1, got " f"{getattr(args, flag)}",
        )
    check(args.rl_forced_lag >= 0, f"--rl-forced-lag must be >= 0, got {args.rl_forced_lag}")
    check(
        args.grpo_group_size >= 2,
        f"--grpo-group-size must be >= 2 (GRPO normalizes within a group), got "
        f"{args.grpo_group_size}",
    )

    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    check(args.ffn_hidden_size >= 1, "--ffn-hidden-size must be >= 1")
    check(
        args.seq_length <= args.max_position_embeddings,
        f"--seq-length ({args.seq_length}) must not exceed --max-position-embeddings "
        f"({args.max_position_embeddings})",
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
        why = (
            "is not supported on CPU: megatron-core's pipeline schedules are CUDA-only, use 1"
            if not cuda
            else "is not supported yet by the trainer's inference engine, use 1"
        )
        check(pp == 1, f"--pipeline-model-parallel-size {pp} {why}")
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
        args.global_batch_size == rollouts,
        f"--global-batch-size ({args.global_batch_size}) must equal --grpo-prompts-per-step x "
        f"--grpo-group-size ({rollouts}): each step is one optimizer update on one batch",
    )
    if args.micro_batch_size >= 1:
        check(
            args.global_batch_size % (args.micro_batch_size * dp) == 0,
            f"--global-batch-size ({args.global_batch_size}) must be divisible by "
            f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dp})",
        )

    check(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    check(0 <= args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be in [0, --lr]")
    check(
        0 <= args.lr_warmup_iters < max(args.train_iters, 1),
        f"--lr-warmup-iters ({args.lr_warmup_iters}) must be in [0, --train-iters)",
    )
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
    check(0 < args.rl_default_top_p <= 1, "--rl-default-top-p must be in (0, 1]")
    check(args.rl_default_top_k >= 0, "--rl-default-top-k must be >= 0")
    check(
        args.rl_default_max_tokens < args.seq_length,
        f"--rl-default-max-tokens ({args.rl_default_max_tokens}) must be smaller than "
        f"--seq-length ({args.seq_length}) to leave room for the prompt",
    )
    if args.env_config is not None:
        check(Path(args.env_config).is_file(), f"--env-config: no such file {args.env_config!r}")
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
    return errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; exits with status 2 and every message on bad input."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    errors = validate_args(args, world_size, torch.cuda.is_available())
    if errors:
        parser.exit(2, f"{parser.prog}: error: invalid arguments:\n  " + "\n  ".join(errors) + "\n")
    return args
