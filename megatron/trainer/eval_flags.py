"""The evaluation flags of ``pretrain_grpo.py`` (each declared once, with its help) and whether
they turn evaluation on.

Their cross-field checks are in ``flag_validation.validate_args``.
"""

from __future__ import annotations

import argparse

from megatron.trainer.megatron_lm_flags import aliases_of


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the evaluation flags: when to evaluate, held-out prompts, pass@k, the validation
    split and the rollout dump."""
    g = parser.add_argument_group("evaluation")
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


def evaluation_requested(args: argparse.Namespace) -> bool:
    """Whether the run evaluates (``--eval-interval``, ``--eval-iters`` > 0, ``--val-at-start``
    or ``--val-at-end``)."""
    return (
        args.eval_interval is not None
        or args.eval_iters > 0
        or args.val_at_start
        or args.val_at_end
    )
