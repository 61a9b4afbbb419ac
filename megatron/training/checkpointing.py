"""CPU-tier checkpoints: one ``torch.save`` file per model-parallel rank, Megatron-style layout.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt

Only data-parallel rank 0 of each model-parallel group writes. A resumed run continues at the
saved step with the saved policy version; its first L batches are submitted at that version, so
their submission staleness restarts from 0 exactly as at the beginning of a run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.initialize import ParallelContext

TRACKER = "latest_checkpointed_iteration.txt"


def _shard_path(root: str, iteration: int, tp_rank: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"


def save_checkpoint(
    root: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
    ctx: ParallelContext,
) -> None:
    """Write the state after ``iteration`` optimizer steps (collective)."""
    if ctx.dp_rank == 0:
        path = _shard_path(root, iteration, ctx.tp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "iteration": iteration,
            "tensor_model_parallel_size": ctx.tp_size,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    if ctx.is_main:
        tracker = Path(root) / TRACKER
        tmp = tracker.with_suffix(".tmp")
        tmp.write_text(f"{iteration}\n")
        os.replace(tmp, tracker)


def load_checkpoint(
    root: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    ctx: ParallelContext,
) -> int:
    """Restore the latest checkpoint under ``root``; returns its iteration (steps done)."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise SystemExit(f"--load {root}: no {TRACKER} found")
    iteration = int(tracker.read_text().strip())
    path = _shard_path(root, iteration, ctx.tp_rank)
    if not path.is_file():
        raise SystemExit(f"--load {root}: missing {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["tensor_model_parallel_size"] != ctx.tp_size:
        raise SystemExit(
            f"--load {root}: saved with --tensor-model-parallel-size "
            f"{state['tensor_model_parallel_size']}, this run uses {ctx.tp_size}"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return iteration
