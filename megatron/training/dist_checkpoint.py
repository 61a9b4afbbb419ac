"""CUDA-tier checkpoints with megatron-core's ``dist_checkpointing`` (torch_dist format).

Same flags (``--save``, ``--save-interval``, ``--load``), same directory layout and the same
contract as the CPU tier (``megatron.training.checkpointing``):

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/                       dist_checkpointing: metadata.json, common.pt, *.distcp
    <dir>/iter_0000100/rollout_state.json     the drained rollout pipeline

Every rank writes its shards of the model (keys of the unwrapped ``GPTModel``, so a checkpoint
does not depend on ``--bf16`` or DDP wrapping) and of the optimizer (``fully_reshardable``: a
checkpoint loads into any TP/PP/DP layout and with or without ``--use-distributed-optimizer``).
The LR schedule, the iteration and the flags go to the common part; each model-parallel rank's RNG
states go to a sharded object. Writes are atomic as on CPU: into ``iter_XXXXXXX.partial/``, renamed
after a barrier, and only then the tracker file. dist_checkpointing's save calls
``torch.cuda.synchronize`` and therefore runs on CUDA only.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron.rl.rollout.generator import PipelineState
from megatron.training.checkpointing import RESUME_FLAGS, ROLLOUT_STATE, TRACKER, Checkpoint
from megatron.training.initialize import ParallelContext

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How the (distributed) optimizer lays out its state: resharding across layouts allowed."""

SHARDED_STRATEGY = ("torch_dist", 1)
"""dist_checkpointing backend and version."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """``<root>/iter_XXXXXXX`` (the CPU tier's layout)."""
    return Path(root) / f"iter_{iteration:07d}"


def saved_args(args: argparse.Namespace) -> dict[str, Any]:
    """The scalar flags stored with a checkpoint."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (bool, int, float, str))}


def resume_mismatches(saved: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Each flag of ``RESUME_FLAGS`` the resumed run changes, as ``--flag saved -> now``."""
    problems = []
    for name in RESUME_FLAGS:
        before, now = saved.get(name), getattr(args, name, None)
        if before != now:
            problems.append(f"--{name.replace('_', '-')} {before} -> {now}")
    return problems


def _rng_object(state: Any) -> ShardedObject:
    """Per model-parallel rank RNG states (data-parallel replicas share the TP/PP rank's)."""
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    return ShardedObject(
        "rng_state",
        state,
        (pp, tp),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    root: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    pipeline: PipelineState | None,
    args: argparse.Namespace,
    ctx: ParallelContext,
) -> None:
    """Write the state after ``iteration`` optimizer steps (collective; CUDA).

    ``pipeline`` is the drained rollout state on global rank 0 (ignored elsewhere).
    """
    if ctx.is_main and pipeline is None:
        raise ValueError("rank 0 must pass the drained rollout pipeline state")
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".partial")
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        staging.mkdir(parents=True)
    _barrier()
    model_sd = unwrap_model(model).sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "args": saved_args(args),
        "rng_state": _rng_object(_rng_state()),
    }
    dist_checkpointing.save(state, str(staging), sharded_strategy=SHARDED_STRATEGY)
    if ctx.is_main:
        _write_atomic(staging / ROLLOUT_STATE, pipeline.model_dump_json())
    _barrier()
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _write_atomic(Path(root) / TRACKER, f"{iteration}\n")
    _barrier()


def load_checkpoint(
    root: str,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    args: argparse.Namespace,
    ctx: ParallelContext,
) -> Checkpoint:
    """Restore the latest checkpoint under ``root`` (``--load``) into the given modules."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise SystemExit(f"--load {root}: no {TRACKER} found")
    iteration = int(tracker.read_text().strip())
    directory = iteration_dir(root, iteration)
    if not (directory / "metadata.json").is_file():
        raise SystemExit(f"--load {root}: {directory} is not a dist_checkpointing checkpoint")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    problems = resume_mismatches(common.get("args", {}), args)
    if problems:
        raise SystemExit(f"--load {root}: flags differ from the saved run: {', '.join(problems)}")
    unwrapped = unwrap_model(model)
    model_sd = unwrapped.sharded_state_dict()
    sharded = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
        ),
        "rng_state": _rng_object(None),
    }
    state = dist_checkpointing.load(sharded, str(directory), sharded_strategy=None)
    unwrapped.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng_state"])
    pipeline = None
    if ctx.is_main:
        rollout_file = directory / ROLLOUT_STATE
        if not rollout_file.is_file():
            raise SystemExit(f"--load {root}: missing {rollout_file}")
        pipeline = PipelineState.model_validate_json(rollout_file.read_text())
    return Checkpoint(iteration, pipeline)
