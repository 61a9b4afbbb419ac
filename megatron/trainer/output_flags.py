"""The output flags of ``pretrain_grpo.py`` (metrics, plots, TensorBoard, checkpoints, wandb,
tracebacks), each declared once with its help, and the write probe of the paths they name.

Their cross-field checks are in ``flag_validation.validate_args``, which probes ``OUTPUT_PATHS``
with ``output_path_problem`` once everything else is valid.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the output flags: metrics, plots, TensorBoard, checkpoints (save and load), wandb and
    tracebacks."""
    g = parser.add_argument_group("output")
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
        "--ckpt-format",
        choices=["torch", "torch_dist"],
        default=None,
        help="Megatron-LM's checkpoint format; given, it must be the tier's: torch (one file per "
        "TP rank) on the CPU tier, torch_dist (megatron-core dist_checkpointing) on CUDA "
        "(default: the tier's).",
    )
    g.add_argument(
        "--debug-tracebacks",
        action="store_true",
        help="Print the traceback of expected errors too (bad input, unreadable checkpoint, "
        "environment failures); also on with the environment variable GRPO_DEBUG_TRACEBACKS=1.",
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


def ckpt_format_problem(args: argparse.Namespace, cuda: bool) -> str | None:
    """Why ``--ckpt-format`` does not fit the tier the run will use, or None."""
    tier, ckpt_format = ("torch_dist", "CUDA") if cuda else ("torch", "CPU")
    if args.ckpt_format not in (None, tier):
        return f"--ckpt-format {args.ckpt_format}: the {ckpt_format} tier writes {tier} checkpoints"
    return None
