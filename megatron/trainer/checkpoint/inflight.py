"""The KV cache of the requests in flight at a checkpoint: each rank's file next to its shards.

    <dir>/iter_0000100/inflight_kv/rank_00000.pt    {"layout": ..., "slots": {slot: (K, V)}}

Rank 0's ``rollout_state.json`` holds the rest of the pipeline (``PipelineState.engine``: the
requests, their tokens and slots); each rank saves the cache of its own data-parallel replica's
slots, its tensor-parallel shard of the heads. A resume restores them only into the same layout
(world size, TP and DP, slots per replica): otherwise the unfinished groups are generated anew
(``restorable`` says which, and the run says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.rl.refit.layout import InferenceLayout
from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.parallel import ParallelContext

KV_DIR = "inflight_kv"


def layout(
    ctx: ParallelContext, max_requests: int, inference: InferenceLayout | None = None
) -> dict[str, int]:
    """What a saved cache file fits: the engine's parallel layout (the training layout, or an
    inference copy's ``inference``) and its slots per replica."""
    tp, dp = (
        (ctx.tp_size, ctx.dp_size) if inference is None else (inference.tp_size, inference.dp_size)
    )
    return {
        "world_size": ctx.world_size,
        "tp_size": tp,
        "dp_size": dp,
        "max_requests": max_requests,
    }


def kv_file(directory: Path, rank: int) -> Path:
    """This rank's in-flight KV cache file in checkpoint directory ``directory``."""
    return directory / KV_DIR / f"rank_{rank:05d}.pt"


def write_kv(directory: Path, rank: int, slots: dict, saved_layout: dict[str, int]) -> None:
    """Write this rank's slots (``export_slots``'s result) into ``directory`` (staging)."""
    path = kv_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layout": saved_layout, "slots": slots}, path)


def read_kv(directory: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved file (``{"layout", "slots"}``), or None when the save had none."""
    path = kv_file(directory, rank)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def restorable(saved: dict[str, Any] | None, current: dict[str, int], device: torch.device) -> bool:
    """Whether every rank's saved cache fits this run's layout (collective)."""
    ok = torch.tensor([int(saved is not None and saved["layout"] == current)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def saved_line(
    iteration: int,
    root: str,
    seconds: tuple[float, float],
    pipeline: PipelineState | None,
    kv: tuple | None,
) -> str:
    """Rank 0's line after a save: where, how long (capturing the pipeline, in all), and what of
    the generation in flight it kept (the requests, and rank 0's share of their KV cache)."""
    if kv is None:
        kept = "the rollout pipeline drained first"
    else:
        requests = len(pipeline.engine.in_flight) if pipeline and pipeline.engine else 0
        size = _tensor_bytes(kv[0])
        kept = (
            f"{requests} requests in flight kept, their KV cache {size / 2**20:.1f} MiB on rank 0"
        )
    return (
        f"checkpoint: saved iteration {iteration} to {root} in {seconds[1]:.2f} s ({kept}; "
        f"capturing the pipeline took {seconds[0]:.2f} s)"
    )


def _tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0
