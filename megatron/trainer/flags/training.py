"""The parallelism and training options: layout, batch sizes, precision, learning-rate schedule,
AdamW, run length, memory, the watchdog and the seed."""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass, replace

from megatron.trainer.flags.option import COMMANDS, Section, option

DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES = 10
"""``--distributed-timeout-minutes`` unless the watchdog's timeout is longer."""
MAX_MMAP_THRESHOLD_KIB = 32 * 1024
CPU_ALLOCATORS = ("auto", "glibc", "jemalloc", "tcmalloc")
"""``--cpu-allocator``'s choices (``megatron/trainer/runtime/allocator.py`` finds and preloads
the libraries)."""
"""The largest ``M_MMAP_THRESHOLD`` glibc accepts on 64-bit systems (``HEAP_MAX_SIZE / 2``), in
KiB (``--malloc-mmap-threshold-kib``; ``megatron/trainer/runtime/allocator.py`` sets it)."""


@dataclass(frozen=True)
class Parallelism(Section):
    """How the model and the data are split over the ranks."""

    title = "parallelism"

    tensor_model_parallel_size: int = option(1, "TP degree.", minimum=1, common=True)
    pipeline_model_parallel_size: int = option(
        1, "PP degree (must be 1 on CPU).", minimum=1, common=True
    )
    expert_model_parallel_size: int = option(
        1,
        "EP degree: the experts of --num-experts split over this many data-parallel ranks "
        "(tokens all-gathered over TP x EP; on CPU, expert gradients reduced over the DP / EP "
        "ranks holding the same experts).",
        minimum=1,
    )
    use_distributed_optimizer: bool = option(
        False,
        "Shard the optimizer state over the data-parallel ranks (megatron-core's distributed "
        "optimizer; CUDA only).",
        switch=True,
    )
    rl_inference_tensor_model_parallel_size: int | None = option(
        None,
        "Generate on a copy of the model at this TP degree (collocated refit): the ranks form "
        "world size / N inference replicas of N consecutive ranks, each rank keeps its shard of "
        "the copy, and right after every optimizer step the trained weights are resharded into "
        "it (tensor by tensor, over --refit-method). Default: no copy, generation runs on the "
        "trained model itself, on the training layout. Full fine-tuning; the copy is one whole "
        "stage (--rl-inference-pipeline-model-parallel-size 1) and holds every expert of an "
        "MoE model (--rl-inference-expert-model-parallel-size 1).",
        parse=int,
        minimum=1,
        resume=True,
    )
    rl_inference_pipeline_model_parallel_size: int | None = option(
        None,
        "The pipeline-parallel size of the inference copy (with --rl-inference-tensor-model-"
        "parallel-size): 1, the only size implemented and what an unset flag means. Trained with "
        "--pipeline-model-parallel-size > 1 (CUDA), each refit assembles every stage's weights "
        "and broadcasts them over the pipeline group, so every rank generates on a whole copy.",
        parse=int,
        minimum=1,
        resume=True,
    )
    rl_inference_expert_model_parallel_size: int | None = option(
        None,
        "The expert-parallel size of the inference copy of an MoE model (with "
        "--rl-inference-tensor-model-parallel-size): 1, the only size implemented and what an "
        "unset flag means. Each inference replica then holds every expert, split over its TP "
        "ranks like the dense weights, and its MoE layers exchange tokens within the replica "
        "only: no replica waits for another's forwards, whatever the training EP size.",
        parse=int,
        minimum=1,
        resume=True,
    )
    rl_inference_expert_tensor_model_parallel_size: int | None = option(
        None,
        "The TP size of the inference copy's experts: its --rl-inference-tensor-model-parallel-"
        "size (megatron-core's default expert TP), the only size implemented and what an unset "
        "flag means.",
        parse=int,
        minimum=1,
        resume=True,
    )
    refit_mode: str = option(
        "collocated",
        "Where generation runs. collocated: on the training ranks (on the trained model, or on "
        "the copy of --rl-inference-tensor-model-parallel-size, refit after every optimizer "
        "step). non-collocated: the job's last --rl-inference-replicas x "
        "--rl-inference-tensor-model-parallel-size ranks (default TP: "
        "--tensor-model-parallel-size) only generate, while the others train; the window that produces batch c runs while the trainer trains "
        "collection c-1, with the weights of collection c-1's start (one collection more "
        "token staleness than collocated, exact and reproducible). Dense models, full "
        "fine-tuning; weights travel over gloo through host memory.",
        choices=("collocated", "non-collocated"),
        resume=True,
    )
    rl_inference_replicas: int = option(
        1,
        "--refit-mode non-collocated: the inference ranks form this many replicas of "
        "--rl-inference-tensor-model-parallel-size ranks each (the job's last replicas x TP "
        "ranks), which split each generation window's requests (--inference-max-requests is "
        "the slots of all of them) and all receive every refit.",
        parse=int,
        minimum=1,
        resume=True,
    )
    refit_method: str | None = option(
        None,
        "How a refit moves the weights between ranks: gloo (the CPU tier's process groups; "
        "--refit-mode non-collocated on either tier, through host memory) or nccl (a "
        "collocated refit on CUDA). Default: the one the mode and device use. Has no effect "
        "without --rl-inference-tensor-model-parallel-size or --refit-mode non-collocated.",
        parse=str,
        choices=("gloo", "nccl"),
    )
    rl_delta_refit: bool = option(
        False,
        "--refit-mode non-collocated: send only the blocks of 1024 elements whose bits changed "
        "since the previous refit (with a bitmask per tensor) instead of every weight. The "
        "inference ranks patch their copy in place: the same bits as a full refit.",
        switch=True,
    )
    rl_verify_model_weights_swap: bool = option(
        False,
        "After every refit, check the inference copy against the trained weights: each side "
        "sums a position-weighted checksum of its shards over its own TP group, per tensor, and "
        "a difference stops the run naming the tensors (costs a pass over the weights). Has no "
        "effect without --rl-inference-tensor-model-parallel-size.",
        switch=True,
    )
    distributed_timeout_minutes: int | None = option(
        None,
        "Timeout of one collective operation (torch.distributed's; a rank waiting longer fails "
        f"with torch's timeout error). Default: {DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES}, or "
        "--watchdog-timeout-minutes + 1 when that is longer, so that a rank waiting in a "
        "collective is reported by the watchdog, with every rank's stacks.",
        parse=int,
        minimum=1,
    )


@dataclass(frozen=True)
class Training(Section):
    """Batch sizes, precision, the learning-rate schedule, AdamW, run length and memory."""

    title = "training"

    micro_batch_size: int = option(32, "Rollouts per micro-batch.", minimum=1, common=True)
    global_batch_size: int | None = option(
        None,
        "Rollouts per optimizer step (one training iteration). At most --grpo-prompts-per-step x "
        "--grpo-group-size (the default): a smaller one trains each collection in several "
        "iterations, and --grpo-prompts-per-step x --grpo-group-size x --grpo-iterations must be "
        "a multiple of it (as in Megatron-LM).",
        parse=int,
        common=True,
    )
    train_iters: int = option(
        1000,
        "Training iterations (optimizer steps); a multiple of the iterations per collection "
        "(--grpo-iterations x prompts x group size / --global-batch-size).",
        minimum=1,
        common=True,
        spellings=("TRL: max_steps", "NeMo-RL: grpo.max_num_steps"),
    )
    lr: float = option(
        3e-3,
        "Peak learning rate.",
        common=True,
        spellings=("TRL: learning_rate", "NeMo-RL: policy.optimizer.kwargs.lr"),
    )
    min_lr: float | None = option(
        None,
        "Learning rate at the end of decay (default: --lr / 10).",
        parse=float,
        megatron_lm_default=0.0,
    )
    lr_warmup_iters: int = option(
        10,
        "Linear warmup iterations (more than the run lasts is allowed: the LR then only warms "
        "up).",
        minimum=0,
        megatron_lm_default=0,
    )
    lr_decay_iters: int | None = option(
        None,
        "Iterations over which the LR decays to --min-lr (default: --train-iters).",
        parse=int,
        minimum=1,
    )
    lr_decay_style: str = option(
        "cosine",
        "Decay after warmup, down to --min-lr at --lr-decay-iters.",
        choices=("constant", "linear", "cosine"),
        megatron_lm_default="linear",
    )
    weight_decay: float = option(
        0.0,
        "AdamW weight decay (not applied to biases and norms).",
        minimum=0,
        megatron_lm_default=0.01,
    )
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    clip_grad: float = option(1.0, "Clip the global gradient norm to this (0 disables).", minimum=0)
    bf16: bool = option(
        False,
        "Train and generate in bfloat16 with float32 main weights and gradients. CUDA: "
        "megatron-core's mixed precision (bfloat16 parameters, float32 main weights and gradient "
        "reduction). CPU: float32 parameters, gradients and AdamW; the matrix products of "
        "training and of the engine run in bfloat16 under torch.autocast, the engine's KV cache "
        "is bfloat16.",
        switch=True,
        common=True,
        commands=COMMANDS,
    )
    recompute_granularity: str | None = option(
        None,
        "full: keep only each transformer layer's input during a training forward and recompute "
        "the layer in the backward pass (Megatron-LM's --recompute-granularity full with "
        "--recompute-method uniform --recompute-num-layers 1): activation memory of about one "
        "layer instead of all of them, for one more forward pass per micro-batch. Default: keep "
        "every activation.",
        choices=("full",),
        parse=str,
    )
    use_sequence_packing: bool = option(
        False,
        "Pack the rollouts of each micro-batch into rows of --seq-length tokens with "
        "per-sequence attention (block-diagonal causal mask, positions restarting at 0).",
        flag="--rl-use-sequence-packing",
        negatable=True,
    )
    exit_interval: int | None = option(
        None,
        "Exit (status 0) after this many iterations, saving a checkpoint first when --save is "
        "set; a multiple of the iterations per collection.",
        parse=int,
        minimum=1,
    )
    cpu_allocator: str = option(
        "glibc",
        "The C allocator of the run's processes: glibc's malloc (default), or jemalloc or "
        "tcmalloc (the distribution's libjemalloc2 / libtcmalloc-minimal4, preloaded: each "
        "process starts itself again with the library in LD_PRELOAD); auto: jemalloc where "
        "installed, else tcmalloc, else glibc. At the recipe's LoRA shape both raise the peak "
        "above glibc's (benchmarks/results/allocator.md); --malloc-mmap-threshold-kib lowers it.",
        choices=CPU_ALLOCATORS,
    )
    malloc_mmap_threshold_kib: int | None = option(
        None,
        "CPU memory: give every allocation of at least this many KiB its own mapping, returned "
        "to the OS when freed (glibc mallopt M_MMAP_THRESHOLD, set at start-up; ignored by other "
        "C libraries). Peak memory follows what is live instead of what the heap once held "
        "(25M-parameter model: -280 MiB with 1024) but freed blocks are mapped again (+20-30% "
        "step time; docs/user_guide.md 'CPU memory and precision'). Default: glibc's own threshold, which "
        "rises to 32 MiB.",
        parse=int,
    )
    watchdog_timeout_minutes: float = option(
        30.0,
        "Stop the run when it makes no progress for this long (0: never): when start-up (model "
        "build and load, rollout pipeline), a training step, an evaluation or a checkpoint save "
        "has not finished after this many minutes, every rank writes the Python stacks of its "
        "threads (and rank 0 its event loop's tasks) to watchdog-<start time>-rank<R>.txt next "
        "to --metrics-file (else in runs/), nothing is saved, and the run exits with status 1 "
        "and one message naming the files.",
    )
    check_for_nan_in_loss_and_grad: bool = option(
        True,
        "Stop the run with one message, before the optimizer applies the update, when a "
        "micro-batch's loss or the global gradient norm is NaN or infinite, naming the step, the "
        "rank and the micro-batch (CUDA: also megatron-core's check of each rank's gradients "
        "before their data-parallel reduction). On by default, as in Megatron-LM; "
        "--no-check-for-nan-in-loss-and-grad trains on.",
        negatable=True,
    )
    seed: int = option(
        1234, "Seed of init, prompts and sampling.", resume=True, common=True, commands=COMMANDS
    )
    log_interval: int = option(
        1, "Print a log line every N steps.", minimum=1, megatron_lm_default=100
    )

    def problems(self) -> list[str]:
        errors = []
        if self.lr <= 0:
            errors.append(f"--lr must be > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            errors.append(f"--min-lr ({self.min_lr}) must be in [0, --lr]")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            errors.append("--adam-beta1 and --adam-beta2 must be in [0, 1)")
        if self.adam_eps <= 0:
            errors.append("--adam-eps must be > 0")
        watchdog = self.watchdog_timeout_minutes
        if not (math.isfinite(watchdog) and watchdog >= 0):
            errors.append(
                f"--watchdog-timeout-minutes must be >= 0 (0: no watchdog), got {watchdog}"
            )
        if self.malloc_mmap_threshold_kib is not None:
            if self.cpu_allocator not in ("glibc", "auto"):
                errors.append(
                    f"--malloc-mmap-threshold-kib is glibc's: it does nothing with "
                    f"--cpu-allocator {self.cpu_allocator} (give --cpu-allocator glibc)"
                )
            if not 1 <= self.malloc_mmap_threshold_kib <= MAX_MMAP_THRESHOLD_KIB:
                errors.append(
                    f"--malloc-mmap-threshold-kib ({self.malloc_mmap_threshold_kib}) must be "
                    f"between 1 and {MAX_MMAP_THRESHOLD_KIB} (glibc's largest threshold, 32 MiB)"
                )
        return errors


def training_with_defaults(training: Training, rollouts_per_collection: int) -> Training:
    """``training`` with ``--min-lr`` (``--lr`` / 10, in decimal: 3e-3 gives 3e-4, not
    3.0000000000000003e-4) and ``--global-batch-size`` (one collection) filled in."""
    min_lr = training.min_lr
    if min_lr is None:
        min_lr = float(decimal.Decimal(repr(training.lr)) / 10)
    return replace(
        training,
        min_lr=min_lr,
        global_batch_size=training.global_batch_size or rollouts_per_collection,
    )


def parallelism_with_defaults(parallelism: Parallelism, watchdog_minutes: float) -> Parallelism:
    """``--distributed-timeout-minutes`` filled in: long enough that a rank waiting in a
    collective is reported by the watchdog (with every rank's stacks) rather than by torch's
    timeout error."""
    if parallelism.distributed_timeout_minutes is not None or not math.isfinite(watchdog_minutes):
        return parallelism
    minutes = max(DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES, math.floor(watchdog_minutes) + 1)
    return replace(parallelism, distributed_timeout_minutes=minutes)
