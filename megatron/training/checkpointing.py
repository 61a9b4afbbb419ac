"""CPU-tier checkpoints: one ``torch.save`` file per model-parallel rank, Megatron-style layout.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt     model, optimizer, LR scheduler, RNG
    <dir>/iter_0000100/rollout_state.json                the drained rollout pipeline

A checkpoint after ``iteration`` optimizer steps holds the policy version (= ``iteration``) and
everything the forced-lag contract needs to continue exactly: the caller drains the rollout
pipeline first (every submitted batch finished, nothing half generated) and passes its
``PipelineState`` - the prompt cursor, the submitted-batch count and the finished groups not yet
trained on, each rollout carrying the policy version it was submitted at. A resumed run restores
that state, so its steps are identical to those of the uninterrupted run, which drained at the
same step.

Writes are atomic: every rank writes into ``iter_XXXXXXX.partial/``; after a barrier rank 0
renames it to ``iter_XXXXXXX/`` and only then replaces the tracker file. A crash at any point of a
save leaves the previous checkpoint, and the tracker pointing at it, untouched. Only
data-parallel rank 0 of each model-parallel group writes model and optimizer shards.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.rl.rollout.generator import PipelineState
from megatron.training.initialize import ParallelContext

TRACKER = "latest_checkpointed_iteration.txt"
ROLLOUT_STATE = "rollout_state.json"

RESUME_FLAGS = (
    "rl_forced_lag",
    "grpo_prompts_per_step",
    "grpo_group_size",
    "seed",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "grpo_filter_groups_with_same_reward",
    "grpo_max_generation_rounds",
)
"""Flags a resumed run must share with the saved one (different values break exact resume)."""

RESUME_FLAG_DEFAULTS = {
    "grpo_filter_groups_with_same_reward": False,
    "grpo_max_generation_rounds": 1,
}
"""Values of resume flags added later, assumed for checkpoints saved before they existed."""


@dataclass(frozen=True)
class Checkpoint:
    """What ``load_checkpoint`` restores besides the modules it loads into."""

    iteration: int
    """Optimizer steps done: the policy version, and the first step the resumed run trains."""
    pipeline: PipelineState | None
    """The drained rollout pipeline (global rank 0 only; ``None`` elsewhere)."""


def _iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _shard(iter_dir: Path, tp_rank: int) -> Path:
    return iter_dir / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"


def _write_atomic(path: Path, write) -> None:
    """``write(tmp_path)``, flush to disk, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    pipeline: PipelineState | None,
    args: argparse.Namespace,
    ctx: ParallelContext,
) -> None:
    """Write the state after ``iteration`` optimizer steps (collective).

    ``pipeline`` is the drained rollout state on global rank 0 (ignored elsewhere).
    """
    final = _iter_dir(root, iteration)
    staging = final.with_name(final.name + ".partial")
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        staging.mkdir(parents=True)
    _barrier()
    if ctx.dp_rank == 0:
        path = _shard(staging, ctx.tp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "iteration": iteration,
            "tensor_model_parallel_size": ctx.tp_size,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": repr(random.getstate()),
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
        }
        _write_atomic(path, lambda tmp: torch.save(state, tmp))
    if ctx.is_main:
        if pipeline is None:
            raise ValueError("rank 0 must pass the drained rollout pipeline state")
        _write_atomic(
            staging / ROLLOUT_STATE, lambda tmp: tmp.write_text(pipeline.model_dump_json())
        )
    _barrier()
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _write_atomic(Path(root) / TRACKER, lambda tmp: tmp.write_text(f"{iteration}\n"))
    _barrier()


def load_checkpoint(
    root: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    ctx: ParallelContext,
) -> Checkpoint:
    """Restore the latest checkpoint under ``root`` (``--load``) into the given modules."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise SystemExit(f"--load {root}: no {TRACKER} found")
    iteration = int(tracker.read_text().strip())
    path = _shard(_iter_dir(root, iteration), ctx.tp_rank)
    if not path.is_file():
        raise SystemExit(f"--load {root}: missing {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["tensor_model_parallel_size"] != ctx.tp_size:
        raise SystemExit(
            f"--load {root}: saved with --tensor-model-parallel-size "
            f"{state['tensor_model_parallel_size']}, this run uses {ctx.tp_size}"
        )
    for name in RESUME_FLAGS:
        default = RESUME_FLAG_DEFAULTS.get(name)
        saved, now = state["args"].get(name, default), getattr(args, name, default)
        if saved != now:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"--load {root}: saved with {flag} {saved}, this run uses {now}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(ast.literal_eval(state["python_rng"]))
    pipeline = None
    if ctx.is_main:
        rollout_file = _iter_dir(root, iteration) / ROLLOUT_STATE
        if not rollout_file.is_file():
            raise SystemExit(f"--load {root}: missing {rollout_file}")
        pipeline = PipelineState.model_validate_json(rollout_file.read_text())
    return Checkpoint(iteration, pipeline)


def load_reference_weights(root: str, model: torch.nn.Module, ctx: ParallelContext) -> int:
    """Load the model weights of the latest checkpoint under ``root`` (``--ref-load``) into
    ``model``, this rank's tensor-parallel shard; returns the checkpoint's iteration.

    Only the weights are read (no optimizer, RNG or rollout state), so any checkpoint of a model
    of the same shape and TP size serves as a reference policy.
    """
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise SystemExit(f"--ref-load {root}: no {TRACKER} found")
    iteration = int(tracker.read_text().strip())
    path = _shard(_iter_dir(root, iteration), ctx.tp_rank)
    if not path.is_file():
        raise SystemExit(f"--ref-load {root}: missing {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["tensor_model_parallel_size"] != ctx.tp_size:
        raise SystemExit(
            f"--ref-load {root}: saved with --tensor-model-parallel-size "
            f"{state['tensor_model_parallel_size']}, this run uses {ctx.tp_size}"
        )
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise SystemExit(f"--ref-load {root}: the weights do not fit this model: {exc}") from None
    return iteration


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
