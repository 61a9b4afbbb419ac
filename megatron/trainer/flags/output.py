"""The output options: checkpoints (save and load) and logging (metrics, plots, TensorBoard,
wandb, tracebacks); and the write probe of the paths they name."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron.trainer.flags.option import COMMANDS, Section, option

OUTPUT_PATHS = (
    ("--save", "dir"),
    ("--tensorboard-dir", "dir"),
    ("--metrics-file", "file"),
    ("--val-dump-dir", "dir"),
    ("--save-hf", "dir"),
    ("--save-lora", "dir"),
)
"""Every path the run writes, checked at start-up (before anything is built)."""


@dataclass(frozen=True)
class Checkpointing(Section):
    """Where checkpoints are written and what a start loads."""

    title = "checkpoints"

    save: str | None = option(None, "Checkpoint directory to write.", parse=str, common=True)
    save_interval: int | None = option(
        None, "Save every N steps.", parse=int, minimum=1, common=True
    )
    load: str | None = option(
        None, "Checkpoint directory to resume from.", parse=str, common=True, commands=COMMANDS
    )
    no_load_optim: bool = option(
        False, "With --load: do not restore the optimizer state (fresh AdamW moments).", switch=True
    )
    no_load_rng: bool = option(False, "With --load: do not restore the RNG states.", switch=True)
    finetune: bool = option(
        False,
        "With --load: load the model weights only and start a new run at iteration 0 (no "
        "optimizer, LR schedule, RNG or rollout state; the resume-flag check is skipped).",
        switch=True,
    )
    ckpt_step: int | None = option(
        None,
        "Load iteration N of --load instead of the one its tracker file names (e.g. the older "
        "complete checkpoint an unreadable one's error names).",
        parse=int,
        minimum=1,
        commands=COMMANDS,
    )
    ckpt_format: str | None = option(
        None,
        "Megatron-LM's checkpoint format; given, it must be the tier's: torch (one file per TP "
        "rank) on the CPU tier, torch_dist (megatron-core dist_checkpointing) on CUDA (default: "
        "the tier's).",
        choices=("torch", "torch_dist"),
        parse=str,
    )

    def problems(self) -> list[str]:
        errors = []
        for flag, on in (
            ("--no-load-optim", self.no_load_optim),
            ("--no-load-rng", self.no_load_rng),
            ("--finetune", self.finetune),
        ):
            if on and self.load is None:
                errors.append(f"{flag} needs --load")
        if self.save_interval is not None and self.save is None:
            errors.append("--save-interval needs --save")
        if self.load is not None and not Path(self.load).is_dir():
            errors.append(f"--load: no such directory {self.load!r}")
        if self.ckpt_step is not None and self.load is None:
            errors.append("--ckpt-step needs --load")
        return errors

    def format_problem(self, cuda: bool) -> str | None:
        """Why ``--ckpt-format`` does not fit the tier the run will use, or None."""
        expected, tier = ("torch_dist", "CUDA") if cuda else ("torch", "CPU")
        if self.ckpt_format not in (None, expected):
            return (
                f"--ckpt-format {self.ckpt_format}: the {tier} tier writes {expected} checkpoints"
            )
        return None


@dataclass(frozen=True)
class Logging(Section):
    """Metrics, plots, TensorBoard, wandb and tracebacks."""

    title = "logging"

    metrics_file: str | None = option(None, "Append per-step JSONL here.", parse=str, common=True)
    plot_file: str | None = option(
        None,
        "PNG of the reward and loss curves written at the end (default: the metrics file with "
        ".png, else runs/curves-<start time>.png; 'none': no plot).",
        parse=str,
    )
    tensorboard_dir: str | None = option(
        None, "Write TensorBoard scalars here (needs the tensorboard package).", parse=str
    )
    wandb_project: str | None = option(
        None,
        "Log every metric to Weights & Biases under this project (pip install wandb; "
        "WANDB_MODE=offline writes locally).",
        parse=str,
        spellings=("TRL: report_to=wandb", "NeMo-RL: logger.wandb.project"),
    )
    wandb_exp_name: str | None = option(None, "The wandb run name.", parse=str)
    wandb_save_dir: str | None = option(
        None, "Local wandb directory (default: <--save>/wandb, else ./wandb).", parse=str
    )
    debug_tracebacks: bool = option(
        False,
        "Print the traceback of expected errors too (bad input, unreadable checkpoint, "
        "environment failures); also on with the environment variable GRPO_DEBUG_TRACEBACKS=1.",
        switch=True,
        commands=COMMANDS,
    )

    def problems(self) -> list[str]:
        errors = []
        if self.wandb_project is not None:
            if importlib.util.find_spec("wandb") is None:
                errors.append("--wandb-project needs the wandb package: pip install wandb")
            if self.wandb_exp_name == "":
                errors.append("--wandb-exp-name must not be empty")
        if self.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
            errors.append(
                "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
            )
        return errors


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
