"""The parallelism and training flags of ``pretrain_grpo.py``: each declared once, with its help.

Their cross-field checks are in ``flag_validation.validate_args``.
"""

from __future__ import annotations

import argparse
import math

DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES = 10
"""``--distributed-timeout-minutes`` unless the watchdog's timeout is longer."""


def add_parallelism_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the parallelism flags (TP, PP, distributed optimizer, timeouts)."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree.")
    g.add_argument(
        "--pipeline-model-parallel-size", type=int, default=1, help="PP degree (must be 1 on CPU)."
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the optimizer state over the data-parallel ranks (megatron-core's "
        "distributed optimizer; CUDA only).",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=None,
        help="Timeout of one collective operation (torch.distributed's; a rank waiting longer "
        f"fails with torch's timeout error). Default: {DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES}, or "
        "--watchdog-timeout-minutes + 1 when that is longer, so that a rank waiting in a "
        "collective is reported by the watchdog, with every rank's stacks.",
    )


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the training flags: batch sizes, precision, learning-rate schedule, AdamW, run
    length, memory and seed."""
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=32, help="Rollouts per micro-batch.")
    g.add_argument(
        "--bf16",
        action="store_true",
        help="Train and generate in bfloat16 with float32 main weights and gradients. CUDA: "
        "megatron-core's mixed precision (bfloat16 parameters, float32 main weights and "
        "gradient reduction). CPU: float32 parameters, gradients and AdamW; the matrix products "
        "of training and of the engine run in bfloat16 under torch.autocast, the engine's KV "
        "cache is bfloat16.",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full"],
        default=None,
        help="full: keep only each transformer layer's input during a training forward and "
        "recompute the layer in the backward pass (Megatron-LM's --recompute-granularity full "
        "with --recompute-method uniform --recompute-num-layers 1): activation memory of about "
        "one layer instead of all of them, for one more forward pass per micro-batch. Default: "
        "keep every activation.",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Rollouts per optimizer step (one training iteration). At most --grpo-prompts-per-"
        "step x --grpo-group-size (the default): a smaller one trains each collection in "
        "several iterations, and --grpo-prompts-per-step x --grpo-group-size x "
        "--grpo-iterations must be a multiple of it (as in Megatron-LM).",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="Peak learning rate.")
    g.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help="Learning rate at the end of decay (default: --lr / 10).",
    )
    g.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=10,
        help="Linear warmup iterations (more than the run lasts is allowed: the LR then only "
        "warms up).",
    )
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations over which the LR decays to --min-lr (default: --train-iters).",
    )
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="cosine",
        help="Decay after warmup, down to --min-lr at --lr-decay-iters.",
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
    g.add_argument(
        "--train-iters",
        type=int,
        default=1000,
        help="Training iterations (optimizer steps); a multiple of the iterations per "
        "collection (--grpo-iterations x prompts x group size / --global-batch-size).",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Exit (status 0) after this many iterations, saving a checkpoint first when --save "
        "is set; a multiple of the iterations per collection.",
    )
    g.add_argument(
        "--malloc-mmap-threshold-kib",
        type=int,
        default=None,
        help="CPU memory: give every allocation of at least this many KiB its own mapping, "
        "returned to the OS when freed (glibc mallopt M_MMAP_THRESHOLD, set at start-up; "
        "ignored by other C libraries). Peak memory follows what is live instead of what the "
        "heap once held (25M-parameter model: -280 MiB with 1024) but freed blocks are mapped "
        "again (+20-30%% step time; docs/user_guide.md, 'CPU memory and precision'). Default: "
        "glibc's own threshold, which rises to 32 MiB.",
    )
    g.add_argument(
        "--watchdog-timeout-minutes",
        type=float,
        default=30.0,
        help="Stop the run when it makes no progress for this long (0: never): when start-up "
        "(model build and load, rollout pipeline), a training step, an evaluation or a "
        "checkpoint save has not finished after this many minutes, every rank writes the Python "
        "stacks of its threads (and rank 0 its event loop's tasks) to "
        "watchdog-<start time>-rank<R>.txt next to --metrics-file (else in runs/), nothing is "
        "saved, and the run exits with status 1 and one message naming the files.",
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Stop the run with one message, before the optimizer applies the update, when a "
        "micro-batch's loss or the global gradient norm is NaN or infinite, naming the step, the "
        "rank and the micro-batch (CUDA: also megatron-core's check of each rank's gradients "
        "before their data-parallel reduction). On by default, as in Megatron-LM; "
        "--no-check-for-nan-in-loss-and-grad trains on.",
    )
    g.add_argument("--seed", type=int, default=1234, help="Seed of init, prompts and sampling.")
    g.add_argument("--log-interval", type=int, default=1, help="Print a log line every N steps.")


def validate_timeouts(args: argparse.Namespace) -> list[str]:
    """The watchdog's timeout, and the collective timeout it implies when not given: long enough
    that a rank waiting in a collective is reported by the watchdog (with every rank's stacks)
    rather than by torch's timeout error."""
    watchdog = args.watchdog_timeout_minutes
    if not (math.isfinite(watchdog) and watchdog >= 0):
        return [f"--watchdog-timeout-minutes must be >= 0 (0: no watchdog), got {watchdog}"]
    if args.distributed_timeout_minutes is None:
        args.distributed_timeout_minutes = max(
            DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES, math.floor(watchdog) + 1
        )
    elif args.distributed_timeout_minutes < 1:
        return [
            f"--distributed-timeout-minutes must be >= 1, got {args.distributed_timeout_minutes}"
        ]
    return []
