"""A checkpoint's model for inference only: what ``megatron.trainer.serve`` and
``megatron.trainer.evaluate`` load.

Both commands take ``pretrain_grpo.py``'s flags (``command_parser`` extends
``flags.parse.build_parser``, whose ``--help`` lists the options the command reads and
``--help-all`` every one; ``parse_command_args`` runs the trainer's validation, then the checks
of ``checkpoint_problems`` and the command's own) and build the model the trainer would, on the
tier the device picks, from one of two checkpoints:

* ``--hf-checkpoint DIR``: architecture, tokenizer and weights from a Hugging Face directory;
  policy version 0.
* ``--load DIR [--ckpt-step N]``: the model weights of a trainer checkpoint (iteration N, default
  the tracker's), in the model of the architecture flags or of ``--hf-checkpoint``'s
  ``config.json`` (whose weights are then not read); policy version N. Saved architecture flags
  that differ from the command's are refused by name before any tensor is read.

With LoRA (``--lora-checkpoint DIR``, a PEFT adapter directory, or a LoRA run's ``--lora-rank``
flags with ``--load`` of its checkpoint) the model is built as the trainer builds it: the base
from ``--hf-checkpoint`` (or the seed), the adapters on it, unmerged; a LoRA checkpoint's
adapters must have been trained on that base (its fingerprint is checked).

The model is the tier's forward-only model (``Tier.build_reference``: no DDP, no optimizer, no
random initialization, since the checkpoint fills every tensor), in eval mode without gradients.
One process only: the commands refuse a torchrun world larger than one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from megatron.rl.tokenizer import Tokenizer
from megatron.trainer import config
from megatron.trainer.checkpoint.directory import (
    LoadOptions,
    TrainState,
    fallback_hint,
    iteration_dir,
    latest_iteration,
    read_guarded,
)
from megatron.trainer.errors import UsageError
from megatron.trainer.flags.model import ARCHITECTURE_FLAGS
from megatron.trainer.flags.parse import build_parser, parse_command
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.metrics import report
from megatron.trainer.model.hf_io import weight_loader
from megatron.trainer.model.provider import architecture
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime import kernels
from megatron.trainer.tiers import Tier, select_tier

CHECKPOINT_FLAGS = (*ARCHITECTURE_FLAGS, "group_query_attention", "use_rope_scaling")
CHECKPOINT_FLAGS += (
    "rope_scaling_factor",
    "make_vocab_size_divisible_by",
    "lora_rank",
    "lora_alpha",
    "lora_use_rslora",
)
"""Flags a trainer checkpoint's weights must have been saved with to fit the command's model."""


@dataclass(frozen=True)
class CheckpointModel:
    """A loaded checkpoint: the model to generate with and what it came from."""

    tier: Tier
    tokenizer: Tokenizer
    model: torch.nn.Module
    policy_version: int
    """Optimizer steps behind the weights: the trainer checkpoint's iteration, 0 for a Hugging
    Face checkpoint (the version every generated token reports, and the dump file's)."""
    source: str
    """Where the weights came from, as flags: ``--hf-checkpoint DIR`` or ``--load DIR
    (iteration N)``."""


def command_parser(prog: str, description: str, command: str) -> argparse.ArgumentParser:
    """The trainer's parser (every option of ``megatron/trainer/flags``) under another command's
    name, ``--help`` listing the options ``command`` reads (``Option.commands``), ``--help-all``
    every one; the command adds its own group."""
    parser = build_parser(command=command)
    parser.prog = prog
    parser.description = description
    parser.epilog = (
        "--help-all lists every option: the command accepts all of pretrain_grpo.py's (in argv "
        "or a --config run file) and checks them as the trainer does. Besides those listed here "
        "it reads the architecture flags (which --load needs without --hf-checkpoint) and a few "
        "settings of the process and the model build; training's own options have no effect on "
        "it. docs/flags.md documents every option."
    )
    return parser


def parse_command_args(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    own_checks: Callable[[RunConfig, argparse.Namespace], list[str]],
) -> tuple[RunConfig, argparse.Namespace]:
    """Parse and validate as the trainer does (``flags.parse.parse_command``), then the
    checkpoint and the command's checks (``own_checks(cfg, own) -> list[str]``); the run config
    and the command's own options, or ``UsageError`` (status 2) with every message."""
    cfg, own = parse_command(argv, parser)
    errors = checkpoint_problems(cfg, int(os.environ.get("WORLD_SIZE", "1")), parser.prog)
    errors += own_checks(cfg, own)
    if errors:
        raise UsageError(f"{parser.prog}: error: invalid arguments:\n  " + "\n  ".join(errors))
    return cfg, own


def checkpoint_problems(cfg: RunConfig, world_size: int, prog: str) -> list[str]:
    """Why the flags name no checkpoint to load, or the process is not alone (each message
    naming its flags)."""
    errors = []
    if cfg.model.hf_checkpoint is None and cfg.checkpointing.load is None:
        errors.append(
            "no checkpoint: give --hf-checkpoint DIR (a Hugging Face model directory) or --load "
            "DIR (a trainer checkpoint; its architecture from the model flags or --hf-checkpoint)"
        )
    if world_size != 1:
        errors.append(
            f"{prog} runs in one process, found a world of {world_size} (WORLD_SIZE): start it "
            f"with python -m {prog}, not torchrun"
        )
    return errors


def load_checkpoint_model(cfg: RunConfig, ctx: ParallelContext) -> CheckpointModel:
    """The tier, tokenizer and model of the flags, filled from ``--load`` or
    ``--hf-checkpoint`` (see the module docstring); an unreadable checkpoint raises
    ``SystemExit`` naming the flag."""
    tier = select_tier(config.tier_config(cfg), ctx)
    tokenizer = config.tokenizer(cfg)
    if cfg.lora.enabled:  # base + adapters as the trainer builds them (--lora-checkpoint's)
        model = tier.build_model(tokenizer.vocab_size, weight_loader(tier.config.model))
    else:
        model = tier.build_reference(tokenizer.vocab_size, initialize=False)  # the load fills it
    if cfg.checkpointing.load is not None:
        version = read_trainer_weights(cfg, tier, model)
        source = f"--load {cfg.checkpointing.load} (iteration {version})"
    elif cfg.lora.enabled:
        version, source = 0, f"--hf-checkpoint {cfg.model.hf_checkpoint}"
    else:
        weight_loader(tier.config.model)(unwrap_model(model))
        version, source = 0, f"--hf-checkpoint {cfg.model.hf_checkpoint}"
    if cfg.lora.lora_checkpoint is not None and cfg.checkpointing.load is None:
        source += f" + adapter --lora-checkpoint {cfg.lora.lora_checkpoint}"
    model.eval()
    model.requires_grad_(False)
    return CheckpointModel(tier, tokenizer, model, version, source)


def read_trainer_weights(cfg: RunConfig, tier: Tier, model: torch.nn.Module) -> int:
    """Load the model weights of ``--load``'s iteration ``--ckpt-step`` (default: the
    tracker's) into ``model``; that iteration."""
    root = cfg.checkpointing.load
    iteration = (
        cfg.checkpointing.ckpt_step
        if cfg.checkpointing.ckpt_step is not None
        else latest_iteration(root)
    )
    directory, shards = iteration_dir(root, iteration), tier.checkpoint_shards()
    if not shards.path(directory).exists():
        raise SystemExit(
            f"--load {root}: no checkpoint of iteration {iteration} ({shards.path(directory)} "
            "does not exist)" + fallback_hint(root, iteration)
        )

    def check_flags(saved: dict[str, Any]) -> None:
        differ = architecture_mismatches(saved, cfg.flat())
        if differ:
            raise SystemExit(
                f"--load {root}: iteration {iteration} was saved with {', '.join(differ)}: give "
                "the checkpoint's architecture flags (or the --hf-checkpoint it was trained from)"
            )

    weights_only = LoadOptions(optimizer=False, rng=False, resume=False)
    state = TrainState(model, None, None)
    read_guarded(
        "--load",
        root,
        iteration,
        shards.path(directory),
        lambda: shards.read(directory, state, check_flags, weights_only),
    )
    return iteration


def architecture_mismatches(saved: dict[str, Any], now_values: dict[str, Any]) -> list[str]:
    """Each of ``CHECKPOINT_FLAGS`` whose saved value differs from the command's, as ``--flag
    saved (here: now)`` (``now_values``: ``RunConfig.flat()``). A flag absent from the saved ones was unset (None) or did not exist
    yet (then off)."""
    differ = []
    for name in CHECKPOINT_FLAGS:
        now = now_values.get(name)
        if name not in saved and now in (None, False):
            continue
        before = saved.get(name)
        if before != now:
            differ.append(f"--{name.replace('_', '-')} {before} (here: {now})")
    return differ


def default_model_name(cfg: RunConfig) -> str:
    """The name a served model goes by: its checkpoint directory's (``--load``'s, else
    ``--hf-checkpoint``'s)."""
    return Path(cfg.checkpointing.load or cfg.model.hf_checkpoint).resolve().name


def describe(
    loaded: CheckpointModel, cfg: RunConfig, ctx: ParallelContext, missing: set[str]
) -> str:
    """Lines saying what was loaded and what runs it (counting the parameters is collective)."""
    parameters = report.parameter_count(loaded.model, ctx.tp_group)
    arch = architecture(loaded.tier.config.model, loaded.tokenizer.vocab_size)
    tokenizer = type(loaded.tokenizer).__name__
    lines = [
        f"model        {parameters / 1e6:.2f}M parameters ({loaded.source}): "
        f"{report.describe_architecture(arch)}",
        f"tokenizer    {tokenizer} {cfg.model.tokenizer_model or ''}".rstrip()
        + f", {loaded.tokenizer.vocab_size} ids",
        f"engine       {loaded.tier.describe()}; {cfg.inference.max_requests} slots of "
        f"--seq-length {cfg.model.seq_length} tokens",
    ]
    if missing:
        lines.append(report.kernels_line(missing))
    if kernels.notices():
        lines.append(report.notices_line(kernels.notices()))
    return "\n".join(lines)
