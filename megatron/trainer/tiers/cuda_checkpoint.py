"""CUDA-tier checkpoint shards: megatron-core's ``dist_checkpointing`` (torch_dist format).

The directory protocol (iteration directories, staging + rename, tracker file, rollout state,
resume-flag check) is ``megatron/trainer/checkpoint/directory.py``'s, shared with the CPU tier; this
module writes and reads what goes into an iteration directory:

    iter_0000100/metadata.json, common.pt, *.distcp

Every rank writes its shards of the model (keys of the unwrapped ``GPTModel``, so a checkpoint
does not depend on ``--bf16`` or DDP wrapping) and of the optimizer (``fully_reshardable``: a
checkpoint loads into any TP/PP/DP layout and with or without ``--use-distributed-optimizer``).
The LR schedule, the iteration and the flags go to the common part; each model-parallel rank's RNG
states go to a sharded object. With LoRA only the adapters (and their optimizer state) are saved:
the frozen base is rebuilt from ``--hf-checkpoint`` (or the seed) as the run that saved them did.
dist_checkpointing's save calls ``torch.cuda.synchronize`` and
therefore runs on CUDA only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron.rl.lora.model import is_adapter_key, load_trainable_state_dict, lora_adapters
from megatron.trainer.checkpoint.directory import CheckpointShards, LoadOptions, TrainState
from megatron.trainer.parallel import ParallelContext

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How the (distributed) optimizer lays out its state: resharding across layouts allowed."""

SHARDED_STRATEGY = ("torch_dist", 1)
"""dist_checkpointing backend and version."""


class DistShards(CheckpointShards):
    """Model, optimizer, schedule, RNG and flags through ``dist_checkpointing`` (collective)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def write(self, directory: Path, iteration: int, state: TrainState, cfg: dict) -> None:
        """Every rank writes its shards; the common part holds the schedule and the flags."""
        model_sd = _model_sharded(state.model)
        payload = {
            "model": model_sd,
            "optimizer": state.optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA),
            "scheduler": state.scheduler.state_dict(),
            "iteration": iteration,
            "cfg": cfg,
            "rng_state": _rng_object(_rng_state()),
        }
        dist_checkpointing.save(payload, str(directory), sharded_strategy=SHARDED_STRATEGY)

    def read(
        self,
        directory: Path,
        state: TrainState,
        check_args: Callable[[dict], None],
        options: LoadOptions = LoadOptions(),
    ) -> None:
        """Load this rank's shards (any saved layout) into the model and, as ``options`` say,
        the optimizer, schedule and RNG."""
        if not (directory / "metadata.json").is_file():
            raise SystemExit(
                f"--load {directory.parent}: {directory} is not a dist_checkpointing checkpoint"
            )
        common = dist_checkpointing.load_common_state_dict(str(directory))
        check_args(common.get("cfg", {}))
        model_sd = _model_sharded(state.model)
        sharded = {"model": model_sd}
        if options.optimizer:
            sharded["optimizer"] = state.optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
            )
        if options.rng:
            sharded["rng_state"] = _rng_object(None)
        loaded = dist_checkpointing.load(sharded, str(directory), sharded_strategy=None)
        load_trainable_state_dict(state.model, loaded["model"])
        if options.optimizer:
            state.optimizer.load_state_dict(loaded["optimizer"])
            state.scheduler.load_state_dict(loaded["scheduler"])
        if options.rng:
            _set_rng_state(loaded["rng_state"])

    def read_model(self, directory: Path, model: torch.nn.Module, flag: str) -> None:
        """Load only the model's shards (any saved layout) into ``model`` (``--ref-load``)."""
        if not (directory / "metadata.json").is_file():
            raise SystemExit(
                f"{flag} {directory.parent}: {directory} is not a dist_checkpointing checkpoint"
            )
        unwrapped = unwrap_model(model)
        sharded = {"model": unwrapped.sharded_state_dict()}
        loaded = dist_checkpointing.load(sharded, str(directory), sharded_strategy=None)
        unwrapped.load_state_dict(loaded["model"])


def _model_sharded(model: torch.nn.Module) -> dict:
    """The model's ``sharded_state_dict``: with LoRA the adapters' tensors only (the frozen base
    is the run's ``--hf-checkpoint`` or seed, not saved)."""
    sharded = unwrap_model(model).sharded_state_dict()
    if lora_adapters(model) is None:
        return sharded
    return {k: v for k, v in sharded.items() if is_adapter_key(k)}


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
