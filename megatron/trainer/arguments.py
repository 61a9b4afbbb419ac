"""Command-line flags of ``pretrain_grpo.py`` (Megatron-style names) and their validation.

Each flag is declared once, here, with its help text. ``validate_args`` holds every cross-field
check; each message names the flag(s) at fault. ``parse_args`` exits with status 2 and all the
messages when validation fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import os
import tempfile
import time
from pathlib import Path

from megatron.rl.auth import read_api_key
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.terms import loss_terms
from megatron.rl.models.gpt_spec import transformer_engine_importable
from megatron.trainer.allocator import MAX_MMAP_THRESHOLD_KIB
from megatron.trainer.exits import UsageError
from megatron.trainer.megatron_lm_flags import add_refused_flags, aliases_of
from megatron.trainer.model_flags import add_model_arguments, validate_model_args


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, so the default is written once (at the flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag, grouped as in Megatron-LM."""
    p = argparse.ArgumentParser(
        prog="pretrain_grpo.py",
        description="GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts.",
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)

    g = p.add_argument_group("parallelism")
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
        default=10,
        help="Timeout of collective operations.",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=32, help="Rollouts per micro-batch.")
    g.add_argument(
        "--bf16",
        action="store_true",
        help="Train and generate in bfloat16 with float32 main weights and gradient reduction "
        "(CUDA only; the CPU tier trains in float32).",
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
    g.add_argument("--min-lr", type=float, default=3e-4, help="Learning rate at the end of decay.")
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
        "again (+20-30%% step time; README 'CPU memory'). Default: glibc's own threshold, which "
        "rises to 32 MiB.",
    )
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
    for term in loss_terms():  # one flag per loss term, declared by the term (its weight)
        g.add_argument(term.flag, type=float, default=0.0, help=term.help)
    g.add_argument(
        "--ref-load",
        type=str,
        default=None,
        help="Checkpoint directory (as written by --save) whose model weights are the reference "
        "policy of --grpo-kl-beta; read again on every start, also when resuming.",
    )
    g.add_argument(
        "--grpo-iterations",
        type=int,
        default=1,
        help="Passes over each collection (Megatron-LM's meaning; its default is 2): every "
        "global batch of every pass is a training iteration (an optimizer step; the LR "
        "schedule and the policy version advance), and ratios are taken against the policy "
        "that collected, pi_old, computed before the collection's first update.",
    )
    g.add_argument(
        "--grpo-filter-groups-with-same-reward",
        action="store_true",
        help="Dynamic sampling: train only on groups whose rewards differ. Each batch is "
        "generated as --grpo-max-generation-rounds rounds of --grpo-prompts-per-step groups, "
        "all submitted together (keeping staleness exactly --rl-forced-lag); the first "
        "--grpo-prompts-per-step groups with differing rewards are trained. When fewer "
        "qualify, the batch trains on those (the others masked out of the token-mean loss) and "
        "logs how many were dropped.",
    )
    g.add_argument(
        "--grpo-max-generation-rounds",
        type=int,
        default=1,
        help="Rounds of --grpo-prompts-per-step groups generated per batch for "
        "--grpo-filter-groups-with-same-reward (Megatron-LM regenerates dropped groups without "
        "a bound): all submitted with the batch when --rl-forced-lag > 0; at lag 0 one more "
        "round only while the batch lacks groups whose rewards differ.",
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
    g.add_argument(
        "--rl-default-top-p", type=float, default=0.0, help="Nucleus mass (0 or 1 = off)."
    )
    g.add_argument("--rl-default-top-k", type=int, default=-1, help="Top-k (-1 or 0 = off).")
    g.add_argument(
        "--rl-default-max-tokens",
        type=int,
        default=16,
        help="Generation budget when the environment sets none.",
    )
    g.add_argument(
        "--env-config",
        *aliases_of("--env-config"),
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
        "--rl-api-key-file",
        type=str,
        default=None,
        help="File holding the job's shared key: the inference server requires it as a bearer "
        "token (401 without) and remote environments send it to env servers. Default: the "
        "environment variable MEGATRON_RL_API_KEY; neither: no key (keep servers on loopback).",
    )
    g.add_argument(
        "--inference-max-requests",
        type=int,
        default=64,
        help="Concurrent generation requests (KV-cache slots) of the whole job, split "
        "evenly over the data-parallel replicas; keeping it fixed keeps the generation "
        "schedule, and so the results, independent of the parallel layout.",
    )
    g.add_argument(
        "--rl-deterministic-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Step the requests of later batches only while the batch the trainer waits for "
        "still generates, so which policy version generates each token, and the whole run, is "
        "reproducible. --no-rl-deterministic-schedule keeps every batch in flight generating "
        "for the whole window, also while the awaited batch's rewards are computed or a new "
        "batch's requests are being sent: faster "
        "with slow rewards, but tokens then depend on timing (submission staleness stays "
        "exact).",
    )
    g.add_argument(
        "--rl-reward-wait-steps",
        type=int,
        default=0,
        help="With --rl-deterministic-schedule: once the batch the trainer waits for has "
        "finished generating, the engine steps the later batches in flight for this many more "
        "engine steps (fewer if they have nothing left to generate), and the trainer takes the "
        "batch only after them, whatever the rewards' timing. Fills the wait for slow rewards "
        "with generation and keeps the run reproducible; tokens of later batches then come from "
        "earlier policy versions. 0: later batches step only while the awaited batch generates.",
    )
    g.add_argument(
        "--rl-inference-logprobs-is-correction",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Take the ratio against the trainer's pre-update policy and weight each token by "
        "the truncated importance weight min(pi_old / pi_inference, C) with the engine's "
        "per-token logprobs; logs the train/inference mismatch (is_* metrics).",
    )
    g.add_argument(
        "--rl-importance-sampling-truncation-coef",
        type=optional_float,
        default=ImportanceConfig.truncation_coef,
        help="C of --rl-inference-logprobs-is-correction: importance weights above C are set to "
        "C; 'none' caps nothing (Megatron-LM's default). Our default 1 only ever down-weights a "
        "token (see megatron/rl/grpo/importance.py).",
    )
    g.add_argument(
        "--rl-seq-logprob-error-threshold",
        type=optional_float,
        default=None,
        help="Mask out of the loss every sequence whose logprob error exceeds this (NeMo-RL's "
        "grpo.seq_logprob_error_threshold, e.g. 1.5): the mean over its generated tokens of "
        "exp(|log pi_old - log pi_inference|), with pi_old the policy before the collection's "
        "first update (one more forward pass when the step has no pi_old). The token-mean loss "
        "is normalised over the remaining tokens. Logs the error's min/mean/max before and "
        "after the mask, the masked sequences and the share of them that were rewarded "
        "(seq_mult_prob_error_*, seq_logprob_error_*). Default: no mask.",
    )
    g.add_argument(
        "--rl-log-seq-logprob-error",
        action="store_true",
        help="Log the sequence-level logprob error (seq_mult_prob_error_min/mean/max, see "
        "--rl-seq-logprob-error-threshold) without masking anything.",
    )
    g.add_argument(
        "--rl-max-failed-rollout-fraction",
        type=float,
        default=0.5,
        help="Stop the run, naming the environment and its first error, once more than this "
        "share of an environment's rollouts failed (environment errors become masked "
        "placeholder rollouts, in process and behind the env server alike; each distinct error "
        "is logged once). Judged once the environment produced --grpo-prompts-per-step x "
        "--grpo-group-size rollouts; 1 never stops (a batch whose every rollout failed always "
        "does).",
    )
    g.add_argument(
        "--rl-use-sequence-packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Pack the rollouts of each micro-batch into rows of --seq-length tokens with "
        "per-sequence attention (block-diagonal causal mask, positions restarting at 0).",
    )
    g.add_argument(
        "--rl-data-plane",
        choices=("in-process", "transferqueue"),
        default="in-process",
        help="Where each collection's rollouts live: rank 0 writes each sample once under its "
        "own key and every data-parallel rank fetches only the keys of its shard (logprobs and "
        "reference logprobs are written back as fields; the partition is cleared when the "
        "collection ends). 'in-process': rank 0 holds the store and serves it point to point; "
        "'transferqueue': the TransferQueue package on Ray (pip install '.[transferqueue]'; "
        "rank 0 starts a local Ray, the other ranks attach to it).",
    )

    g = p.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate every N steps (after the update) on a held-out prompt set: greedy "
        "reward and pass@k, logged as eval/* (default: never).",
    )
    g.add_argument(
        "--eval-prompts",
        *aliases_of("--eval-prompts"),
        type=int,
        default=32,
        help="Held-out prompts per environment.",
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=0,
        help="> 0 turns evaluation on (as in Megatron-LM, whose default is 100): every "
        "--eval-interval iterations if set, and once after the last iteration; 0 = off unless "
        "--eval-interval is given.",
    )
    g.add_argument(
        "--eval-samples",
        type=int,
        default=8,
        help="n: sampled completions per held-out prompt for pass@k (at the training sampling "
        "parameters).",
    )
    g.add_argument(
        "--eval-pass-k",
        type=int,
        nargs="+",
        default=[1],
        help="The k of the unbiased pass@k estimator to log (each <= --eval-samples).",
    )
    g.add_argument(
        "--eval-correct-threshold",
        type=float,
        default=1.0,
        help="A sampled completion counts as correct for pass@k when its reward is >= this.",
    )
    g.add_argument(
        "--val-split-fraction",
        type=float,
        default=0.0,
        help="Hold this share of each file-backed environment's problems (GSM8K, math JSONL) "
        "out of training as its validation partition: evaluation takes each held-out problem "
        "once (at most --eval-prompts), training never draws one. The split is fixed by the "
        "data set's size, not by --seed. 0 = off (the held-out set is drawn).",
    )
    g.add_argument(
        "--val-at-start",
        action="store_true",
        help="Evaluate before the first training step (logged as eval_at_start/* on the first "
        "step's record).",
    )
    g.add_argument(
        "--val-at-end",
        action="store_true",
        help="Evaluate after the last iteration (as --eval-iters > 0 does), whatever "
        "--eval-interval says.",
    )
    g.add_argument(
        "--val-dump-dir",
        type=str,
        default=None,
        help="Write each evaluation's rollouts (prompt, response, reward, length, truncated) to "
        "<dir>/eval-v<policy version>.jsonl, one line per rollout of both passes.",
    )

    g = p.add_argument_group("output")
    g.add_argument("--metrics-file", type=str, default=None, help="Append per-step JSONL here.")
    g.add_argument(
        "--plot-file",
        type=str,
        default=None,
        help="PNG of the reward and loss curves written at the end (default: the metrics file "
        "with .png, else runs/curves-<start time>.png; 'none': no plot).",
    )
    g.add_argument(
        "--tensorboard-dir",
        type=str,
        default=None,
        help="Write TensorBoard scalars here (needs the tensorboard package).",
    )
    g.add_argument("--save", type=str, default=None, help="Checkpoint directory to write.")
    g.add_argument("--save-interval", type=int, default=None, help="Save every N steps.")
    g.add_argument("--load", type=str, default=None, help="Checkpoint directory to resume from.")
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="With --load: do not restore the optimizer state (fresh AdamW moments).",
    )
    g.add_argument(
        "--no-load-rng",
        action="store_true",
        help="With --load: do not restore the RNG states.",
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="With --load: load the model weights only and start a new run at iteration 0 "
        "(no optimizer, LR schedule, RNG or rollout state; the resume-flag check is skipped).",
    )
    g.add_argument(
        "--wandb-project",
        type=str,
        default=None,
        help="Log every metric to Weights & Biases under this project (pip install wandb; "
        "WANDB_MODE=offline writes locally).",
    )
    g.add_argument("--wandb-exp-name", type=str, default=None, help="The wandb run name.")
    g.add_argument(
        "--wandb-save-dir",
        type=str,
        default=None,
        help="Local wandb directory (default: <--save>/wandb, else ./wandb).",
    )
    g.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="Load iteration N of --load instead of the one its tracker file names (e.g. the "
        "older complete checkpoint an unreadable one's error names).",
    )
    g.add_argument(
        "--debug-tracebacks",
        action="store_true",
        help="Print the traceback of expected errors too (bad input, unreadable checkpoint, "
        "environment failures); also on with the environment variable GRPO_DEBUG_TRACEBACKS=1.",
    )
    add_refused_flags(p)
    return p


def optional_float(text: str) -> float | None:
    """A float, or ``none`` for no value."""
    return None if text.lower() == "none" else float(text)


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
        "distributed_timeout_minutes",
        "rl_default_max_tokens",
    ):
        check(
            getattr(args, flag) >= 1,
            f"--{flag.replace('_', '-')} must be >= 1, got " f"{getattr(args, flag)}",
        )
    check(args.rl_forced_lag >= 0, f"--rl-forced-lag must be >= 0, got {args.rl_forced_lag}")
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

    tier_flags = (
        ("--bf16", args.bf16),
        ("--use-distributed-optimizer", args.use_distributed_optimizer),
    )
    for flag in (f for f, on in tier_flags if on and not cuda):
        errors.append(
            f"{flag} is not supported on CPU: it needs the CUDA tier (megatron-core's "
            "mixed-precision and distributed optimizers are CUDA-only)"
        )

    check(args.lr > 0, f"--lr must be > 0, got {args.lr}")
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
    if not errors:  # probe the file system only for an otherwise valid command
        errors += [
            problem
            for flag, kind in OUTPUT_PATHS
            if getattr(args, _dest(flag)) is not None
            and (problem := output_path_problem(flag, getattr(args, _dest(flag)), kind))
        ]
    return errors


def evaluation_requested(args: argparse.Namespace) -> bool:
    """Whether the run evaluates (``--eval-interval``, ``--eval-iters`` > 0, ``--val-at-start``
    or ``--val-at-end``)."""
    return (
        args.eval_interval is not None
        or args.eval_iters > 0
        or args.val_at_start
        or args.val_at_end
    )


OUTPUT_PATHS = (
    ("--save", "dir"),
    ("--tensorboard-dir", "dir"),
    ("--metrics-file", "file"),
    ("--val-dump-dir", "dir"),
)
"""Every path the run writes, checked at start-up (before anything is built)."""


def output_path_problem(flag: str, path: str, kind: str) -> str | None:
    """Why the run could not write ``path`` (a ``kind`` of ``"dir"`` or ``"file"``), or None.

    Probes without leaving anything behind: an existing file is opened for appending, an existing
    or nearest existing parent directory gets a temporary file created and removed in it.
    """
    target = Path(path)
    try:
        if target.exists():
            if kind == "file":
                if target.is_dir():
                    return f"{flag} {path}: is a directory, not a file"
                with open(target, "a", encoding="utf-8"):
                    return None
            if not target.is_dir():
                return f"{flag} {path}: exists and is not a directory"
            probe_dir = target
        else:
            parent = target.parent if kind == "file" else target
            probe_dir = next(p for p in (parent, *parent.parents) if p.exists())
            if not probe_dir.is_dir():
                return f"{flag} {path}: {probe_dir} is not a directory"
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{flag} {path}: cannot write there: {exc.strerror or exc}"
    return None


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


def iterations_per_collection(args: argparse.Namespace) -> int:
    """Training iterations each collection is trained for: --grpo-iterations passes of
    ``P x G / --global-batch-size`` global batches."""
    rollouts = args.grpo_prompts_per_step * args.grpo_group_size
    return rollouts * args.grpo_iterations // args.global_batch_size


def _dest(flag: str) -> str:
    """The attribute of ``--some-flag`` on the parsed namespace: ``some_flag``."""
    return flag.lstrip("-").replace("-", "_")


def parse_explicit(
    parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[argparse.Namespace, frozenset[str]]:
    """``parser.parse_args(argv)`` and the attributes the command line set explicitly."""
    unset = object()
    dests = {a.dest for a in parser._actions if argparse.SUPPRESS not in (a.dest, a.default)}
    args = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    explicit = frozenset(d for d in dests if getattr(args, d) is not unset)
    for action in parser._actions:
        if action.dest in dests and getattr(args, action.dest) is unset:
            setattr(args, action.dest, action.default)
    return args, explicit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; raises ``UsageError`` (status 2, printed once by
    ``megatron.trainer.exits``) with every message on bad input."""
    import torch

    parser = build_parser()
    captured = io.StringIO()  # every rank parses; exits.run_main prints on global rank 0
    try:
        with contextlib.redirect_stderr(captured):
            args, explicit = parse_explicit(parser, argv)
    except SystemExit as exc:
        if exc.code in (None, 0):  # --help
            raise
        raise UsageError(captured.getvalue().rstrip()) from None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    errors = validate_args(args, world_size, torch.cuda.is_available(), explicit)
    if errors:
        raise UsageError(f"{parser.prog}: error: invalid arguments:\n  " + "\n  ".join(errors))
    return args
